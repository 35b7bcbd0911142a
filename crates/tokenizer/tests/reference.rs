//! Agreement with llama.cpp on the real default model (SmolLM2-135M-Instruct): token ids from
//! `fixtures/` (recorded with llama.cpp), the chat template, and round trips.

use std::sync::OnceLock;
use std::time::Instant;

use bulkhead_gguf::{GgufFile, GgufWriter, Value};
use bulkhead_tokenizer::{ChatMessage, ChatTemplate, TokenType, Tokenizer};
use proptest::prelude::*;
use serde::Deserialize;

#[derive(Deserialize)]
struct TokenizerCases {
    cases: Vec<TokenizerCase>,
}

#[derive(Deserialize)]
struct TokenizerCase {
    text: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct GreedyCases {
    cases: Vec<GreedyCase>,
}

#[derive(Deserialize)]
struct GreedyCase {
    system: String,
    user: String,
    prompt: String,
    prompt_ids: Vec<u32>,
}

struct Model {
    gguf: GgufFile,
    tokenizer: Tokenizer,
    template: ChatTemplate,
}

fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = bulkhead_fetch::ensure_default_model(false).expect("default model is cached or fetchable");
        let gguf = GgufFile::open(&path).expect("default model parses");
        Model {
            tokenizer: Tokenizer::from_gguf(&gguf).expect("tokenizer loads"),
            template: ChatTemplate::from_gguf(&gguf).expect("chat template loads"),
            gguf,
        }
    })
}

fn tokenizer_cases() -> Vec<TokenizerCase> {
    let cases: TokenizerCases = serde_json::from_str(include_str!("fixtures/tokenizer_cases.json")).expect("tokenizer_cases.json parses");
    cases.cases
}

fn greedy_cases() -> Vec<GreedyCase> {
    let cases: GreedyCases = serde_json::from_str(include_str!("fixtures/greedy_cases.json")).expect("greedy_cases.json parses");
    cases.cases
}

#[test]
fn every_reference_case_encodes_to_llama_cpp_ids_and_decodes_back_to_its_text() {
    let tok = &model().tokenizer;
    let cases = tokenizer_cases();
    assert!(cases.len() >= 10, "fixture has its cases");
    for case in cases {
        let ids = tok.encode(&case.text, true);
        assert_eq!(ids, case.ids, "ids for {:?}", case.text);
        assert_eq!(tok.decode(&ids), case.text, "round trip of {:?}", case.text);
    }
}

/// The default model's vocabulary and merges under another `tokenizer.ggml.pre`.
fn tokenizer_with_pre(pre: &str) -> Tokenizer {
    let mut w = GgufWriter::new();
    for (key, value) in model().gguf.metadata() {
        if key.starts_with("tokenizer.ggml.") && key != "tokenizer.ggml.pre" {
            w.meta(key, value.clone());
        }
    }
    w.meta("tokenizer.ggml.pre", Value::String(pre.to_string()));
    let gguf = GgufFile::parse(w.to_bytes()).expect("rewritten tokenizer metadata parses");
    Tokenizer::from_gguf(&gguf).expect("tokenizer loads")
}

#[derive(Deserialize)]
struct PreCases {
    pre: std::collections::BTreeMap<String, Vec<PreCase>>,
}

#[derive(Deserialize)]
struct PreCase {
    text: String,
    special: Vec<u32>,
    plain: Vec<u32>,
}

#[test]
fn every_pre_tokenizer_matches_llama_cpp_on_recorded_random_text() {
    let cases: PreCases = serde_json::from_str(include_str!("fixtures/llama_cpp_pre_cases.json")).expect("llama_cpp_pre_cases.json parses");
    assert_eq!(cases.pre.len(), 6, "smollm, gpt-2, llama-bpe, default, qwen2, falcon");
    for (pre, cases) in &cases.pre {
        let tok = tokenizer_with_pre(pre);
        for case in cases {
            assert_eq!(tok.encode(&case.text, true), case.special, "pre {pre}, special parsing, text {:?}", case.text);
            assert_eq!(tok.encode(&case.text, false), case.plain, "pre {pre}, no special parsing, text {:?}", case.text);
        }
    }
}

#[test]
fn every_greedy_prompt_encodes_to_its_prompt_ids() {
    let tok = &model().tokenizer;
    for case in greedy_cases() {
        assert_eq!(tok.encode(&case.prompt, true), case.prompt_ids, "prompt {:?}", case.prompt);
    }
}

#[test]
fn no_prefix_space_is_added_before_the_first_word() {
    let tok = &model().tokenizer;
    assert_eq!(tok.encode("Hello world", true), [19556, 905]);
    assert_eq!(tok.encode(" Hello world", true), [38699, 905]);
}

