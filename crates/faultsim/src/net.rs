//! The in-process transport: connections that give the protocol what TCP gives it.
//!
//! Every message is encoded with the production codec and travels as bytes, sometimes
//! split in two segments, into the receiver's [`FrameDecoder`]. Per direction a connection
//! is FIFO and exactly-once; each message gets a delivery time of `now + latency`, never
//! before the previous one on the same direction, so messages on different connections
//! overtake each other freely (the only reordering TCP allows). What goes wrong is what a
//! deployment sees:
//!
//! - **cut** ([`Net::cut`]): a reset or a dead link. Each direction keeps a random prefix
//!   of what was in flight (the rest is lost, possibly mid-frame), then both ends see the
//!   connection close.
//! - **bad bytes** ([`Net::garble`]): bytes no encoder produced land between two frames
//!   (bad magic, another version, an unknown kind, an oversize length). The receiver's
//!   decoder refuses them and the receiver closes the connection ([`Net::close_by`]);
//!   this is how a duplicated or reordered segment inside one connection would surface
//!   (TCP itself never delivers one).
//! - **crash** ([`Net::crash`]): a process dies. What was on its way to it is lost, what
//!   it had sent is cut at a random point, and its peers see the close.
//!
//! [`Net::raw_duplicates`] (off in every normal schedule) breaks the TCP contract on
//! purpose: a frame is sometimes delivered twice on its connection, to show what the
//! roles do when the transport does not hold up its end (see `docs/PROTOCOL.md`,
//! "relies on exactly-once, in-order connections").

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

use bulkhead_protocol::{CodecError, DEFAULT_MAX_FRAME, FrameDecoder, Message, VERSION, WorkerId, encode};

use crate::dice::Dice;

/// A connection's id, unique within a schedule (never reused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ConnId(pub u32);

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "c{}", self.0)
    }
}

/// One end of a connection: the gateway or a worker process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum End {
    /// A gateway (its index in the plan).
    Gateway(u8),
    /// A prefill or decode worker.
    Worker(WorkerId),
}

impl fmt::Display for End {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            End::Gateway(0) => write!(f, "gw"),
            End::Gateway(g) => write!(f, "gw{g}"),
            End::Worker(w) => write!(f, "w{}", w.0),
        }
    }
}

/// What a delivery hands the receiver.
#[derive(Debug)]
pub enum Arrival {
    /// A whole message.
    Message(Message),
    /// Part of a frame; nothing to handle yet.
    Partial,
    /// The connection closed: nothing more will arrive on it.
    Closed,
    /// Bytes the decoder refused: the receiver must close the connection.
    Garbled(CodecError),
}

/// One step of the transport: something reached `to` on `conn`, sent by `from`.
#[derive(Debug)]
pub struct Delivery {
    /// The connection.
    pub conn: ConnId,
    /// The receiving end.
    pub to: End,
    /// The sending end.
    pub from: End,
    /// What arrived.
    pub arrival: Arrival,
}

#[derive(Debug)]
enum Item {
    Bytes(Vec<u8>),
    Close,
}

#[derive(Debug)]
struct Pipe {
    items: VecDeque<(u64, Item)>,
    /// Delivery time of the last item queued: later items never arrive before it.
    last_at: u64,
    decoder: FrameDecoder,
    /// A close is queued or delivered: nothing more is queued after it.
    closing: bool,
}

impl Pipe {
    fn new() -> Self {
        Pipe { items: VecDeque::new(), last_at: 0, decoder: FrameDecoder::new(DEFAULT_MAX_FRAME), closing: false }
    }

    fn push(&mut self, at: u64, item: Item) {
        self.last_at = self.last_at.max(at);
        self.items.push_back((self.last_at, item));
    }

    /// Loses everything after a random prefix and queues the close.
    fn cut(&mut self, at: u64, dice: &mut Dice) {
        if self.closing {
            return;
        }
        let keep = dice.below(self.items.len() as u64 + 1) as usize;
        self.items.truncate(keep);
        self.push(at, Item::Close);
        self.closing = true;
    }

