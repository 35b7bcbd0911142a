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
//! transcript, and every frame carries a 16-byte tag over its sequence number and bytes
//! ([`Sealer`], [`Opener`]). A frame that is altered, forged, dropped, replayed or
//! reordered fails its tag; a frame from another session (another nonce pair) fails too.
//! The codec checks the tag before decoding ([`crate::FrameDecoder::open_with`]), so
//! the roles only ever see frames from the peer the handshake authenticated. They learn
//! "this peer is authenticated as X" and nothing else.
//!
//! The tag is a keyed BLAKE3 MAC, or, when the session is encrypted, AES-256-GCM's: then
//! the payload is encrypted too, the 8-byte frame header (kind and length) is
//! authenticated but readable, and the nonce is the frame's sequence number under a key
//! used by one direction of one session only. Each side says in its half of the
//! handshake whether it wants encryption; the session is encrypted if either does, and
//! both proofs cover both bits, so nobody in between can switch it off.
//!
//! What this does not give: protection against a process that holds the key (it is a
//! member of the cluster), or against traffic analysis (frame kinds and lengths are
//! visible); docs/SECURITY.md.

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

    /// A key for another purpose, derived under `context`; reveals nothing about this one.
    pub(crate) fn derive(&self, context: &str) -> [u8; KEY_LEN] {
        blake3::derive_key(context, &self.0)
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
    #[error("the proof does not match: the peer holds a different cluster key, or the handshake was altered on the way")]
    WrongKey,
    #[error("the handshake was for {got:?}, this port serves {want:?}")]
    WrongPurpose { want: Purpose, got: Purpose },
    #[error("expected {expected} during the handshake, got {got}")]
    Unexpected { expected: &'static str, got: String },
    /// The connecting side sent a plain frame where a handshake must start: it holds no key.
    #[error("expected AuthHello (this cluster needs its key) during the handshake, got {got}")]
    NoHandshake { got: String },
    /// The connecting side checked this side's proof and refused it: it holds a different
    /// key (or the challenge was altered on the way).
    #[error("the peer refused this side's proof: {0}")]
    ProofRefused(String),
    #[error("the peer refused the handshake: {0}")]
    Refused(String),
    #[error("a frame failed authentication (altered, forged, replayed, reordered or from another session)")]
    BadTag,
    #[error("this side asked for encryption and the accepting side answered without it")]
    Downgraded,
    #[error("the cipher refused the session key")]
    Cipher,
}

/// Both sides' view of a finished handshake.
struct Transcript {
    purpose: Purpose,
    claim: u32,
    client_nonce: [u8; KEY_LEN],
    /// What the connecting side asked for.
    client_encrypt: bool,
    server_nonce: [u8; KEY_LEN],
    /// What the accepting side decided: the session is encrypted.
    encrypt: bool,
}

impl Transcript {
    fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(7 + 2 * KEY_LEN);
        b.push(self.purpose as u8);
        b.extend_from_slice(&self.claim.to_le_bytes());
        b.extend_from_slice(&self.client_nonce);
        b.push(u8::from(self.client_encrypt));
        b.extend_from_slice(&self.server_nonce);
        b.push(u8::from(self.encrypt));
        b
    }

    /// Both directions' frame keys.
    fn session(&self, key: &ClusterKey, client_side: bool) -> Result<Session, AuthError> {
        let t = self.bytes();
        let c2s = Direction::new(key.session_key(CLIENT_TO_SERVER, &t), self.encrypt)?;
        let s2c = Direction::new(key.session_key(SERVER_TO_CLIENT, &t), self.encrypt)?;
        let (send, recv) = if client_side { (c2s, s2c) } else { (s2c, c2s) };
        Ok(Session {
            send: Sealer(send),
            recv: Opener(recv),
            peer_claim: if client_side { 0 } else { self.claim },
            encrypted: self.encrypt,
        })
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
    /// Frames are encrypted, not only authenticated.
    pub encrypted: bool,
}

/// The connecting side of a handshake.
pub struct Client<'k> {
    key: &'k ClusterKey,
    purpose: Purpose,
    claim: u32,
    nonce: [u8; KEY_LEN],
    encrypt: bool,
}

