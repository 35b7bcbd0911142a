//! The cluster handshake over blocking sockets, both sides, and the accepting side of every
//! internal port written once ([`admit`]): the gateway's worker port and each decode
//! worker's KV port run the same door, handshake and introduction check (I9). The
//! handshake's logic is sans-IO, in [`bulkhead_protocol::auth`]; this runs it over
//! [`crate::wire`]'s frames.

use std::net::TcpStream;
use std::time::Instant;

use bulkhead_protocol::auth::{AuthError, Client, ClusterKey, Server, Session};
use bulkhead_protocol::{CodecError, Message, Purpose};

use crate::door::{self, Refusal, Waiter};
use crate::trust::Trust;
use crate::wire::{FrameReader, FrameWriter, WireError, count_auth_refusal, count_bad_connection};

/// What a handshake established about the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Authenticated {
    /// The identity the peer claimed and proved (a prefill's id on a KV connection; 0 for
    /// the accepting side, and where nothing is claimed).
    pub claim: u32,
    /// Frames are encrypted as well as authenticated.
    pub encrypted: bool,
}

/// The connecting side of an internal connection: with a key, run the handshake for
/// `purpose` claiming `claim`, and seal both directions; without one, nothing (`None`).
pub fn connect_handshake(
    r: &mut FrameReader,
    w: &mut FrameWriter,
    trust: &Trust,
    purpose: Purpose,
    claim: u32,
) -> Result<Option<Authenticated>, WireError> {
    let Some(key) = trust.key.as_deref() else { return Ok(None) };
    let nonce = crate::trust::random().map_err(std::io::Error::other)?;
    let (client, hello) = Client::start(key, purpose, claim, trust.wants_encryption(w.peer_ip()), nonce);
    w.send(&hello)?;
    let (proof, session) = match client.finish(r.recv()?) {
        Ok(done) => done,
        Err(e) => {
            // Tell the accepting side, so it counts the refusal rather than a lost connection.
            let _ = w.send(&Message::AuthRefused { reason: e.to_string() });
            return Err(e.into());
        }
    };
    w.send(&proof)?;
    Ok(Some(seal(r, w, session)))
}

/// The accepting side of an internal connection whose first frame was `first`: with a
/// key, run the handshake and seal both directions, returning what the peer proved;
/// without one, `first` must not be a handshake (`None`). A refusal is sent to the peer
/// (so it can say why it failed), counted and returned.
pub fn accept_handshake(
    first: Message,
    r: &mut FrameReader,
    w: &mut FrameWriter,
    trust: &Trust,
    purpose: Purpose,
) -> Result<Option<Authenticated>, WireError> {
    let result = match (trust.key.as_deref(), first) {
        (None, Message::AuthHello { .. }) => Err(AuthError::Refused(NO_KEY_HERE.into()).into()),
        (None, _) => return Ok(None),
        (Some(key), first) => accept_with(key, trust.wants_encryption(w.peer_ip()), first, r, w, purpose),
    };
    result.map(Some).inspect_err(|e| {
        let _ = w.send(&Message::AuthRefused { reason: e.to_string() });
        count_auth_refusal();
    })
}

/// What a process without a key tells a peer that opens a handshake.
pub const NO_KEY_HERE: &str = "this cluster runs without a key; start the peer without --cluster-key-file";

fn accept_with(
    key: &ClusterKey,
    encrypt: bool,
    first: Message,
    r: &mut FrameReader,
    w: &mut FrameWriter,
    purpose: Purpose,
) -> Result<Authenticated, WireError> {
    let nonce = crate::trust::random().map_err(std::io::Error::other)?;
    let (server, challenge) = Server::start(key, purpose, first, encrypt, nonce)?;
    w.send(&challenge)?;
    let session = server.finish(r.recv()?)?;
    Ok(seal(r, w, session))
}

fn seal(r: &mut FrameReader, w: &mut FrameWriter, s: Session) -> Authenticated {
    let done = Authenticated { claim: s.peer_claim, encrypted: s.encrypted };
    r.open_with(s.recv);
    w.seal_with(s.send);
    done
}

/// The reason a handshake that failed with `e` was refused; `None` for a connection that
/// merely ended (the peer closed it, or an eviction already counted it).
pub fn refusal_of(e: &WireError) -> Option<Refusal> {
    match e {
        WireError::Closed | WireError::Io(_) | WireError::Ucx(_) | WireError::Transport(_) => None,
        WireError::Deadline => Some(Refusal::Deadline),
        WireError::Codec(CodecError::Version(_)) => Some(Refusal::Version),
        WireError::Codec(CodecError::Auth(_)) => Some(Refusal::Proof),
        WireError::Codec(_) => Some(Refusal::Malformed),
        WireError::Auth(AuthError::Unexpected { .. } | AuthError::WrongPurpose { .. }) => Some(Refusal::Unexpected),
        // A plain frame where the handshake must start, or a handshake where this side has
        // no key.
        WireError::Auth(AuthError::NoHandshake { .. } | AuthError::Refused(_)) => Some(Refusal::NoKey),
        // This side's check of the peer's proof failed, or the peer's check of this side's
        // (a connecting side with another key sends `AuthRefused` in place of its proof).
        WireError::Auth(AuthError::WrongKey | AuthError::ProofRefused(_)) => Some(Refusal::Proof),
        WireError::Auth(_) => Some(Refusal::Proof),
    }
}

