//! Cluster trust: who may join the cluster and write KV (design I1, issue 18).
//!
//! Every internal connection (worker → gateway, prefill → decode) opens with a mutual
//! challenge-response under the cluster key, sans-IO like the roles: the connecting side
//! ([`Client`]) sends a fresh nonce and the identity it claims; the accepting side
//! ([`Server`]) answers with its own nonce and a proof over both; the client checks that
//! proof and sends its own. A proof is a keyed BLAKE3 hash of the transcript (purpose,
//! claimed identity, both nonces) under a key derived from the cluster key, with a
//! different label per side, so neither side's proof can be reflected as the other's and
//! no transcript repeats (each side picks its nonce).
//!
//! Then each direction gets its own session key, derived from the cluster key and the
//! transcript, and every frame carries a 16-byte MAC of its sequence number and bytes
//! ([`Sealer`], [`Opener`]). A frame that is altered, forged, dropped, replayed or
//! reordered fails its MAC; a frame from another session (another nonce pair) fails too.
//! The codec checks the MAC before decoding ([`crate::FrameDecoder::open_with`]), so
//! the roles only ever see frames from the peer the handshake authenticated. They learn
//! "this peer is authenticated as X" and nothing else.
//!
//! What this does not give: confidentiality (frames travel in the clear), and protection
//! against a process that holds the key (it is a member of the cluster; docs/SECURITY.md).

use crate::msg::{Message, Purpose};

/// Length of the cluster key and of the nonces.
pub const KEY_LEN: usize = 32;
/// Length of a frame's MAC.
pub const TAG_LEN: usize = 16;

const PROOF_CONTEXT: &str = "bulkhead 2026-12-01 cluster handshake proof";
const CLIENT_TO_SERVER: &str = "bulkhead 2026-12-01 session key, connecting side to accepting side";
const SERVER_TO_CLIENT: &str = "bulkhead 2026-12-01 session key, accepting side to connecting side";

/// The cluster's shared secret: 32 random bytes. Neither `Clone` nor printable, so it
/// does not end up in a log line or a second copy by accident.
pub struct ClusterKey([u8; KEY_LEN]);

impl ClusterKey {
    /// A key from its bytes (generated, or read from a key file).
    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> Self {
        ClusterKey(bytes)
    }

    /// A key from its 64 hexadecimal digits (surrounding whitespace ignored).
    pub fn from_hex(text: &str) -> Result<Self, AuthError> {
        let text = text.trim();
        if text.len() != 2 * KEY_LEN || !text.is_ascii() {
            return Err(AuthError::KeyFormat);
        }
        let mut key = [0u8; KEY_LEN];
        for (i, b) in key.iter_mut().enumerate() {
            *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).map_err(|_| AuthError::KeyFormat)?;
        }
        Ok(ClusterKey(key))
    }

    /// The key as 64 hexadecimal digits, for a key file or a child's stdin.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn proof(&self, side: u8, transcript: &[u8]) -> [u8; KEY_LEN] {
        let k = blake3::derive_key(PROOF_CONTEXT, &self.0);
        let mut h = blake3::Hasher::new_keyed(&k);
        h.update(&[side]);
        h.update(transcript);
        *h.finalize().as_bytes()
    }

    fn session_key(&self, context: &str, transcript: &[u8]) -> [u8; KEY_LEN] {
        let mut h = blake3::Hasher::new_derive_key(context);
        h.update(&self.0);
        h.update(transcript);
        *h.finalize().as_bytes()
    }
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

/// Why a handshake or a frame failed authentication. The connection must be closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("a cluster key is 64 hexadecimal digits (32 bytes)")]
    KeyFormat,
    #[error("the peer does not hold this cluster's key (its proof does not match)")]
    WrongKey,
    #[error("the handshake was for {got:?}, this port serves {want:?}")]
    WrongPurpose { want: Purpose, got: Purpose },
    #[error("expected {expected} during the handshake, got {got}")]
    Unexpected { expected: &'static str, got: String },
    #[error("the peer refused the handshake: {0}")]
    Refused(String),
    #[error("a frame failed authentication (altered, forged, replayed, reordered or from another session)")]
    BadTag,
}

