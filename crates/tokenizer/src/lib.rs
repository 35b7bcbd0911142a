//! Tokenizer and chat template for Bulkhead, read from the model's GGUF file and matching
//! llama.cpp (`llama-vocab.cpp`) token for token.
//!
//! # Layout
//! - [`tokenizer`]: [`Tokenizer`], byte-level BPE (`tokenizer.ggml.model = "gpt2"`) or
//!   SentencePiece: special
//!   tokens cut out first, then pre-tokenizer regexes, then merges by rank; decoding per token
//!   for streaming.
//! - `spm`: SentencePiece (`tokenizer.ggml.model = "llama"`): merges by token score, byte
//!   fallback, `add_space_prefix`.
//! - `pretok`: the pre-tokenizer regexes for each `tokenizer.ggml.pre` value.
//! - `bytelevel`: GPT-2's byte <-> character alphabet.
//! - [`chat`]: [`ChatTemplate`], the GGUF's Jinja chat template rendered with minijinja.
//! - [`error`]: [`TokenizerError`], whose variants name the GGUF key at fault.
#![forbid(unsafe_code)]

mod bytelevel;
pub mod chat;
pub mod error;
mod pretok;
mod spm;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use error::TokenizerError;
pub use tokenizer::{TokenType, Tokenizer};