impl<'k> Client<'k> {
    /// Start a handshake for `purpose`, claiming identity `claim` (0 for none), asking for
    /// encryption if `encrypt`, with a fresh random `nonce`; returns the `AuthHello` to send.
    pub fn start(key: &'k ClusterKey, purpose: Purpose, claim: u32, encrypt: bool, nonce: [u8; KEY_LEN]) -> (Self, Message) {
        (Client { key, purpose, claim, nonce, encrypt }, Message::AuthHello { purpose, claim, nonce, encrypt })
    }

    /// The accepting side's answer: check its proof; returns the `AuthProof` to send and
    /// the session.
    pub fn finish(self, answer: Message) -> Result<(Message, Session), AuthError> {
        let (server_nonce, proof, encrypt) = match answer {
            Message::AuthChallenge { nonce, proof, encrypt } => (nonce, proof, encrypt),
            Message::AuthRefused { reason } | Message::Refuse { reason } => return Err(AuthError::Refused(reason)),
            other => return Err(AuthError::Unexpected { expected: "AuthChallenge", got: other.kind_name().to_string() }),
        };
        let transcript = Transcript {
            purpose: self.purpose,
            claim: self.claim,
            client_nonce: self.nonce,
            client_encrypt: self.encrypt,
            server_nonce,
            encrypt,
        };
        let t = transcript.bytes();
        if !equal(&proof, &self.key.proof(b'S', &t)) {
            return Err(AuthError::WrongKey);
        }
        if self.encrypt && !encrypt {
            return Err(AuthError::Downgraded);
        }
        Ok((Message::AuthProof { proof: self.key.proof(b'C', &t) }, transcript.session(self.key, true)?))
    }
}

/// The accepting side of a handshake, after the `AuthHello`.
pub struct Server<'k> {
    key: &'k ClusterKey,
    transcript: Transcript,
}

impl<'k> Server<'k> {
    /// The first frame of a connection to a port serving `purpose`; `nonce` is fresh and
    /// random; `encrypt`: this side wants encryption (it is on if either side wants it).
    /// Returns the `AuthChallenge` to send.
    pub fn start(
        key: &'k ClusterKey,
        purpose: Purpose,
        hello: Message,
        encrypt: bool,
        nonce: [u8; KEY_LEN],
    ) -> Result<(Self, Message), AuthError> {
        let (got, claim, client_nonce, client_encrypt) = match hello {
            Message::AuthHello { purpose, claim, nonce, encrypt } => (purpose, claim, nonce, encrypt),
            other => return Err(AuthError::NoHandshake { got: other.kind_name().to_string() }),
        };
        if got != purpose {
            return Err(AuthError::WrongPurpose { want: purpose, got });
        }
        let encrypt = encrypt || client_encrypt;
        let transcript = Transcript { purpose, claim, client_nonce, client_encrypt, server_nonce: nonce, encrypt };
        let proof = key.proof(b'S', &transcript.bytes());
        Ok((Server { key, transcript }, Message::AuthChallenge { nonce, proof, encrypt }))
    }

    /// The connecting side's proof: check it; returns the session.
    pub fn finish(self, proof: Message) -> Result<Session, AuthError> {
        let proof = match proof {
            Message::AuthProof { proof } => proof,
            // What a client whose key differs sends instead of its proof.
            Message::AuthRefused { reason } => return Err(AuthError::ProofRefused(reason)),
            other => return Err(AuthError::Unexpected { expected: "AuthProof", got: other.kind_name().to_string() }),
        };
        if !equal(&proof, &self.key.proof(b'C', &self.transcript.bytes())) {
            return Err(AuthError::WrongKey);
        }
        self.transcript.session(self.key, false)
    }
}

/// How one direction of a session protects its frames.
enum FrameKey {
    /// Keyed BLAKE3 over the sequence number, header and payload.
    Mac([u8; KEY_LEN]),
    /// AES-256-GCM: the payload encrypted, the header as associated data, the sequence
    /// number as the nonce.
    Aead(ring::aead::LessSafeKey),
}

/// One direction of a session: its key and the number of the next frame.
struct Direction {
    key: FrameKey,
    seq: u64,
}