#[test]
fn the_chat_template_with_a_system_message_renders_the_first_greedy_prompt() {
    let case = &greedy_cases()[0];
    let messages = [ChatMessage::new("system", &case.system), ChatMessage::new("user", &case.user)];
    assert_eq!(case.system, "You are a helpful assistant.");
    assert_eq!(model().template.render(&messages, true).expect("renders"), case.prompt);
}

#[test]
fn the_chat_template_without_a_system_message_inserts_its_default_system_prompt() {
    let case = &greedy_cases()[1];
    let messages = [ChatMessage::new("user", &case.user)];
    assert_eq!(model().template.render(&messages, true).expect("renders"), case.prompt);
}

#[test]
fn the_chat_template_without_a_generation_prompt_ends_after_the_last_message() {
    let messages = [ChatMessage::new("system", "S"), ChatMessage::new("user", "U")];
    let text = model().template.render(&messages, false).expect("renders");
    assert_eq!(text, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n");
}

#[test]
fn control_tokens_are_plain_text_unless_special_parsing_is_on() {
    let tok = &model().tokenizer;
    assert_eq!(tok.encode("<|im_start|>", true), [1]);
    let plain = tok.encode("<|im_start|>", false);
    assert!(!plain.contains(&1), "{plain:?}");
    assert_eq!(tok.decode(&plain), "<|im_start|>");
}

#[test]
fn the_default_model_has_llama_cpp_special_ids_and_end_of_generation_set() {
    let tok = &model().tokenizer;
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_id(), 2);
    assert!(!tok.add_bos());
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(tok.token_to_id("<|endoftext|>"), Some(0));
    assert_eq!(tok.token_type(1), Some(TokenType::Control));
    // llama.cpp: <|endoftext|>, <|im_end|>, and <reponame> found as the FIM repo token.
    assert_eq!(tok.eog_ids(), [0, 2, 4]);
    assert!(tok.is_eog(2) && tok.is_eog(0));
    assert!(!tok.is_eog(1) && !tok.is_eog(198));
}

#[test]
fn tokenizer_and_template_can_be_shared_across_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<Tokenizer>();
    shareable::<ChatTemplate>();
}

#[test]
fn token_bytes_concatenated_one_token_at_a_time_rebuild_multibyte_text() {
    let tok = &model().tokenizer;
    let text = "naïve café — 東京 🚀<|im_end|>";
    let ids = tok.encode(text, true);
    let mut streamed = Vec::new();
    for &id in &ids {
        streamed.extend_from_slice(tok.token_bytes(id).expect("id in vocabulary"));
    }
    assert_eq!(String::from_utf8(streamed).expect("complete UTF-8"), text);
    // The rocket is split over several byte tokens, none valid UTF-8 alone.
    let rocket = tok.encode("🚀", false);
    assert!(rocket.len() > 1, "{rocket:?}");
    assert!(std::str::from_utf8(tok.token_bytes(rocket[0]).expect("in vocab")).is_err());
    assert_eq!(tok.token_bytes(u32::MAX), None);
}

#[test]
fn a_long_prompt_encodes_to_thousands_of_tokens_and_round_trips() {
    let tok = &model().tokenizer;
    let paragraph = "The quick brown fox, aged 12, jumps over 3 lazy dogs; naïve café — 東京 🚀!\n\
                     def f(x):\n    return x**2  # square\nUPPER lower MiXeD don't won't I'm 1,048,576 tokens.\n";
    let text = paragraph.repeat(160);
    let start = Instant::now();
    let ids = tok.encode(&text, true);
    let elapsed = start.elapsed();
    println!("encoded {} bytes to {} tokens in {:?} (build profile affects this)", text.len(), ids.len(), elapsed);
    assert!(ids.len() >= 8000, "{} tokens", ids.len());
    assert_eq!(tok.decode(&ids), text);
}

proptest! {
    #[test]
    fn decoding_the_encoding_of_any_string_gives_it_back(s in any::<String>()) {
        let tok = &model().tokenizer;
        prop_assert_eq!(tok.decode(&tok.encode(&s, false)), s);
    }

    #[test]
    fn decoding_the_encoding_of_text_like_strings_gives_them_back(
        s in "([a-zA-Z]{1,6}|[0-9]{1,4}|[ \t\n\r]{1,3}|'(s|t|re|ll)|[.,;:!?(){}<>|_\\-]|é|東京|🚀|\u{a0}|\u{3000}|<\\|im_end\\|>){0,40}"
    ) {
        let tok = &model().tokenizer;
        prop_assert_eq!(tok.decode(&tok.encode(&s, false)), s.clone());
        prop_assert_eq!(tok.decode(&tok.encode(&s, true)), s);
    }
}