/// A connection an internal port admitted: its reader and writer (sealed when there is a
/// key, full-size frames, no deadline), what its handshake proved (none without a key),
/// and its introduction as the port's check read it.
pub struct Admitted<T> {
    /// Frames from the peer.
    pub reader: FrameReader,
    /// Frames to the peer.
    pub writer: FrameWriter,
    /// What the handshake established; `None` in a cluster without a key.
    pub auth: Option<Authenticated>,
    /// The peer's introduction.
    pub intro: T,
}

/// The accepting side of an internal port (`port` names it in logs and metrics): within
/// the door's deadline, the cluster handshake (with a key) and the peer's first frame
/// after it, which `introduce` judges given what the handshake proved. Anything else
/// (garbage, silence, a trickle, no key or a wrong one, an identity that does not match)
/// is refused: the peer is told where it can be, and the refusal is counted by reason and
/// logged. The connection leaves the door's waiting room when this returns.
pub fn admit<T>(
    stream: TcpStream,
    waiter: Waiter,
    port: &'static str,
    trust: &Trust,
    purpose: Purpose,
    introduce: impl FnOnce(Option<&Authenticated>, Message) -> Result<T, (Refusal, String)>,
) -> Option<Admitted<T>> {
    let _ = stream.set_nodelay(true);
    let peer = stream.peer_addr().ok().map(|a| a.ip());
    let writer = stream.try_clone().ok()?;
    let mut writer = FrameWriter::new(writer);
    let mut reader = FrameReader::before_handshake(stream, Instant::now() + door::HANDSHAKE_DEADLINE);
    let first = reader.recv().and_then(|first| {
        let auth = accept_handshake(first.clone(), &mut reader, &mut writer, trust, purpose)?;
        // Without a key the first frame was already the introduction.
        let intro = if auth.is_some() { reader.recv()? } else { first };
        Ok((auth, intro))
    });
    let (auth, intro) = match first {
        Ok(got) => got,
        Err(e) => {
            if matches!(e, WireError::Codec(_)) {
                count_bad_connection();
            }
            if let Some(reason) = refusal_of(&e) {
                door::refuse(port, peer, reason, &e);
            }
            return None;
        }
    };
    let intro = match introduce(auth.as_ref(), intro) {
        Ok(intro) => intro,
        Err((reason, detail)) => {
            match reason {
                Refusal::Identity => {
                    count_auth_refusal();
                    let _ = writer.send(&Message::AuthRefused { reason: detail.clone() });
                }
                _ => {
                    count_bad_connection();
                }
            }
            door::refuse(port, peer, reason, &detail);
            return None;
        }
    };
    reader.admitted().ok()?;
    drop(waiter);
    if let Some(a) = auth {
        tracing::info!(?peer, encrypted = a.encrypted, "{port} connection authenticated");
    }
    Some(Admitted { reader, writer, auth, intro })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_with_another_key_is_a_proof_refusal_and_one_with_none_a_missing_key() {
        use bulkhead_protocol::auth::KEY_LEN;
        let (ours, theirs) = (ClusterKey::from_bytes([1; KEY_LEN]), ClusterKey::from_bytes([2; KEY_LEN]));
        let accept = |first: Message| Server::start(&ours, Purpose::Control, first, false, [3; KEY_LEN]);
        // A worker with another key: it refuses the gateway's challenge instead of proving.
        let (client, hello) = Client::start(&theirs, Purpose::Control, 0, false, [4; KEY_LEN]);
        let (server, challenge) = accept(hello).unwrap();
        let reason = client.finish(challenge).err().unwrap().to_string();
        let e = server.finish(Message::AuthRefused { reason }).err().unwrap();
        assert_eq!(refusal_of(&WireError::Auth(e)), Some(Refusal::Proof));
        // A worker that proves with another key.
        let (_, hello) = Client::start(&theirs, Purpose::Control, 0, false, [4; KEY_LEN]);
        let (server, _) = accept(hello).unwrap();
        let e = server.finish(Message::AuthProof { proof: [9; KEY_LEN] }).err().unwrap();
        assert_eq!(refusal_of(&WireError::Auth(e)), Some(Refusal::Proof));
        // A worker without a key: its first frame is not a handshake.
        let e = accept(Message::KvHello { prefill: bulkhead_protocol::WorkerId(1) }).err().unwrap();
        assert_eq!(refusal_of(&WireError::Auth(e)), Some(Refusal::NoKey));
        // A handshake for the other port is still unexpected.
        let (_, hello) = Client::start(&ours, Purpose::Kv, 0, false, [4; KEY_LEN]);
        let e = accept(hello).err().unwrap();
        assert!(matches!(e, AuthError::WrongPurpose { .. }));
        assert_eq!(refusal_of(&WireError::Auth(e)), Some(Refusal::Unexpected));
    }
}