impl Direction {
    fn new(key: [u8; KEY_LEN], encrypt: bool) -> Result<Self, AuthError> {
        let key = if encrypt {
            // AES-256 takes any 32 bytes; should ring refuse, the handshake fails rather
            // than fall back to frames in the clear.
            let k = ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, &key).map_err(|_| AuthError::Cipher)?;
            FrameKey::Aead(ring::aead::LessSafeKey::new(k))
        } else {
            FrameKey::Mac(key)
        };
        Ok(Direction { key, seq: 0 })
    }

    /// The nonce of this frame. Unique: one key per direction per session, and the
    /// 64-bit counter does not wrap.
    fn nonce(&self) -> ring::aead::Nonce {
        let mut n = [0u8; ring::aead::NONCE_LEN];
        n[4..].copy_from_slice(&self.seq.to_le_bytes());
        ring::aead::Nonce::assume_unique_for_key(n)
    }
}

impl std::fmt::Debug for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let encrypted = matches!(self.key, FrameKey::Aead(_));
        f.debug_struct("Direction").field("encrypted", &encrypted).field("seq", &self.seq).finish_non_exhaustive()
    }
}

/// Seals the frames one side sends, numbering them.
#[derive(Debug)]
pub struct Sealer(Direction);

impl Sealer {
    /// Seal the next frame: `header` is authenticated, `payload` authenticated (and
    /// encrypted in place, in an encrypted session); returns the tag to send after it.
    pub fn seal(&mut self, header: &[u8], payload: &mut [u8]) -> [u8; TAG_LEN] {
        let d = &mut self.0;
        let tag = match &d.key {
            FrameKey::Mac(key) => mac(key, d.seq, header, payload),
            FrameKey::Aead(key) => match key.seal_in_place_separate_tag(d.nonce(), ring::aead::Aad::from(header), payload) {
                Ok(tag) => {
                    let mut t = [0u8; TAG_LEN];
                    t.copy_from_slice(tag.as_ref());
                    t
                }
                // Only inputs over 64 GiB are refused (frames are at most 16 MiB). Send
                // neither the plaintext nor a tag that could pass.
                Err(_) => {
                    payload.fill(0);
                    [0; TAG_LEN]
                }
            },
        };
        d.seq += 1;
        tag
    }
}

/// Checks (and decrypts) the frames one side receives, in order.
#[derive(Debug)]
pub struct Opener(Direction);

impl Opener {
    /// Check the next frame's tag; in an encrypted session, decrypt `payload` in place.
    /// On an error the payload is not to be read, and the connection must close.
    pub fn open(&mut self, header: &[u8], payload: &mut [u8], tag: &[u8]) -> Result<(), AuthError> {
        let d = &mut self.0;
        let ok = match &d.key {
            FrameKey::Mac(key) => equal(tag, &mac(key, d.seq, header, payload)),
            FrameKey::Aead(key) => {
                let mut t = [0u8; TAG_LEN];
                t.copy_from_slice(tag.get(..TAG_LEN).ok_or(AuthError::BadTag)?);
                key.open_in_place_separate_tag(d.nonce(), ring::aead::Aad::from(header), ring::aead::Tag::from(t), payload, 0..).is_ok()
            }
        };
        if !ok {
            return Err(AuthError::BadTag);
        }
        d.seq += 1;
        Ok(())
    }
}

