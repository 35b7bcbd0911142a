//! Replays the committed `wire_codec` fuzz corpus (`fuzz/corpus/wire_codec`) through the
//! fuzz target's own check (`fuzz/checks`), so every input the fuzzer kept runs in CI on
//! stable.

#[path = "../../../fuzz/checks/wire_codec.rs"]
mod wire_codec;

#[path = "../../../fuzz/checks/corpus.rs"]
mod corpus;

#[test]
fn every_committed_wire_codec_input_passes_the_fuzz_check() {
    corpus::replay("wire_codec", wire_codec::check);
}

/// The decoder refuses another protocol version at its fourth byte, so a corpus left at an
/// old version replays only that check (it stayed at version 5 through two bumps). Most
/// inputs must speak this build's version: rewrite the corpus when the version changes.
#[test]
fn the_committed_wire_codec_corpus_speaks_this_builds_protocol_version() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/wire_codec");
    let (mut current, mut framed) = (0, 0);
    for entry in std::fs::read_dir(&dir).unwrap() {
        let data = std::fs::read(entry.unwrap().path()).unwrap();
        // Byte 0 picks the read size; the stream follows.
        if let Some(stream) = data.get(1..).filter(|s| s.starts_with(b"BH") && s.len() > 2) {
            framed += 1;
            current += usize::from(stream[2] == bulkhead_protocol::VERSION);
        }
    }
    assert!(
        framed >= 100 && current * 10 >= framed * 8,
        "{current} of {framed} framed inputs are at version {}",
        bulkhead_protocol::VERSION
    );
}

/// Found by `wire_codec`: any nonzero seed flag decoded as "seeded", and a seed sent with the
/// flag off was dropped, so two byte strings meant one message. Both are now refused.
#[test]
fn a_seed_flag_other_than_0_or_1_and_a_seed_sent_without_its_flag_are_refused() {
    use bulkhead_protocol::{CodecError, FrameDecoder, Message, Sampling, WorkerId, encode};
    let sampling = Sampling::default();
    let m = Message::Reserve {
        req: bulkhead_kv::RequestId(5),
        prompt_tokens: 9,
        max_tokens: 3,
        prefill: WorkerId(1),
        sampling,
        stop: Vec::new(),
        resume: Vec::new(),
        prompt: Vec::new(),
        trace: Default::default(),
        cache: None,
    };
    let mut frame = Vec::new();
    encode(&m, &mut frame);
    // Header 8, request 8, three u32 counts 12, temperature, top_k, top_p, min_p 16: the flag.
    let flag = 44;
    assert_eq!(frame[flag..flag + 9], [0; 9], "the flag and the seed are where this test expects");
    let decode = |b: &[u8]| {
        let mut d = FrameDecoder::new(1 << 16);
        d.push(b);
        d.next_message()
    };
    assert_eq!(decode(&frame), Ok(Some(m)));
    let mut bad_flag = frame.clone();
    bad_flag[flag] = 17;
    assert_eq!(decode(&bad_flag), Err(CodecError::Invalid { field: "seed flag", value: 17 }));
    let mut stray_seed = frame;
    stray_seed[flag + 1] = 7;
    assert_eq!(decode(&stray_seed), Err(CodecError::Invalid { field: "seed", value: 7 }));
}
