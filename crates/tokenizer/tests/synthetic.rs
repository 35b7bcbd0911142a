//! Behaviour on small synthetic GGUF files: BPE merging on a tiny vocabulary, special tokens,
//! and the typed errors a malformed tokenizer gives.

use bulkhead_gguf::{GgufFile, GgufWriter, Value};
use bulkhead_tokenizer::{ChatMessage, ChatTemplate, TokenType, Tokenizer, TokenizerError};

fn strings(items: &[&str]) -> Value {
    Value::Array(items.iter().map(|s| Value::String((*s).to_string())).collect())
}

/// A writer with a gpt2 tokenizer over `tokens` (byte-level spellings) and `merges`.
fn vocab(pre: &str, tokens: &[&str], merges: &[&str]) -> GgufWriter {
    vocab_of_model("gpt2", pre, tokens, merges)
}

fn vocab_of_model(model: &str, pre: &str, tokens: &[&str], merges: &[&str]) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.meta("tokenizer.ggml.model", Value::String(model.into()))
        .meta("tokenizer.ggml.pre", Value::String(pre.into()))
        .meta("tokenizer.ggml.tokens", strings(tokens))
        .meta("tokenizer.ggml.merges", strings(merges))
        .meta("tokenizer.ggml.eos_token_id", Value::U32(0));
    w
}

fn load(w: &GgufWriter) -> Result<Tokenizer, TokenizerError> {
    let gguf = GgufFile::parse(w.to_bytes()).expect("synthetic GGUF parses");
    Tokenizer::from_gguf(&gguf)
}

fn ids(tok: &Tokenizer, names: &[&str]) -> Vec<u32> {
    names.iter().map(|n| tok.token_to_id(n).unwrap_or_else(|| panic!("token {n:?}"))).collect()
}

const ABC: &[&str] = &["<eos>", "a", "b", "c", "Ġ", "ab", "bc", "abc", "Ġa"];

#[test]
fn the_pair_with_the_lowest_merge_rank_is_merged_first() {
    let tok = load(&vocab("gpt-2", ABC, &["b c", "a b", "a bc"])).expect("loads");
    assert_eq!(tok.encode("abc", false), ids(&tok, &["abc"]));
    let tok = load(&vocab("gpt-2", ABC, &["a b", "b c", "a bc"])).expect("loads");
    assert_eq!(tok.encode("abc", false), ids(&tok, &["ab", "c"]));
}

#[test]
fn equal_ranks_merge_leftmost_first() {
    let tok = load(&vocab("gpt-2", &["<eos>", "a", "aa", "aaaa"], &["a a", "aa aa"])).expect("loads");
    assert_eq!(tok.encode("aaa", false), ids(&tok, &["aa", "a"]));
    assert_eq!(tok.encode("aaaaa", false), ids(&tok, &["aaaa", "a"]));
}

#[test]
fn merges_may_pass_through_pieces_that_are_not_tokens() {
    // "ab" is no token, but the merge "ab c" still builds the token "abc" from it.
    let tok = load(&vocab("gpt-2", &["<eos>", "a", "b", "c", "abc"], &["a b", "ab c"])).expect("loads");
    assert_eq!(tok.encode("abc", false), ids(&tok, &["abc"]));
    // When the final piece is not a token, it falls back to one token per byte.
    assert_eq!(tok.encode("ab", false), ids(&tok, &["a", "b"]));
}

#[test]
fn a_space_is_merged_with_the_following_word_and_never_added_in_front() {
    let tok = load(&vocab("gpt-2", ABC, &["Ġ a", "a b"])).expect("loads");
    assert_eq!(tok.encode("a a", false), ids(&tok, &["a", "Ġa"]));
    assert_eq!(tok.encode(" a", false), ids(&tok, &["Ġa"]));
    assert_eq!(tok.decode(&tok.encode(" a", false)), " a");
}

#[test]
fn the_longest_special_token_is_cut_out_first_and_user_defined_ones_always() {
    let mut w = vocab("gpt-2", &["<eos>", "a", "<x>", "<x>a", "<u>", "<", ">", "x", "u"], &[]);
    w.meta("tokenizer.ggml.token_type", Value::Array([3, 1, 3, 3, 4, 1, 1, 1, 1].map(Value::I32).to_vec()));
    let tok = load(&w).expect("loads");
    assert_eq!(tok.encode("<x>a<x>", true), ids(&tok, &["<x>a", "<x>"]));
    assert_eq!(tok.encode("a<u>", false), ids(&tok, &["a", "<u>"]));
    assert_eq!(tok.encode("<x>", false), ids(&tok, &["<", "x", ">"]));
    assert_eq!(tok.token_type(4), Some(TokenType::UserDefined));
}

#[test]
fn a_token_named_like_an_end_of_turn_marker_becomes_a_control_token_that_ends_generation() {
    let tok = load(&vocab("gpt-2", &["<eos>", "a", "<|im_end|>"], &[])).expect("loads");
    let im_end = tok.token_to_id("<|im_end|>").expect("present");
    assert_eq!(tok.token_type(im_end), Some(TokenType::Control));
    assert!(tok.is_eog(im_end) && tok.is_eog(0) && !tok.is_eog(1));
    assert_eq!(tok.encode("a<|im_end|>", true), [1, im_end]);
}