    /// The receiver is gone or stopped reading: nothing more is delivered to it.
    fn discard(&mut self) {
        self.items.clear();
        self.closing = true;
    }
}

#[derive(Debug)]
struct Conn {
    ends: [End; 2],
    open: bool,
    /// `pipes[d]` carries `ends[d]` → `ends[1 - d]`.
    pipes: [Pipe; 2],
    latency_ms: u64,
    jitter_ms: u64,
}

impl Conn {
    fn dir_from(&self, from: End) -> Option<usize> {
        self.ends.iter().position(|e| *e == from)
    }

    fn delay(&self, now: u64, dice: &mut Dice) -> u64 {
        now + self.latency_ms + dice.below(self.jitter_ms + 1)
    }
}

/// Every connection of a schedule.
#[derive(Debug, Default)]
pub struct Net {
    conns: BTreeMap<ConnId, Conn>,
    next: u32,
    /// Per mille of frames delivered twice (breaks TCP's contract; 0 in normal schedules).
    pub raw_duplicates: u64,
    /// Per mille of connections that are slow (latency jitter up to 300 ms instead of 10).
    pub slow_links: u64,
}

/// Bytes no encoder produces, each refused by the decoder for another reason.
const GARBAGE: [&[u8]; 4] = [
    b"GET / HTTP/1.1\r\n",
    &[b'B', b'H', VERSION.wrapping_add(100), 1, 0, 0, 0, 0],
    &[b'B', b'H', VERSION, 250, 0, 0, 0, 0],
    &[b'B', b'H', VERSION, 1, 0xff, 0xff, 0xff, 0x7f],
];

impl Net {
    /// A network with no connection yet.
    pub fn new(slow_links: u64, raw_duplicates: u64) -> Self {
        Net { conns: BTreeMap::new(), next: 0, raw_duplicates, slow_links }
    }

    /// Opens a connection between `a` and `b` with its own latency.
    pub fn connect(&mut self, a: End, b: End, dice: &mut Dice) -> ConnId {
        let id = ConnId(self.next);
        self.next += 1;
        let latency_ms = dice.range(0, 5);
        let jitter_ms = if dice.chance(self.slow_links) { dice.range(20, 300) } else { dice.range(0, 10) };
        self.conns.insert(id, Conn { ends: [a, b], open: true, pipes: [Pipe::new(), Pipe::new()], latency_ms, jitter_ms });
        id
    }

    /// Whether `id` is open (neither cut nor closed by an end).
    pub fn is_open(&self, id: ConnId) -> bool {
        self.conns.get(&id).is_some_and(|c| c.open)
    }

    /// Queues `m` from `from` on `id`. A message on a closed connection is lost, as a
    /// write into a reset socket is; returns whether it was queued.
    pub fn send(&mut self, id: ConnId, from: End, m: &Message, now: u64, dice: &mut Dice) -> bool {
        let raw_duplicates = self.raw_duplicates;
        let Some(c) = self.conns.get_mut(&id).filter(|c| c.open) else { return false };
        let Some(d) = c.dir_from(from) else { return false };
        let mut bytes = Vec::new();
        encode(m, &mut bytes);
        let copies = if dice.chance(raw_duplicates) { 2 } else { 1 };
        for _ in 0..copies {
            let at = c.delay(now, dice);
            let pipe = &mut c.pipes[d];
            if bytes.len() > 1 && dice.chance(200) {
                let split = dice.range(1, bytes.len() as u64 - 1) as usize;
                pipe.push(at, Item::Bytes(bytes[..split].to_vec()));
                pipe.push(at + dice.below(3), Item::Bytes(bytes[split..].to_vec()));
            } else {
                pipe.push(at, Item::Bytes(bytes.clone()));
            }
        }
        true
    }

    /// Queues bytes the decoder refuses after what `from` already sent on `id`.
    pub fn garble(&mut self, id: ConnId, from: End, now: u64, dice: &mut Dice) -> bool {
        let Some(c) = self.conns.get_mut(&id).filter(|c| c.open) else { return false };
        let Some(d) = c.dir_from(from) else { return false };
        let bytes = GARBAGE[dice.below(GARBAGE.len() as u64) as usize].to_vec();
        let at = c.delay(now, dice);
        c.pipes[d].push(at, Item::Bytes(bytes));
        true
    }

