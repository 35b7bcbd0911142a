//! The `tokenizer_encode` fuzz check, shared by the cargo-fuzz target (`fuzz/fuzz_targets/
//! tokenizer_encode.rs`, nightly) and `crates/tokenizer/tests/fuzz_corpus.rs`, which
//! replays the committed corpus on stable.
//!
//! Input: the first byte's low bit is `parse_special`; the rest, as UTF-8 (invalid bytes
//! become U+FFFD), is encoded with the default model's tokenizer (fetched on first use, as
//! the tokenizer's other tests do). Every id must be in the vocabulary and decoding must
//! give the text back, special tokens included, except for the bytes the vocabulary has no
//! token for: like llama.cpp, the tokenizer drops those (the default model lacks six ASCII
//! control bytes, 0x04 0x06 0x13 0x14 0x16 0x1d, and lead bytes 0xf1 0xf2 of unassigned
//! planes). Run the target with a small `-timeout` so that slow inputs (regex
//! backtracking) are reported too.

use std::sync::OnceLock;

use bulkhead_gguf::GgufFile;
use bulkhead_tokenizer::Tokenizer;

/// The tokenizer, and which bytes have a token of their own.
fn tokenizer() -> &'static (Tokenizer, [bool; 256]) {
    static TOK: OnceLock<(Tokenizer, [bool; 256])> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = bulkhead_fetch::ensure_default_model(false).expect("default model is cached or fetchable");
        let gguf = GgufFile::open(&path).expect("default model parses");
        let tok = Tokenizer::from_gguf(&gguf).expect("tokenizer loads");
        let mut byte_token = [false; 256];
        for id in 0..tok.vocab_size() as u32 {
            if let Some(&[b]) = tok.token_bytes(id) {
                byte_token[usize::from(b)] = true;
            }
        }
        (tok, byte_token)
    })
}

/// Runs one input; panics if a property fails.
pub fn check(data: &[u8]) {
    let Some((&flags, text)) = data.split_first() else {
        return;
    };
    let parse_special = flags & 1 == 1;
    let text = String::from_utf8_lossy(text);
    let (tok, byte_token) = tokenizer();
    let ids = tok.encode(&text, parse_special);
    assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()), "an id outside the vocabulary: {ids:?}");
    let kept: Vec<u8> = text.bytes().filter(|&b| byte_token[usize::from(b)]).collect();
    assert_eq!(tok.decode(&ids), String::from_utf8_lossy(&kept), "round trip (parse_special {parse_special}) via {ids:?}");
}
