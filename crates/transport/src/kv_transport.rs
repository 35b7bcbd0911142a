//! Which road a KV connection's frames take from the prefill to the decode worker: UCX
//! (shared memory or CMA on one host, RDMA between hosts) or Bulkhead's own TCP framing.
//!
//! The choice is made once per connection, right after `KvHello`, over the TCP connection
//! and its authenticated session (I9): the decode worker answers every `KvHello` with
//! `KvUcxAddress` (its UCX worker's address, or empty), and after a non-empty one the
//! prefill says `KvUcxUse` (its own address, or empty for TCP). Either way the frames are the same: the same encoder (MAC,
//! encryption) on the prefill side, the same decoder and chunk verifier before any byte
//! reaches a pool page on the decode side. The decode side never registers memory for a
//! peer ([`bulkhead_ucx`]), so no peer can write into it late (I4). The decode→prefill
//! direction always stays on TCP, and the TCP connection stays open on both sides: its end
//! is how either side learns that the other is gone.

use std::sync::atomic::{AtomicU64, Ordering};

use bulkhead_protocol::Message;

use crate::trust::Trust;

/// How long each answer may take while a KV connection is set up after its introduction
/// (choosing the transport), and the connecting side's wait for each handshake answer.
pub const HELLO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
use crate::wire::{FrameReader, FrameWriter, WireError};

/// `--kv-transport`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvTransport {
    /// UCX where it loads, the session is authenticated, and the peers share a transport
    /// faster than TCP (shared memory, CMA, RDMA); TCP otherwise.
    #[default]
    Auto,
    /// UCX on every KV connection (any transport UCX finds, its TCP included); a
    /// connection that cannot use it fails.
    Ucx,
    /// Bulkhead's TCP framing only.
    Tcp,
}

/// KV connections opened or accepted in this process, by the road their frames took.
static UCX_CONNECTIONS: AtomicU64 = AtomicU64::new(0);
static TCP_CONNECTIONS: AtomicU64 = AtomicU64::new(0);

/// `(transport, connections)` so far, for `bulkhead:kv_connections_total`.
pub fn connections() -> [(&'static str, u64); 2] {
    [("ucx", UCX_CONNECTIONS.load(Ordering::Relaxed)), ("tcp", TCP_CONNECTIONS.load(Ordering::Relaxed))]
}

/// What a KV connection chose, and why (for its log line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chosen {
    /// UCX, with the lanes it uses where this side knows them.
    Ucx(String),
    /// TCP, and why not UCX.
    Tcp(String),
}

impl Chosen {
    fn counted(self) -> Self {
        let c = if matches!(self, Chosen::Ucx(_)) { &UCX_CONNECTIONS } else { &TCP_CONNECTIONS };
        c.fetch_add(1, Ordering::Relaxed);
        self
    }

    /// `"ucx"` or `"tcp"`.
    pub fn name(&self) -> &'static str {
        if matches!(self, Chosen::Ucx(_)) { "ucx" } else { "tcp" }
    }

    /// The lanes (UCX) or the reason (TCP).
    pub fn detail(&self) -> &str {
        match self {
            Chosen::Ucx(d) | Chosen::Tcp(d) => d,
        }
    }
}

/// Where the connection's peer runs, for UCX: on this host when both ends of the TCP
/// connection have one address (loopback included). Peers in two network namespaces of
/// one host count as two hosts and take rendezvous, which works between them.
fn peer(w: &FrameWriter) -> bulkhead_ucx::Peer {
    match (w.peer_ip(), w.local_ip()) {
        (Some(p), Some(l)) if p == l => bulkhead_ucx::Peer::SameHost,
        _ => bulkhead_ucx::Peer::OtherHost,
    }
}

impl KvTransport {
    /// Refuse a setting that cannot work here, at start: `ucx` needs UCX and a cluster key
    /// (worker addresses only travel over an authenticated session, I9).
    pub fn check(self, trust: &Trust) -> Result<(), String> {
        if self != KvTransport::Ucx {
            return Ok(());
        }
        if trust.key.is_none() {
            return Err("--kv-transport ucx needs a cluster key (--cluster-key-file FILE): UCX addresses are only exchanged over an authenticated session".into());
        }
        bulkhead_ucx::version().map(drop).map_err(|e| format!("--kv-transport ucx: {e}"))
    }

    fn transports(self) -> bulkhead_ucx::Transports {
        if self == KvTransport::Ucx { bulkhead_ucx::Transports::Any } else { bulkhead_ucx::Transports::Fast }
    }

    /// Whether this side may put UCX to use on a connection whose session is
    /// `authenticated`, or why not. Nothing from an unauthenticated session ever reaches
    /// UCX's C parser (I9).
    fn allowed(self, authenticated: bool) -> Result<(), String> {
        match (self, authenticated) {
            (KvTransport::Tcp, _) => Err("--kv-transport tcp".into()),
            (_, false) => Err("the session is not authenticated (a cluster without a key)".into()),
            _ => Ok(()),
        }
    }

    /// TCP because of `why`, or an error where this side insists on UCX.
    fn fall_back(self, why: String) -> Result<Chosen, WireError> {
        match self {
            KvTransport::Ucx => Err(WireError::Transport(format!("--kv-transport ucx, and UCX cannot be used: {why}"))),
            _ => Ok(Chosen::Tcp(why)),
        }
    }