    /// The link dies: each direction keeps a random prefix of what was in flight, then
    /// both ends see the close.
    pub fn cut(&mut self, id: ConnId, now: u64, dice: &mut Dice) -> bool {
        let Some(c) = self.conns.get_mut(&id).filter(|c| c.open) else { return false };
        c.open = false;
        for d in 0..2 {
            let at = c.delay(now, dice);
            c.pipes[d].cut(at, dice);
        }
        true
    }

    /// `closer` closes `id` (it refused bytes, or the connection is not one it accepts):
    /// it reads nothing more; what it sent is delivered, then the peer sees the close.
    pub fn close_by(&mut self, id: ConnId, closer: End, now: u64, dice: &mut Dice) {
        let Some(c) = self.conns.get_mut(&id) else { return };
        let Some(d) = c.dir_from(closer) else { return };
        c.open = false;
        c.pipes[1 - d].discard();
        if !c.pipes[d].closing {
            let at = c.delay(now, dice);
            c.pipes[d].push(at, Item::Close);
            c.pipes[d].closing = true;
        }
        self.collect(id);
    }

    /// `end`'s process dies: nothing more reaches it, what it sent is cut at a random
    /// point, and every peer sees its connection close.
    pub fn crash(&mut self, end: End, now: u64, dice: &mut Dice) {
        let ids: Vec<ConnId> = self.conns.iter().filter(|(_, c)| c.dir_from(end).is_some()).map(|(id, _)| *id).collect();
        for id in ids {
            let Some(c) = self.conns.get_mut(&id) else { continue };
            let Some(d) = c.dir_from(end) else { continue };
            c.open = false;
            c.pipes[1 - d].discard();
            let at = c.delay(now, dice);
            c.pipes[d].cut(at, dice);
            self.collect(id);
        }
    }

    /// Directions whose next item is due at `now`, in id order.
    pub fn due(&self, now: u64) -> Vec<(ConnId, usize)> {
        let mut out = Vec::new();
        for (id, c) in &self.conns {
            for (d, p) in c.pipes.iter().enumerate() {
                if p.items.front().is_some_and(|(at, _)| *at <= now) {
                    out.push((*id, d));
                }
            }
        }
        out
    }

    /// When the next item anywhere is due.
    pub fn next_due(&self) -> Option<u64> {
        self.conns.values().flat_map(|c| c.pipes.iter()).filter_map(|p| p.items.front().map(|(at, _)| *at)).min()
    }

    /// Nothing in flight anywhere.
    pub fn idle(&self) -> bool {
        self.conns.values().all(|c| c.pipes.iter().all(|p| p.items.is_empty()))
    }

    /// Delivers the next item of direction `d` of `id`.
    pub fn deliver(&mut self, id: ConnId, d: usize) -> Option<Delivery> {
        let c = self.conns.get_mut(&id)?;
        let (from, to) = (c.ends[d], c.ends[1 - d]);
        let pipe = &mut c.pipes[d];
        let (_, item) = pipe.items.pop_front()?;
        let arrival = match item {
            Item::Close => Arrival::Closed,
            Item::Bytes(b) => {
                pipe.decoder.push(&b);
                match pipe.decoder.next_message() {
                    Ok(Some(m)) => Arrival::Message(m),
                    Ok(None) => Arrival::Partial,
                    Err(e) => Arrival::Garbled(e),
                }
            }
        };
        self.collect(id);
        Some(Delivery { conn: id, to, from, arrival })
    }

