//! A small vocabulary for tests and fuzzing that must not load a real model: every byte is
//! a token (byte-level, no merges), plus ChatML's `<|im_start|>` and `<|im_end|>` (the
//! end-of-generation token), under a ChatML chat template. Mock backends serve it as their
//! [`PromptEncoder`].

use std::sync::Arc;

use bulkhead_gguf::{GgufFile, GgufWriter, Value};
use bulkhead_tokenizer::{ChatTemplate, Tokenizer};

use crate::PromptEncoder;

/// ChatML, as SmolLM2's template renders it (no default system message).
const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// The byte-level encoder: token `b` is byte `b` for every byte, 256 is `<|im_start|>`,
/// 257 is `<|im_end|>`.
pub fn byte_level_encoder() -> PromptEncoder {
    let (tokenizer, chat) = byte_level_vocabulary();
    PromptEncoder::new(Arc::new(tokenizer), Some(chat))
}

/// The tokenizer and chat template of [`byte_level_encoder`].
pub fn byte_level_vocabulary() -> (Tokenizer, ChatTemplate) {
    byte_level_vocabulary_adding_bos(false)
}

/// [`byte_level_vocabulary`], whose tokenizer asks for its BOS (256) before a prompt when
/// `add_bos`, as Gemma's and Llama's do.
pub fn byte_level_vocabulary_adding_bos(add_bos: bool) -> (Tokenizer, ChatTemplate) {
    // GPT-2's byte-to-character map, as the byte-level tokenizer reads tokens.
    let printable: Vec<u32> = (b'!'..=b'~').chain(0xA1..=0xAC).chain(0xAE..=0xFF).map(u32::from).collect();
    let mut chars = vec![0u32; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        chars[b as usize] = if printable.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
    }
    let mut tokens: Vec<Value> = chars.iter().map(|&c| Value::String(char::from_u32(c).map(String::from).unwrap_or_default())).collect();
    tokens.push(Value::String("<|im_start|>".into()));
    tokens.push(Value::String("<|im_end|>".into()));
    let mut types = vec![Value::I32(1); 256];
    types.extend([Value::I32(3), Value::I32(3)]);
    let mut w = GgufWriter::new();
    w.meta("tokenizer.ggml.model", Value::String("gpt2".into()))
        .meta("tokenizer.ggml.tokens", Value::Array(tokens))
        .meta("tokenizer.ggml.token_type", Value::Array(types))
        .meta("tokenizer.ggml.merges", Value::Array(Vec::new()))
        .meta("tokenizer.ggml.bos_token_id", Value::U32(256))
        .meta("tokenizer.ggml.eos_token_id", Value::U32(257))
        .meta("tokenizer.ggml.add_bos_token", Value::Bool(add_bos))
        .meta("tokenizer.chat_template", Value::String(CHATML.into()));
    // Built from constants: these cannot fail unless the tokenizer's own rules change,
    // which every test using it would show at once.
    let gguf = GgufFile::parse(w.to_bytes()).expect("the byte-level vocabulary is a valid GGUF");
    let tokenizer = Tokenizer::from_gguf(&gguf).expect("the byte-level vocabulary is a valid tokenizer");
    let chat = ChatTemplate::from_gguf(&gguf).expect("ChatML compiles");
    (tokenizer, chat)
}