/// Both sides' view of a finished handshake.
struct Transcript {
    purpose: Purpose,
    claim: u32,
    client_nonce: [u8; KEY_LEN],
    server_nonce: [u8; KEY_LEN],
}

impl Transcript {
    fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(5 + 2 * KEY_LEN);
        b.push(self.purpose as u8);
        b.extend_from_slice(&self.claim.to_le_bytes());
        b.extend_from_slice(&self.client_nonce);
        b.extend_from_slice(&self.server_nonce);
        b
    }
}

/// An authenticated connection: the peer proved it holds the cluster key, and claims
/// `peer_claim` (a prefill worker's id on a KV connection; 0 where none is claimed).
pub struct Session {
    /// Seals what this side sends.
    pub send: Sealer,
    /// Opens what this side receives.
    pub recv: Opener,
    /// The identity the peer claimed in the handshake, bound to this session.
    pub peer_claim: u32,
}

/// The connecting side of a handshake.
pub struct Client<'k> {
    key: &'k ClusterKey,
    purpose: Purpose,
    claim: u32,
    nonce: [u8; KEY_LEN],
}

impl<'k> Client<'k> {
    /// Start a handshake for `purpose`, claiming identity `claim` (0 for none), with a fresh
    /// random `nonce`; returns the `AuthHello` to send.
    pub fn start(key: &'k ClusterKey, purpose: Purpose, claim: u32, nonce: [u8; KEY_LEN]) -> (Self, Message) {
        (Client { key, purpose, claim, nonce }, Message::AuthHello { purpose, claim, nonce })
    }

    /// The accepting side's answer: check its proof; returns the `AuthProof` to send and
    /// the session.
    pub fn finish(self, answer: Message) -> Result<(Message, Session), AuthError> {
        let (server_nonce, proof) = match answer {
            Message::AuthChallenge { nonce, proof } => (nonce, proof),
            Message::AuthRefused { reason } | Message::Refuse { reason } => return Err(AuthError::Refused(reason)),
            other => return Err(AuthError::Unexpected { expected: "AuthChallenge", got: other.kind_name().to_string() }),
        };
        let t = Transcript { purpose: self.purpose, claim: self.claim, client_nonce: self.nonce, server_nonce }.bytes();
        if !equal(&proof, &self.key.proof(b'S', &t)) {
            return Err(AuthError::WrongKey);
        }
        let session = Session {
            send: Sealer::new(self.key.session_key(CLIENT_TO_SERVER, &t)),
            recv: Opener::new(self.key.session_key(SERVER_TO_CLIENT, &t)),
            peer_claim: 0,
        };
        Ok((Message::AuthProof { proof: self.key.proof(b'C', &t) }, session))
    }
}

/// The accepting side of a handshake, after the `AuthHello`.
pub struct Server<'k> {
    key: &'k ClusterKey,
    transcript: Transcript,
}

impl<'k> Server<'k> {
    /// The first frame of a connection to a port serving `purpose`; `nonce` is fresh and
    /// random. Returns the `AuthChallenge` to send.
    pub fn start(key: &'k ClusterKey, purpose: Purpose, hello: Message, nonce: [u8; KEY_LEN]) -> Result<(Self, Message), AuthError> {
        let (got, claim, client_nonce) = match hello {
            Message::AuthHello { purpose, claim, nonce } => (purpose, claim, nonce),
            other => return Err(AuthError::Unexpected { expected: "AuthHello (this cluster needs its key)", got: other.kind_name().to_string() }),
        };
        if got != purpose {
            return Err(AuthError::WrongPurpose { want: purpose, got });
        }
        let transcript = Transcript { purpose, claim, client_nonce, server_nonce: nonce };
        let proof = key.proof(b'S', &transcript.bytes());
        Ok((Server { key, transcript }, Message::AuthChallenge { nonce, proof }))
    }