    /// Forgets a closed connection once nothing of it is in flight.
    fn collect(&mut self, id: ConnId) {
        if self.conns.get(&id).is_some_and(|c| !c.open && c.pipes.iter().all(|p| p.items.is_empty())) {
            self.conns.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_kv::RequestId;

    fn fenced(r: u64) -> Message {
        Message::Fenced { req: RequestId(r) }
    }

    fn drain(net: &mut Net, dice: &mut Dice) -> Vec<(End, String)> {
        let mut out = Vec::new();
        let mut now = 0;
        while !net.idle() {
            let due = net.due(now);
            let Some(&(id, d)) = dice.pick(&due) else {
                now = net.next_due().unwrap_or(now + 1);
                continue;
            };
            let del = net.deliver(id, d).unwrap();
            match del.arrival {
                Arrival::Message(m) => out.push((del.to, format!("{m:?}"))),
                Arrival::Closed => out.push((del.to, "closed".into())),
                Arrival::Garbled(e) => out.push((del.to, format!("garbled {e}"))),
                Arrival::Partial => {}
            }
        }
        out
    }

    #[test]
    fn one_direction_delivers_every_message_once_in_order() {
        for seed in 0..50 {
            let mut dice = Dice::new(seed);
            let mut net = Net::new(500, 0);
            let c = net.connect(End::Gateway(0), End::Worker(WorkerId(1)), &mut dice);
            for r in 0..20 {
                assert!(net.send(c, End::Gateway(0), &fenced(r), r * 3, &mut dice));
            }
            let got = drain(&mut net, &mut dice);
            let want: Vec<(End, String)> = (0..20).map(|r| (End::Worker(WorkerId(1)), format!("{:?}", fenced(r)))).collect();
            assert_eq!(got, want, "seed {seed}");
        }
    }

    #[test]
    fn a_cut_loses_a_suffix_and_ends_both_directions_with_a_close() {
        let mut saw_loss = false;
        for seed in 0..50 {
            let mut dice = Dice::new(seed);
            let mut net = Net::default();
            let (a, b) = (End::Worker(WorkerId(1)), End::Worker(WorkerId(2)));
            let c = net.connect(a, b, &mut dice);
            for r in 0..10 {
                net.send(c, a, &fenced(r), 0, &mut dice);
                net.send(c, b, &fenced(100 + r), 0, &mut dice);
            }
            assert!(net.cut(c, 0, &mut dice));
            assert!(!net.send(c, a, &fenced(99), 1, &mut dice), "nothing is queued on a cut connection");
            let got = drain(&mut net, &mut dice);
            for (to, first) in [(b, 0), (a, 100)] {
                let mine: Vec<&String> = got.iter().filter(|(e, _)| *e == to).map(|(_, s)| s).collect();
                assert_eq!(mine.last().map(|s| s.as_str()), Some("closed"), "seed {seed}");
                let msgs = &mine[..mine.len() - 1];
                let prefix: Vec<String> = (first..first + msgs.len() as u64).map(|r| format!("{:?}", fenced(r))).collect();
                assert_eq!(msgs.iter().map(|s| s.to_string()).collect::<Vec<_>>(), prefix, "seed {seed}: a prefix survives");
                saw_loss |= msgs.len() < 10;
            }
        }
        assert!(saw_loss);
    }

    #[test]
    fn garbage_is_refused_by_the_decoder_after_the_frames_before_it() {
        for seed in 0..20 {
            let mut dice = Dice::new(seed);
            let mut net = Net::default();
            let (a, b) = (End::Gateway(0), End::Worker(WorkerId(3)));
            let c = net.connect(a, b, &mut dice);
            net.send(c, a, &fenced(1), 0, &mut dice);
            assert!(net.garble(c, a, 0, &mut dice));
            let mut now = 0;
            let mut got = Vec::new();
            while got.len() < 2 {
                let due = net.due(now);
                let Some(&(id, d)) = due.first() else {
                    now = net.next_due().unwrap();
                    continue;
                };
                let del = net.deliver(id, d).unwrap();
                match del.arrival {
                    Arrival::Message(m) => got.push(format!("{m:?}")),
                    Arrival::Garbled(_) => {
                        got.push("garbled".into());
                        net.close_by(c, b, now, &mut dice);
                    }
                    Arrival::Partial => {}
                    other => panic!("seed {seed}: {other:?}"),
                }
            }
            assert_eq!(got, [format!("{:?}", fenced(1)), "garbled".to_string()]);
            let rest = drain(&mut net, &mut dice);
            assert_eq!(rest, [(a, "closed".to_string())], "seed {seed}: the sender sees the close");
        }
    }
}