#[test]
fn a_gguf_without_tokens_is_an_error_naming_the_tokens_key() {
    let mut w = GgufWriter::new();
    w.meta("tokenizer.ggml.model", Value::String("gpt2".into()))
        .meta("tokenizer.ggml.pre", Value::String("smollm".into()))
        .meta("tokenizer.ggml.merges", strings(&["a b"]));
    let err = load(&w).expect_err("no tokens");
    assert!(matches!(err, TokenizerError::MissingKey { key: "tokenizer.ggml.tokens" }), "{err:?}");
    assert!(err.to_string().contains("tokenizer.ggml.tokens"), "{err}");
}

#[test]
fn a_gguf_without_merges_is_an_error_naming_the_merges_key() {
    let mut w = GgufWriter::new();
    w.meta("tokenizer.ggml.model", Value::String("gpt2".into())).meta("tokenizer.ggml.tokens", strings(&["a"]));
    let err = load(&w).expect_err("no merges");
    assert!(matches!(err, TokenizerError::MissingKey { key: "tokenizer.ggml.merges" }), "{err:?}");
}

#[test]
fn an_unknown_tokenizer_model_is_an_error_naming_the_model_key_and_value() {
    // WordPiece (BERT's) is a model llama.cpp knows and we do not load.
    let err = load(&vocab_of_model("bert", "default", ABC, &[])).expect_err("wpm is unsupported");
    assert!(matches!(&err, TokenizerError::UnsupportedModel { value } if value == "bert"), "{err:?}");
    assert!(err.to_string().contains("tokenizer.ggml.model") && err.to_string().contains("bert"), "{err}");
}

#[test]
fn an_unknown_pre_tokenizer_is_an_error_naming_the_pre_key_and_value() {
    let err = load(&vocab("mystery-bpe", ABC, &[])).expect_err("unknown pre");
    assert!(matches!(&err, TokenizerError::UnknownPre { value } if value == "mystery-bpe"), "{err:?}");
    assert!(err.to_string().contains("tokenizer.ggml.pre") && err.to_string().contains("mystery-bpe"), "{err}");
}

#[test]
fn a_token_type_list_of_the_wrong_length_is_an_error_naming_its_key() {
    let mut w = vocab("gpt-2", ABC, &[]);
    w.meta("tokenizer.ggml.token_type", Value::Array(vec![Value::I32(1)]));
    let err = load(&w).expect_err("short token_type");
    assert!(matches!(err, TokenizerError::InvalidValue { key: "tokenizer.ggml.token_type", .. }), "{err:?}");
}

#[test]
fn a_special_id_outside_the_vocabulary_is_an_error_naming_its_key() {
    let mut w = vocab("gpt-2", ABC, &[]);
    w.meta("tokenizer.ggml.bos_token_id", Value::U32(1000));
    let err = load(&w).expect_err("bos out of range");
    assert!(matches!(err, TokenizerError::InvalidValue { key: "tokenizer.ggml.bos_token_id", .. }), "{err:?}");
}

#[test]
fn a_gguf_without_a_chat_template_is_an_error_naming_the_template_key() {
    let gguf = GgufFile::parse(vocab("gpt-2", ABC, &[]).to_bytes()).expect("parses");
    let err = ChatTemplate::from_gguf(&gguf).expect_err("no template");
    assert!(matches!(err, TokenizerError::MissingKey { key: "tokenizer.chat_template" }), "{err:?}");
}

#[test]
fn a_chat_template_that_does_not_parse_is_a_syntax_error() {
    let err = ChatTemplate::new("{% for m in messages %}", "", "").expect_err("unclosed for");
    assert!(matches!(err, TokenizerError::TemplateSyntax(_)), "{err:?}");
}

#[test]
fn raise_exception_in_a_chat_template_is_a_typed_error_with_its_message() {
    let t = ChatTemplate::new(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with user') }}{% endif %}ok",
        "",
        "",
    )
    .expect("compiles");
    let err = t.render(&[ChatMessage::new("assistant", "hi")], false).expect_err("raises");
    assert!(matches!(&err, TokenizerError::TemplateRaised { message } if message == "Conversations must start with user"), "{err:?}");
    assert_eq!(t.render(&[ChatMessage::new("user", "hi")], false).expect("renders"), "ok");
}

#[test]
fn chat_templates_get_python_string_methods_and_hugging_face_whitespace_control() {
    let t = ChatTemplate::new(
        "{{ bos_token }}\n{% for m in messages %}\n  {{ m.role.upper() }}: {{ m.content.strip() }}\n{% endfor %}{{ eos_token }}",
        "<s>",
        "</s>",
    )
    .expect("compiles");
    let out = t.render(&[ChatMessage::new("user", "  hi  ")], true).expect("renders");
    assert_eq!(out, "<s>\n  USER: hi\n</s>");
}

#[test]
fn the_chat_template_reads_bos_and_eos_token_texts_from_the_gguf() {
    let mut w = vocab("gpt-2", ABC, &[]);
    w.meta("tokenizer.chat_template", Value::String("{{ bos_token }}|{{ eos_token }}".into()))
        .meta("tokenizer.ggml.bos_token_id", Value::U32(1));
    let gguf = GgufFile::parse(w.to_bytes()).expect("parses");
    let t = ChatTemplate::from_gguf(&gguf).expect("loads");
    assert_eq!(t.render(&[], false).expect("renders"), "a|<eos>");
}
