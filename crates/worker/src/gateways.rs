//! A worker's gateways (`--gateway`, one or several): it registers with each under its own
//! id, sends each request's messages to the gateway that made the request (the gateway is
//! part of the request id) and everything else to all of them ([`gateways_for`]), and
//! dials a lost gateway again in the background while the others keep it busy.
//!
//! Losing a gateway ends that gateway's requests on this worker (the worker's main loop
//! aborts them, as the gateway would have); the other gateways' requests go on.

use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::SyncSender;
use std::time::Duration;

use bulkhead_protocol::gateway::gateways_for;
use bulkhead_protocol::{GatewayId, Hello, Message, Purpose, WorkerId};
use bulkhead_transport::handshake::connect_handshake;
use bulkhead_transport::trust::Trust;
use bulkhead_transport::wire::{FrameReader, FrameWriter, WireError, spawn_reader};

use crate::worker::WorkerError;

/// What a gateway connection tells the worker's main loop; `usize` is the gateway's place
/// in the worker's `--gateway` list.
pub enum GatewayIn {
    /// A message from the gateway.
    Msg(usize, Message),
    /// Its connection closed.
    Closed(usize),
    /// Registered (again) with it.
    Joined(usize, Registration),
}

/// A registration: the gateway's id and its connection.
pub struct Registration {
    /// The id the gateway's `Welcome` named.
    pub gateway: GatewayId,
    /// Frames to it.
    pub writer: FrameWriter,
    /// Frames from it.
    pub reader: FrameReader,
}

/// How long a lost gateway is waited for between attempts to register with it again.
const REDIAL_EVERY: Duration = Duration::from_millis(500);

/// The worker's gateway connections. Dropping it stops the dialling of lost ones.
pub struct Gateways<T: Send + 'static> {
    addrs: Vec<String>,
    conns: Vec<Option<(GatewayId, FrameWriter)>>,
    hello: Hello,
    trust: Trust,
    inbox: SyncSender<T>,
    wrap: fn(GatewayIn) -> T,
    /// Cleared on drop: a background dial that registers after that closes its connection.
    alive: Arc<AtomicBool>,
}

/// A worker id nobody else is likely to hold: 32 random bits (a gateway refuses a second
/// live worker with the same id, and the worker then exits and is restarted with another).
pub fn fresh_worker_id() -> Result<WorkerId, WorkerError> {
    let b = bulkhead_transport::trust::random()?;
    Ok(WorkerId(u32::from_le_bytes([b[0], b[1], b[2], b[3]]).max(1)))
}

