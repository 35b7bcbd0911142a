//! The door of an internal port: what a connection may hold before it has proved the
//! cluster key (I9).
//!
//! The gateway's worker port and every decode worker's KV port admit each connection
//! through a [`Door`]:
//!
//! - the whole handshake and introduction must finish within [`HANDSHAKE_DEADLINE`] (a
//!   deadline, not a read timeout: a peer that trickles a byte every few seconds is cut
//!   off all the same);
//! - at most [`MAX_WAITING`] connections wait to authenticate at once, at most
//!   [`MAX_WAITING_PER_ADDRESS`] from one address. At either cap the oldest waiting
//!   connection (of that address, or of all) is closed to make room for the new one, so
//!   connections that never finish cannot lock a real worker out, even one on the same
//!   address as the attacker: it takes milliseconds to authenticate, and the newest
//!   connection always gets its chance;
//! - frames read before the introduction are at most [`PRE_AUTH_MAX_FRAME`] bytes, and so
//!   is each read until then (`crate::wire::FrameReader::before_handshake`);
//! - refusals are counted by reason ([`Refusal`], `bulkhead:handshake_refusals_total`) and
//!   logged at most once a second per reason, with the number of lines held back.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long a connection has, from its accept, to finish the handshake and introduce
/// itself. A real handshake takes a few round trips.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(3);

/// Connections waiting to authenticate on one port at once.
pub const MAX_WAITING: usize = 64;

/// Connections from one address waiting to authenticate on one port at once.
pub const MAX_WAITING_PER_ADDRESS: usize = 16;

/// The largest frame read before a connection has introduced itself: an `AuthHello` is
/// 38 bytes, a worker's `Hello` under a hundred plus its address.
pub const PRE_AUTH_MAX_FRAME: usize = 512;

/// Why a connection closed before it was admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The handshake did not finish within [`HANDSHAKE_DEADLINE`].
    Deadline,
    /// Closed to make room for a newer connection ([`MAX_WAITING`],
    /// [`MAX_WAITING_PER_ADDRESS`]).
    Evicted,
    /// The port has as many connections as it serves.
    Full,
    /// Bytes that are not a frame, or a frame over [`PRE_AUTH_MAX_FRAME`].
    Malformed,
    /// A frame of the wrong kind for this point of the handshake.
    Unexpected,
    /// A frame of another protocol version.
    Version,
    /// The proof does not match: a different key, or an altered handshake.
    Proof,
    /// The peer has no key where this side has one, or the other way round.
    NoKey,
    /// It authenticated as one worker and introduced itself as another.
    Identity,
}

impl Refusal {
    /// Every reason, in metric order.
    pub const ALL: [Refusal; 9] = [
        Refusal::Deadline,
        Refusal::Evicted,
        Refusal::Full,
        Refusal::Malformed,
        Refusal::Unexpected,
        Refusal::Version,
        Refusal::Proof,
        Refusal::NoKey,
        Refusal::Identity,
    ];

    /// The `reason` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Deadline => "deadline",
            Refusal::Evicted => "evicted",
            Refusal::Full => "full",
            Refusal::Malformed => "malformed",
            Refusal::Unexpected => "unexpected",
            Refusal::Version => "version",
            Refusal::Proof => "proof",
            Refusal::NoKey => "no_key",
            Refusal::Identity => "identity",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Refusals in this process, by reason (`bulkhead:handshake_refusals_total`).
static REFUSALS: [AtomicU64; Refusal::ALL.len()] = [const { AtomicU64::new(0) }; Refusal::ALL.len()];

/// Per reason: when a line was last logged (ms since [`log_epoch`]) and the lines held back since.
static LAST_LOGGED_MS: [AtomicU64; Refusal::ALL.len()] = [const { AtomicU64::new(u64::MAX) }; Refusal::ALL.len()];
static HELD_BACK: [AtomicU64; Refusal::ALL.len()] = [const { AtomicU64::new(0) }; Refusal::ALL.len()];

fn log_epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// The refusals counted so far, by reason.
pub fn refusals() -> impl Iterator<Item = (Refusal, u64)> {
    Refusal::ALL.into_iter().map(|r| (r, REFUSALS[r.index()].load(Ordering::Relaxed)))
}

/// Count a refusal on `port` and log it, at most one line a second per reason: a flood of
/// keyless connections must not become a flood of log.
pub fn refuse(port: &'static str, peer: Option<IpAddr>, reason: Refusal, detail: &dyn std::fmt::Display) {
    let i = reason.index();
    let total = REFUSALS[i].fetch_add(1, Ordering::Relaxed) + 1;
    let now = log_epoch().elapsed().as_millis() as u64;
    let last = LAST_LOGGED_MS[i].load(Ordering::Relaxed);
    let due = last == u64::MAX || now.saturating_sub(last) >= 1000;
    if due && LAST_LOGGED_MS[i].compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
        let held_back = HELD_BACK[i].swap(0, Ordering::Relaxed);
        tracing::warn!(port, ?peer, reason = reason.as_str(), %detail, total, held_back, "connection closed before it authenticated");
    } else {
        HELD_BACK[i].fetch_add(1, Ordering::Relaxed);
    }
}

/// Closes a waiting connection from another thread or task (shuts its socket down, or
/// wakes the task that holds it).
pub type Evict = Box<dyn FnOnce() + Send>;

/// One port's waiting room (see the module docs).
pub struct Door {
    port: &'static str,
    waiting: Mutex<Waiting>,
}

#[derive(Default)]
struct Waiting {
    next: u64,
    /// By ticket, so oldest first.
    by_age: BTreeMap<u64, (IpAddr, Evict)>,
}