fn mac(key: &[u8; KEY_LEN], seq: u64, header: &[u8], payload: &[u8]) -> [u8; TAG_LEN] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(&seq.to_le_bytes());
    h.update(header);
    h.update(payload);
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

    /// A whole handshake between a client with `ck` and a server with `sk`, each asking
    /// for encryption or not.
    fn handshake_with(ck: &ClusterKey, sk: &ClusterKey, claim: u32, encrypt: (bool, bool)) -> Result<(Session, Session), AuthError> {
        let (client, hello) = Client::start(ck, Purpose::Kv, claim, encrypt.0, [1; KEY_LEN]);
        let (server, challenge) = Server::start(sk, Purpose::Kv, hello, encrypt.1, [2; KEY_LEN])?;
        let (proof, c) = client.finish(challenge)?;
        let s = server.finish(proof)?;
        Ok((c, s))
    }

    fn handshake(ck: &ClusterKey, sk: &ClusterKey, claim: u32) -> Result<(Session, Session), AuthError> {
        handshake_with(ck, sk, claim, (false, false))
    }

    /// Seal `payload` with `from`, check that it went out in the clear or not, open it
    /// with `to` and return what came out.
    fn send(from: &mut Session, to: &mut Session, payload: &[u8]) -> Result<Vec<u8>, AuthError> {
        let mut b = payload.to_vec();
        let tag = from.send.seal(b"hdr", &mut b);
        assert_eq!(b == payload, !from.encrypted || payload.is_empty(), "in the clear exactly when not encrypted");
        to.recv.open(b"hdr", &mut b, &tag)?;
        Ok(b)
    }

    #[test]
    fn both_sides_with_the_key_agree_on_a_session_that_carries_the_claim() {
        let k = key(7);
        for encrypt in [(false, false), (true, false), (false, true), (true, true)] {
            let (mut c, mut s) = handshake_with(&k, &k, 42, encrypt).unwrap();
            assert_eq!(s.peer_claim, 42);
            assert_eq!((c.encrypted, s.encrypted), (encrypt.0 || encrypt.1, encrypt.0 || encrypt.1), "either side can ask for it");
            for frame in [&b"one"[..], b"two", b""] {
                assert_eq!(send(&mut c, &mut s, frame).unwrap(), frame);
                assert_eq!(send(&mut s, &mut c, frame).unwrap(), frame);
            }
        }
    }

    #[test]
    fn nobody_in_between_can_switch_encryption_off() {
        let k = key(8);
        // The connecting side's request is cleared on the way.
        let (client, hello) = Client::start(&k, Purpose::Kv, 1, true, [1; KEY_LEN]);
        let Message::AuthHello { purpose, claim, nonce, .. } = hello else { panic!() };
        let (_, challenge) =
            Server::start(&k, Purpose::Kv, Message::AuthHello { purpose, claim, nonce, encrypt: false }, false, [2; KEY_LEN]).unwrap();
        assert_eq!(client.finish(challenge).err(), Some(AuthError::WrongKey));
        // The accepting side's decision is cleared on the way.
        let (client, hello) = Client::start(&k, Purpose::Kv, 1, false, [1; KEY_LEN]);
        let (_, challenge) = Server::start(&k, Purpose::Kv, hello, true, [2; KEY_LEN]).unwrap();
        let Message::AuthChallenge { nonce, proof, .. } = challenge else { panic!() };
        assert_eq!(client.finish(Message::AuthChallenge { nonce, proof, encrypt: false }).err(), Some(AuthError::WrongKey));
        // A server that answers "no" to a client that asked is refused even with its key
        // (defence in depth: only a server that ignores the rules would do it).
        let (client, _) = Client::start(&k, Purpose::Kv, 1, true, [1; KEY_LEN]);
        let t = Transcript {
            purpose: Purpose::Kv,
            claim: 1,
            client_nonce: [1; KEY_LEN],
            client_encrypt: true,
            server_nonce: [2; KEY_LEN],
            encrypt: false,
        };
        let answer = Message::AuthChallenge { nonce: [2; KEY_LEN], proof: k.proof(b'S', &t.bytes()), encrypt: false };
        assert_eq!(client.finish(answer).err(), Some(AuthError::Downgraded));
    }

    #[test]
    fn encrypted_frames_hide_the_payload_and_any_flipped_bit_fails() {
        let k = key(9);
        let (mut c, mut s) = handshake_with(&k, &k, 0, (true, true)).unwrap();
        let secret = b"the other tenant's prompt".to_vec();
        let mut b = secret.clone();
        let tag = c.send.seal(b"hdr", &mut b);
        assert!(!b.windows(5).any(|w| secret.windows(5).any(|x| x == w)), "no five plaintext bytes in a row survive");
        for i in 0..(b.len() + TAG_LEN + 3) * 8 {
            let (mut payload, mut t, mut h) = (b.clone(), tag, *b"hdr");
            let (byte, bit) = (i / 8, 1u8 << (i % 8));
            match byte {
                n if n < payload.len() => payload[n] ^= bit,
                n if n < payload.len() + TAG_LEN => t[n - payload.len()] ^= bit,
                n => h[n - payload.len() - TAG_LEN] ^= bit,
            }
            let (_, mut fresh) = handshake_with(&k, &k, 0, (true, true)).unwrap();
            assert_eq!(fresh.recv.open(&h, &mut payload, &t), Err(AuthError::BadTag), "bit {i}");
        }
        s.recv.open(b"hdr", &mut b, &tag).unwrap();
        assert_eq!(b, secret);
    }

    #[test]
    fn a_wrong_key_fails_on_whichever_side_checks_first() {
        // The client checks the server's proof first, so a server without the key is
        // caught before the client proves anything.
        assert_eq!(handshake(&key(1), &key(2), 0).err(), Some(AuthError::WrongKey));
        // A client that skips that check still cannot make the server's.
        let (sk, ck) = (key(1), key(2));
        let (_, hello) = Client::start(&ck, Purpose::Control, 0, false, [1; KEY_LEN]);
        let (server, _) = Server::start(&sk, Purpose::Control, hello, false, [2; KEY_LEN]).unwrap();
        let forged = Message::AuthProof { proof: ck.proof(b'C', &[0; 69]) };
        assert_eq!(server.finish(forged).err(), Some(AuthError::WrongKey));
    }

    #[test]
    fn a_server_proof_cannot_be_reflected_as_the_client_proof() {
        let k = key(3);
        let (_, hello) = Client::start(&k, Purpose::Kv, 5, false, [1; KEY_LEN]);
        let (server, challenge) = Server::start(&k, Purpose::Kv, hello, false, [2; KEY_LEN]).unwrap();
        let Message::AuthChallenge { proof, .. } = challenge else { panic!() };
        assert_eq!(server.finish(Message::AuthProof { proof }).err(), Some(AuthError::WrongKey));
    }

    #[test]
    fn a_handshake_for_the_other_port_or_a_plain_hello_is_refused() {
        let k = key(4);
        let (_, hello) = Client::start(&k, Purpose::Control, 0, false, [1; KEY_LEN]);
        assert!(matches!(Server::start(&k, Purpose::Kv, hello, false, [2; KEY_LEN]).err(), Some(AuthError::WrongPurpose { .. })));
        let plain = Message::KvHello { prefill: crate::WorkerId(1) };
        assert!(matches!(Server::start(&k, Purpose::Kv, plain, false, [2; KEY_LEN]).err(), Some(AuthError::NoHandshake { .. })));
    }

    #[test]
    fn a_client_with_another_key_refuses_the_challenge_and_the_server_learns_its_proof_failed() {
        let (sk, ck) = (key(1), key(2));
        let (client, hello) = Client::start(&ck, Purpose::Control, 0, false, [1; KEY_LEN]);
        let (server, challenge) = Server::start(&sk, Purpose::Control, hello, false, [2; KEY_LEN]).unwrap();
        let e = client.finish(challenge).err().unwrap();
        assert_eq!(e, AuthError::WrongKey);
        // What `handshake::connect_handshake` sends the accepting side in place of its proof.
        let refused = server.finish(Message::AuthRefused { reason: e.to_string() }).err();
        assert!(matches!(&refused, Some(AuthError::ProofRefused(r)) if r.contains("different cluster key")), "{refused:?}");
    }

    #[test]
    fn altered_replayed_reordered_and_other_session_frames_fail_their_tag() {
        let k = key(5);
        for encrypt in [false, true] {
            let (mut c, mut s) = handshake_with(&k, &k, 0, (encrypt, false)).unwrap();
            let (mut f0, mut f1) = (b"frame zero".to_vec(), b"frame one".to_vec());
            let t0 = c.send.seal(b"h", &mut f0);
            let t1 = c.send.seal(b"h", &mut f1);
            let open = |s: &mut Session, f: &[u8], t: &[u8]| s.recv.open(b"h", &mut f.to_vec(), t);
            // Reordered: frame one first.
            assert_eq!(open(&mut s, &f1, &t1), Err(AuthError::BadTag));
            open(&mut s, &f0, &t0).unwrap();
            // Replayed.
            assert_eq!(open(&mut s, &f0, &t0), Err(AuthError::BadTag));
            // Altered by one bit.
            let mut bad = f1.clone();
            bad[3] ^= 1;
            assert_eq!(open(&mut s, &bad, &t1), Err(AuthError::BadTag));
            open(&mut s, &f1, &t1).unwrap();
            // From another session of the same peers (other nonces): a replayed session.
            let (_, mut s2) = {
                let (client, hello) = Client::start(&k, Purpose::Kv, 0, encrypt, [9; KEY_LEN]);
                let (server, challenge) = Server::start(&k, Purpose::Kv, hello, false, [8; KEY_LEN]).unwrap();
                let (proof, c2) = client.finish(challenge).unwrap();
                (c2, server.finish(proof).unwrap())
            };
            assert_eq!(open(&mut s2, &f0, &t0), Err(AuthError::BadTag));
        }
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
