//! GGUF files: the container llama.cpp uses for weights, hyperparameters and tokenizer.
//!
//! # Layout
//! - [`reader`]: parse a whole file held in memory; every length and offset is bounds-checked
//!   so a truncated or corrupt file is an error, never a panic or a huge allocation.
//! - [`writer`]: build GGUF files: small ones in memory, for test fixtures (synthetic models),
//!   and large ones streamed tensor by tensor (`bulkhead synth-model`'s generator).
//! - [`types`]: metadata values and ggml tensor types with their block sizes.
#![forbid(unsafe_code)]

pub mod reader;
pub mod types;
pub mod writer;

pub use reader::{GgufError, GgufFile, TensorInfo};
pub use types::{GgmlType, Value};
pub use writer::{GgufStream, GgufWriter};

/// The four bytes every GGUF file starts with.
pub const MAGIC: &[u8; 4] = b"GGUF";
/// Default alignment of the tensor data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