impl Door {
    /// The door of `port` (`kv` or `worker`, for logs and metrics).
    pub fn new(port: &'static str) -> Arc<Door> {
        Arc::new(Door { port, waiting: Mutex::default() })
    }

    /// A connection from `addr` starts its handshake; `evict` closes it if it must make
    /// room before it is admitted. Its place is kept until the returned [`Waiter`] is
    /// admitted or dropped.
    pub fn enter(self: &Arc<Self>, addr: IpAddr, evict: Evict) -> Waiter {
        let mut out: Vec<Evict> = Vec::new();
        let ticket = {
            let mut w = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
            let from_addr: Vec<u64> = w.by_age.iter().filter(|(_, (a, _))| *a == addr).map(|(t, _)| *t).collect();
            let over = (from_addr.len() + 1).saturating_sub(MAX_WAITING_PER_ADDRESS);
            for t in from_addr.into_iter().take(over) {
                out.extend(w.by_age.remove(&t).map(|(_, e)| e));
            }
            while w.by_age.len() >= MAX_WAITING {
                out.extend(w.by_age.pop_first().map(|(_, (_, e))| e));
            }
            let t = w.next;
            w.next += 1;
            w.by_age.insert(t, (addr, evict));
            t
        };
        // Outside the lock: an eviction may take a socket call.
        for e in out {
            refuse(self.port, Some(addr), Refusal::Evicted, &"the oldest connection waiting to authenticate made room for a new one");
            e();
        }
        Waiter { door: Arc::clone(self), ticket }
    }

    /// Connections waiting now.
    pub fn waiting(&self) -> usize {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner).by_age.len()
    }

    fn leave(&self, ticket: u64) {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner).by_age.remove(&ticket);
    }
}

/// An internal port's connections in all: at most `max` open at once (registered or still
/// in their handshake), each waiting at the port's [`Door`] until admitted. One more is
/// closed at once and counted (`Full`).
pub struct Port {
    door: Arc<Door>,
    open: Arc<AtomicUsize>,
    max: usize,
}

/// A connection's place among its port's open ones; dropping it (the connection closed)
/// frees it.
pub struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Port {
    /// Port `name` (`kv` or `worker`, for logs and metrics), at most `max` connections.
    pub fn new(name: &'static str, max: usize) -> Port {
        Port { door: Door::new(name), open: Arc::default(), max }
    }

    /// A new connection: its place among the open ones and in the waiting room, or `None`
    /// (refused, counted) when `max` are open. Eviction shuts its socket down, so a
    /// handshake blocked on a read returns at once.
    pub fn enter(&self, stream: &std::net::TcpStream) -> Option<(Open, Waiter)> {
        let peer = stream.peer_addr().ok().map(|a| a.ip());
        if self.open.load(Ordering::Acquire) >= self.max {
            refuse(self.door.port, peer, Refusal::Full, &format_args!("{} connections are open", self.max));
            return None;
        }
        let evictable = stream.try_clone().ok()?;
        let evict: Evict = Box::new(move || {
            let _ = evictable.shutdown(std::net::Shutdown::Both);
        });
        let waiter = self.door.enter(peer.unwrap_or(std::net::Ipv4Addr::UNSPECIFIED.into()), evict);
        self.open.fetch_add(1, Ordering::AcqRel);
        Some((Open(Arc::clone(&self.open)), waiter))
    }
}

/// A connection's place in the waiting room; dropping it (admitted or closed) frees it.
pub struct Waiter {
    door: Arc<Door>,
    ticket: u64,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.door.leave(self.ticket);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn counter() -> (Arc<AtomicUsize>, impl Fn() -> Evict) {
        let evicted = Arc::new(AtomicUsize::new(0));
        let e = Arc::clone(&evicted);
        (evicted, move || {
            let e = Arc::clone(&e);
            Box::new(move || {
                e.fetch_add(1, Ordering::Relaxed);
            }) as Evict
        })
    }

    #[test]
    fn the_oldest_waiting_connection_makes_room_and_a_new_one_always_gets_in() {
        let door = Door::new("test");
        let (evicted, evict) = counter();
        let a: IpAddr = [10, 0, 0, 1].into();
        let held: Vec<Waiter> = (0..MAX_WAITING_PER_ADDRESS).map(|_| door.enter(a, evict())).collect();
        assert_eq!((door.waiting(), evicted.load(Ordering::Relaxed)), (MAX_WAITING_PER_ADDRESS, 0));
        // One more from the same address: the oldest of that address goes.
        let newest = door.enter(a, evict());
        assert_eq!((door.waiting(), evicted.load(Ordering::Relaxed)), (MAX_WAITING_PER_ADDRESS, 1));
        // Many addresses: the room holds MAX_WAITING, oldest out first.
        let others: Vec<Waiter> = (0..MAX_WAITING as u8).map(|i| door.enter([10, 0, 1, i].into(), evict())).collect();
        assert_eq!(door.waiting(), MAX_WAITING);
        assert_eq!(evicted.load(Ordering::Relaxed), 1 + MAX_WAITING_PER_ADDRESS);
        // Leaving frees the place; an evicted connection's own leave changes nothing.
        drop(others);
        assert_eq!(door.waiting(), 0);
        drop((held, newest));
        assert_eq!(door.waiting(), 0);
    }

    #[test]
    fn refusals_are_counted_by_reason() {
        let before: u64 = refusals().filter(|(r, _)| *r == Refusal::Malformed).map(|(_, n)| n).sum();
        for _ in 0..3 {
            refuse("test", None, Refusal::Malformed, &"garbage");
        }
        let after: u64 = refusals().filter(|(r, _)| *r == Refusal::Malformed).map(|(_, n)| n).sum();
        assert_eq!(after - before, 3);
    }
}