    /// The connecting side's proof: check it; returns the session.
    pub fn finish(self, proof: Message) -> Result<Session, AuthError> {
        let proof = match proof {
            Message::AuthProof { proof } => proof,
            other => return Err(AuthError::Unexpected { expected: "AuthProof", got: other.kind_name().to_string() }),
        };
        let t = self.transcript.bytes();
        if !equal(&proof, &self.key.proof(b'C', &t)) {
            return Err(AuthError::WrongKey);
        }
        Ok(Session {
            send: Sealer::new(self.key.session_key(SERVER_TO_CLIENT, &t)),
            recv: Opener::new(self.key.session_key(CLIENT_TO_SERVER, &t)),
            peer_claim: self.transcript.claim,
        })
    }
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sealer {{ seq: {} }}", self.seq)
    }
}

impl std::fmt::Debug for Opener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Opener {{ seq: {} }}", self.seq)
    }
}

/// MACs the frames one side sends, numbering them.
pub struct Sealer {
    key: [u8; KEY_LEN],
    seq: u64,
}

impl Sealer {
    fn new(key: [u8; KEY_LEN]) -> Self {
        Sealer { key, seq: 0 }
    }

    /// The MAC of the next frame (`frame`: its whole encoding).
    pub fn seal(&mut self, frame: &[u8]) -> [u8; TAG_LEN] {
        let tag = mac(&self.key, self.seq, frame);
        self.seq += 1;
        tag
    }
}

/// Checks the frames one side receives, in order.
pub struct Opener {
    key: [u8; KEY_LEN],
    seq: u64,
}

impl Opener {
    fn new(key: [u8; KEY_LEN]) -> Self {
        Opener { key, seq: 0 }
    }

    /// Check the next frame's MAC.
    pub fn open(&mut self, frame: &[u8], tag: &[u8]) -> Result<(), AuthError> {
        if !equal(tag, &mac(&self.key, self.seq, frame)) {
            return Err(AuthError::BadTag);
        }
        self.seq += 1;
        Ok(())
    }
}

fn mac(key: &[u8; KEY_LEN], seq: u64, frame: &[u8]) -> [u8; TAG_LEN] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(&seq.to_le_bytes());
    h.update(frame);
    let mut tag = [0u8; TAG_LEN];
    tag.copy_from_slice(&h.finalize().as_bytes()[..TAG_LEN]);
    tag
}