    /// Decode side, after a valid `KvHello` on a connection whose session is
    /// `authenticated`: offer a UCX address (or none), then learn which road the prefill's
    /// frames take and set `r` up for it.
    pub fn accept(self, authenticated: bool, r: &mut FrameReader, w: &mut FrameWriter) -> Result<Chosen, WireError> {
        self.offer(authenticated, r, w).map(Chosen::counted)
    }

    fn offer(self, authenticated: bool, r: &mut FrameReader, w: &mut FrameWriter) -> Result<Chosen, WireError> {
        let receiver =
            self.allowed(authenticated).and_then(|()| bulkhead_ucx::Receiver::new(self.transports(), peer(w)).map_err(|e| e.to_string()));
        let address = receiver.as_ref().map(|rx| rx.address().to_vec()).unwrap_or_default();
        w.send(&Message::KvUcxAddress { address })?;
        let mut rx = match receiver {
            Ok(rx) => rx,
            Err(why) => return self.fall_back(why),
        };
        match r.recv()? {
            Message::KvUcxUse { address } if !address.is_empty() => {
                rx.connect_back(&address)?;
                r.use_ucx(rx)?;
                // The lanes are in the prefill side's log line: only the sender can see them.
                Ok(Chosen::Ucx("lanes in the prefill worker's log".into()))
            }
            Message::KvUcxUse { .. } => self.fall_back("the prefill worker chose TCP".into()),
            other => Err(WireError::Transport(format!("{} where KvUcxUse was due", other.kind_name()))),
        }
    }

    /// Prefill side, after sending `KvHello` on a connection whose session is
    /// `authenticated`: read the decode worker's answer, choose, say so, and set `w` up.
    pub fn connect(self, authenticated: bool, r: &mut FrameReader, w: &mut FrameWriter) -> Result<Chosen, WireError> {
        self.answer(authenticated, r, w).map(Chosen::counted)
    }

    fn answer(self, authenticated: bool, r: &mut FrameReader, w: &mut FrameWriter) -> Result<Chosen, WireError> {
        let address = match r.recv()? {
            Message::KvUcxAddress { address } => address,
            other => return Err(WireError::Transport(format!("{} where KvUcxAddress was due", other.kind_name()))),
        };
        if address.is_empty() {
            return self.fall_back("the decode worker offers TCP only".into());
        }
        let sender = self
            .allowed(authenticated)
            .and_then(|()| bulkhead_ucx::Sender::connect(&address, self.transports(), peer(w)).map_err(|e| e.to_string()));
        w.send(&Message::KvUcxUse { address: sender.as_ref().map(|tx| tx.address().to_vec()).unwrap_or_default() })?;
        match sender {
            Ok(tx) => {
                let lanes = tx.transports();
                w.use_ucx(tx);
                Ok(Chosen::Ucx(lanes))
            }
            Err(why) => self.fall_back(why),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    /// Run the decode side with `decode` on one end of a loopback connection and the
    /// prefill side with `prefill` on the other, each told whether its session is
    /// authenticated; both choices.
    fn negotiate(decode: (KvTransport, bool), prefill: (KvTransport, bool)) -> (Result<Chosen, String>, Result<Chosen, String>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let d = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let (mut r, mut w) = (FrameReader::new(s.try_clone().unwrap()), FrameWriter::new(s));
            decode.0.accept(decode.1, &mut r, &mut w).map_err(|e| e.to_string())
        });
        let s = TcpStream::connect(addr).unwrap();
        let (mut r, mut w) = (FrameReader::new(s.try_clone().unwrap()), FrameWriter::new(s));
        let p = prefill.0.connect(prefill.1, &mut r, &mut w).map_err(|e| e.to_string());
        (d.join().unwrap(), p)
    }

    #[test]
    fn an_unauthenticated_session_never_takes_ucx() {
        // The decode side offers nothing without a key...
        let (d, p) = negotiate((KvTransport::Auto, false), (KvTransport::Auto, true));
        assert!(matches!(&d, Ok(Chosen::Tcp(why)) if why.contains("not authenticated")), "{d:?}");
        assert!(matches!(&p, Ok(Chosen::Tcp(_))), "{p:?}");
        // ...and the prefill side hands UCX no address from an unauthenticated session, even
        // one offered (where UCX loads, the decode side does offer it here).
        let (d, p) = negotiate((KvTransport::Auto, true), (KvTransport::Auto, false));
        assert!(matches!(&d, Ok(Chosen::Tcp(_))), "{d:?}");
        assert!(matches!(&p, Ok(Chosen::Tcp(why)) if why.contains("not authenticated") || why.contains("offers TCP only")), "{p:?}");
        // Insisting on UCX without one fails instead of falling back.
        let (_, p) = negotiate((KvTransport::Auto, false), (KvTransport::Ucx, false));
        assert!(p.is_err(), "{p:?}");
    }

    #[test]
    fn tcp_on_either_side_keeps_tcp() {
        for (d, p) in [(KvTransport::Tcp, KvTransport::Auto), (KvTransport::Auto, KvTransport::Tcp)] {
            let (d, p) = negotiate((d, true), (p, true));
            assert!(matches!(d, Ok(Chosen::Tcp(_))) && matches!(p, Ok(Chosen::Tcp(_))), "{d:?} {p:?}");
        }
    }
}
