//! The `wire_codec` fuzz check, shared by the cargo-fuzz target (`fuzz/fuzz_targets/
//! wire_codec.rs`, nightly) and `crates/protocol/tests/fuzz_corpus.rs`, which replays the
//! committed corpus on stable so CI runs the same code paths without nightly.
//!
//! Input: the first byte picks how the rest is cut into reads (1 to 64 bytes each); the rest
//! is what a peer sent. The decoder must never panic, must never hold more than one frame
//! it is waiting for, and every frame it accepts must be exactly `encode` of the message it
//! decoded to (one message, one byte string: nothing is guessed, and decode(encode(m)) == m).

use bulkhead_protocol::{FrameDecoder, encode};

/// Frame limit under fuzzing: small, so oversize frames are reachable with short inputs.
pub const MAX_FRAME: usize = 4096;
/// Magic, version, kind and payload length.
const HEADER: usize = 8;

/// Runs one input; panics if a property fails.
pub fn check(data: &[u8]) {
    let Some((&cut, stream)) = data.split_first() else {
        return;
    };
    let read = usize::from(cut % 64) + 1;
    let mut d = FrameDecoder::new(MAX_FRAME);
    let mut pushed = 0;
    for piece in stream.chunks(read) {
        d.push(piece);
        pushed += piece.len();
        loop {
            let start = pushed - d.buffered();
            match d.next_message() {
                Ok(Some(m)) => {
                    let frame = &stream[start..pushed - d.buffered()];
                    let mut again = Vec::new();
                    encode(&m, &mut again);
                    assert_eq!(again, frame, "an accepted frame is not the encoding of {m:?}");
                }
                Ok(None) => {
                    // Bounded memory: what waits is at most one frame within the limit.
                    assert!(d.buffered() < HEADER + MAX_FRAME, "{} bytes buffered", d.buffered());
                    break;
                }
                // The connection is closed; the decoder is not used again.
                Err(_) => return,
            }
        }
    }
}
