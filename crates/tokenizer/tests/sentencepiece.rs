//! The SentencePiece tokenizer on Gemma 3 270M's vocabulary (262,144 tokens) is token-
//! identical to llama.cpp on the fixture strings (`scripts/llamacpp-fixtures.py` recorded
//! them: Unicode, code, whitespace runs, digits, special tokens), and decoding gives the
//! text back.

use bulkhead_gguf::GgufFile;
use bulkhead_tokenizer::Tokenizer;

fn gemma() -> Tokenizer {
    let path = bulkhead_fetch::ensure(&bulkhead_fetch::GEMMA3_270M, false).expect("Gemma 3 270M is cached or fetchable");
    // The tokenizer needs only the metadata, not the 253 MB of weights.
    Tokenizer::from_gguf(&GgufFile::open_metadata(path).expect("Gemma's header parses")).expect("Gemma's tokenizer loads")
}

#[test]
fn gemma_tokenizes_as_llama_cpp_does() {
    let t = gemma();
    assert_eq!(t.vocab_size(), 262_144);
    let v: serde_json::Value = serde_json::from_str(include_str!("fixtures/gemma3_tokenizer.json")).expect("fixture");
    let cases = v["cases"].as_array().expect("cases");
    assert!(cases.len() >= 50, "{} fixture strings", cases.len());
    let mut wrong = Vec::new();
    for c in cases {
        let text = c["text"].as_str().expect("text");
        let want: Vec<u32> = c["ids"].as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect();
        let got = t.encode(text, true);
        if got != want {
            wrong.push(format!("{text:?}: got {got:?}, llama.cpp {want:?}"));
        }
        // Special tokens decode to their own text, so the round trip is exact.
        assert_eq!(t.decode(&got), text, "decode(encode({text:?}))");
    }
    assert!(wrong.is_empty(), "{} of {} strings differ:\n{}", wrong.len(), cases.len(), wrong.join("\n"));
}

#[test]
fn gemma_has_no_space_prefix_a_bos_and_its_end_of_turn_ends_generation() {
    let t = gemma();
    assert_eq!(t.bos_id(), Some(2));
    assert!(t.add_bos());
    assert_eq!(t.eos_id(), 1);
    let eot = t.token_to_id("<end_of_turn>").expect("<end_of_turn>");
    assert!(t.is_eog(eot) && t.is_eog(1));
    // No space prefix: "Hello" is not "▁Hello".
    assert_ne!(t.encode("Hello", false), t.encode(" Hello", false));
}