/// Compare secrets in time that does not depend on where they differ.
fn equal(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && constant_time_eq::constant_time_eq(a, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> ClusterKey {
        ClusterKey::from_bytes([b; KEY_LEN])
    }

    /// A whole handshake between a client with `ck` and a server with `sk`.
    fn handshake(ck: &ClusterKey, sk: &ClusterKey, claim: u32) -> Result<(Session, Session), AuthError> {
        let (client, hello) = Client::start(ck, Purpose::Kv, claim, [1; KEY_LEN]);
        let (server, challenge) = Server::start(sk, Purpose::Kv, hello, [2; KEY_LEN])?;
        let (proof, c) = client.finish(challenge)?;
        let s = server.finish(proof)?;
        Ok((c, s))
    }

    #[test]
    fn both_sides_with_the_key_agree_on_a_session_that_carries_the_claim() {
        let k = key(7);
        let (mut c, mut s) = handshake(&k, &k, 42).unwrap();
        assert_eq!(s.peer_claim, 42);
        for frame in [&b"one"[..], b"two", b""] {
            let tag = c.send.seal(frame);
            s.recv.open(frame, &tag).unwrap();
            let tag = s.send.seal(frame);
            c.recv.open(frame, &tag).unwrap();
        }
    }

    #[test]
    fn a_wrong_key_fails_on_whichever_side_checks_first() {
        // The client checks the server's proof first, so a server without the key is
        // caught before the client proves anything.
        assert_eq!(handshake(&key(1), &key(2), 0).err(), Some(AuthError::WrongKey));
        // A client that skips that check still cannot make the server's.
        let (sk, ck) = (key(1), key(2));
        let (_, hello) = Client::start(&ck, Purpose::Control, 0, [1; KEY_LEN]);
        let (server, _) = Server::start(&sk, Purpose::Control, hello, [2; KEY_LEN]).unwrap();
        let forged = Message::AuthProof { proof: ck.proof(b'C', &[0; 69]) };
        assert_eq!(server.finish(forged).err(), Some(AuthError::WrongKey));
    }

    #[test]
    fn a_server_proof_cannot_be_reflected_as_the_client_proof() {
        let k = key(3);
        let (_, hello) = Client::start(&k, Purpose::Kv, 5, [1; KEY_LEN]);
        let (server, challenge) = Server::start(&k, Purpose::Kv, hello, [2; KEY_LEN]).unwrap();
        let Message::AuthChallenge { proof, .. } = challenge else { panic!() };
        assert_eq!(server.finish(Message::AuthProof { proof }).err(), Some(AuthError::WrongKey));
    }

    #[test]
    fn a_handshake_for_the_other_port_or_a_plain_hello_is_refused() {
        let k = key(4);
        let (_, hello) = Client::start(&k, Purpose::Control, 0, [1; KEY_LEN]);
        assert!(matches!(Server::start(&k, Purpose::Kv, hello, [2; KEY_LEN]).err(), Some(AuthError::WrongPurpose { .. })));
        let plain = Message::KvHello { prefill: crate::WorkerId(1) };
        assert!(matches!(Server::start(&k, Purpose::Kv, plain, [2; KEY_LEN]).err(), Some(AuthError::Unexpected { .. })));
    }

    #[test]
    fn altered_replayed_reordered_and_other_session_frames_fail_their_mac() {
        let k = key(5);
        let (mut c, mut s) = handshake(&k, &k, 0).unwrap();
        let t0 = c.send.seal(b"frame zero");
        let t1 = c.send.seal(b"frame one");
        // Reordered: frame one first.
        assert_eq!(s.recv.open(b"frame one", &t1), Err(AuthError::BadTag));
        s.recv.open(b"frame zero", &t0).unwrap();
        // Replayed.
        assert_eq!(s.recv.open(b"frame zero", &t0), Err(AuthError::BadTag));
        // Altered by one bit.
        assert_eq!(s.recv.open(b"frame onf", &t1), Err(AuthError::BadTag));
        s.recv.open(b"frame one", &t1).unwrap();
        // From another session of the same peers (other nonces): a replayed session.
        let (_, mut s2) = {
            let (client, hello) = Client::start(&k, Purpose::Kv, 0, [9; KEY_LEN]);
            let (server, challenge) = Server::start(&k, Purpose::Kv, hello, [8; KEY_LEN]).unwrap();
            let (proof, c2) = client.finish(challenge).unwrap();
            (c2, server.finish(proof).unwrap())
        };
        assert_eq!(s2.recv.open(b"frame zero", &t0), Err(AuthError::BadTag));
    }

    #[test]
    fn keys_round_trip_through_hex_and_bad_text_is_refused() {
        let k = ClusterKey::from_bytes(core::array::from_fn(|i| i as u8 * 7));
        let back = ClusterKey::from_hex(&format!("  {}\n", k.to_hex())).unwrap();
        assert_eq!(back.0, k.0);
        for bad in ["", "00", &"g".repeat(64), &"0".repeat(63), &"é".repeat(32)] {
            assert_eq!(ClusterKey::from_hex(bad).err(), Some(AuthError::KeyFormat), "{bad:?}");
        }
        assert_eq!(format!("{k:?}"), "ClusterKey(..)");
    }
}