impl<T: Send + 'static> Gateways<T> {
    /// Register as `hello` says with every gateway in `addrs`. A gateway that refuses the
    /// worker (another model, a wrong key, a taken id) or two that share an id end the start;
    /// one that cannot be reached is dialled again in the background, as long as another
    /// one took the worker. Several gateways need a cluster key: without one each gateway
    /// draws its own cache secret, and their page keys would not agree.
    pub fn register_all(
        addrs: &[String],
        trust: &Trust,
        hello: Hello,
        inbox: SyncSender<T>,
        wrap: fn(GatewayIn) -> T,
    ) -> Result<Self, WorkerError> {
        if addrs.len() > 1 && trust.key.is_none() {
            return Err(WorkerError::Refused(
                "several gateways need a cluster key (--cluster-key-file): without one each gateway draws its own cache secret".into(),
            ));
        }
        let mut g = Gateways {
            addrs: addrs.to_vec(),
            conns: addrs.iter().map(|_| None).collect(),
            hello,
            trust: trust.clone(),
            inbox,
            wrap,
            alive: Arc::new(AtomicBool::new(true)),
        };
        let mut unreachable = None;
        for (i, addr) in addrs.iter().enumerate() {
            match register(addr, trust, &g.hello) {
                Ok(r) => g.joined(i, r)?,
                Err(e @ WorkerError::Connect { .. }) => {
                    tracing::warn!(gateway = %addr, error = %e, "gateway unreachable; dialling it in the background");
                    g.redial(i);
                    unreachable = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        match unreachable {
            Some(e) if g.connected() == 0 => Err(e),
            _ => Ok(g),
        }
    }

    /// The worker's id at its gateways.
    pub fn me(&self) -> WorkerId {
        self.hello.worker
    }

    /// The id of the gateway at `index`, while it is connected.
    pub fn id(&self, index: usize) -> Option<GatewayId> {
        self.conns.get(index)?.as_ref().map(|(id, _)| *id)
    }

    /// Gateways connected now.
    pub fn connected(&self) -> usize {
        self.conns.iter().flatten().count()
    }

    /// Take registration `r` with the gateway at `index`: its reader feeds the inbox. Two
    /// gateways with one id would mix their requests: refused.
    pub fn joined(&mut self, index: usize, r: Registration) -> Result<(), WorkerError> {
        if let Some(other) = self.conns.iter().flatten().find(|(id, _)| *id == r.gateway) {
            r.writer.shutdown();
            return Err(WorkerError::Refused(format!(
                "{} and another gateway both call themselves {} (give each its own --gateway-id)",
                self.addrs[index], other.0
            )));
        }
        tracing::info!(gateway = %self.addrs[index], id = %r.gateway, worker = %self.hello.worker, "registered with a gateway");
        let wrap = self.wrap;
        spawn_reader(r.reader, self.inbox.clone(), move |m| wrap(GatewayIn::Msg(index, m)), wrap(GatewayIn::Closed(index)));
        self.conns[index] = Some((r.gateway, r.writer));
        Ok(())
    }

    /// The connection to the gateway at `index` closed: forget it, dial it again in the
    /// background, and return its id (its requests here are to be ended).
    pub fn closed(&mut self, index: usize) -> Option<GatewayId> {
        let (id, w) = self.conns.get_mut(index)?.take()?;
        w.shutdown();
        tracing::warn!(gateway = %self.addrs[index], %id, "gateway connection closed; its requests here end, dialling it again");
        self.redial(index);
        Some(id)
    }

    /// Send `msg` where it belongs: a request's message to its gateway (dropped when that
    /// gateway is gone: its requests here were ended), anything else to every gateway. A
    /// failed write closes that connection (its reader reports the close).
    pub fn send(&mut self, msg: &Message) {
        for w in gateways_for(msg, self.conns.iter_mut().flatten().map(|(id, w)| (*id, w))) {
            if w.send(msg).is_err() {
                w.shutdown();
            }
        }
    }

    /// Send `msg` to the gateway at `index` only (a snapshot for a gateway that just took
    /// the worker).
    pub fn send_to(&mut self, index: usize, msg: &Message) {
        if let Some((_, w)) = self.conns.get_mut(index).and_then(Option::as_mut)
            && w.send(msg).is_err()
        {
            w.shutdown();
        }
    }

    /// Close every connection (the worker leaves).
    pub fn close_all(&mut self) {
        self.alive.store(false, Ordering::Release);
        for (_, w) in self.conns.iter_mut().filter_map(Option::take) {
            w.shutdown();
        }
    }

    /// Register with the gateway at `index` again, in the background, until it answers
    /// or this worker leaves.
    fn redial(&self, index: usize) {
        let (addr, trust, hello, inbox, wrap, alive) =
            (self.addrs[index].clone(), self.trust.clone(), self.hello.clone(), self.inbox.clone(), self.wrap, self.alive.clone());
        std::thread::spawn(move || {
            while alive.load(Ordering::Acquire) {
                std::thread::sleep(REDIAL_EVERY);
                match register(&addr, &trust, &hello) {
                    Ok(r) if alive.load(Ordering::Acquire) => {
                        let _ = inbox.send(wrap(GatewayIn::Joined(index, r)));
                        return;
                    }
                    Ok(r) => r.writer.shutdown(),
                    Err(e @ WorkerError::Connect { .. }) => tracing::debug!(gateway = %addr, error = %e, "gateway still unreachable"),
                    Err(e) => tracing::warn!(gateway = %addr, error = %e, "gateway refused this worker; trying again"),
                }
            }
        });
    }
}

impl<T: Send + 'static> Drop for Gateways<T> {
    fn drop(&mut self) {
        self.close_all();
    }
}

/// Connect to the gateway at `addr`, authenticate with the cluster key if there is one,
/// and register as `hello` says.
pub fn register(addr: &str, trust: &Trust, hello: &Hello) -> Result<Registration, WorkerError> {
    let stream = connect_retry(addr)?;
    stream.set_nodelay(true)?;
    let mut reader = FrameReader::new(stream.try_clone()?);
    let mut writer = FrameWriter::new(stream);
    let auth = connect_handshake(&mut reader, &mut writer, trust, Purpose::Control, 0).map_err(|e| match e {
        WireError::Auth(a) => WorkerError::Refused(a.to_string()),
        other => WorkerError::Wire(other),
    })?;
    tracing::info!(gateway = %addr, authenticated = auth.is_some(), encrypted = auth.is_some_and(|a| a.encrypted), "connected to the gateway");
    writer.send(&Message::Hello(hello.clone()))?;
    match reader.recv()? {
        Message::Welcome { gateway } => Ok(Registration { gateway, writer, reader }),
        Message::Refuse { reason } | Message::AuthRefused { reason } => Err(WorkerError::Refused(reason)),
        other => Err(WorkerError::Refused(format!("unexpected first message {}", other.kind_name()))),
    }
}

/// The gateway may still be starting: retry for a few seconds.
fn connect_retry(addr: &str) -> Result<TcpStream, WorkerError> {
    let mut last = None;
    for _ in 0..50 {
        match TcpStream::connect(addr) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(WorkerError::Connect { addr: addr.to_string(), source: last.unwrap_or_else(|| std::io::Error::other("no attempt")) })
}
