#![forbid(unsafe_code)]
//! Bulkhead engine: token sampling, stop-string handling and streaming
//! detokenisation for batched generation.
//!
//! # Layout
//!
//! - [`rng`]: a small seeded PRNG (xoshiro256\*\* seeded through SplitMix64);
//!   no external `rand` dependency.
//! - [`sampling`]: the per-sequence [`Sampler`] over the protocol's `Sampling`
//!   (greedy, temperature, top-k, top-p).
//! - [`choose`]: [`Chooser`], one sequence's next token from the model's logits under its
//!   penalties, bias, `min_tokens` and grammar, with log-probabilities.
//! - [`stop`]: [`StopMatcher`], stop-string matching over streamed text.
//! - [`detok`]: [`Utf8Stream`], incremental UTF-8 assembly of token byte pieces.
//! - [`batch`]: [`Engine`], continuous batching of requests over one model and KV pool.
//! - [`speculate`]: speculative decoding's n-gram proposals and when to make them.
//! - [`draft`]: speculative decoding's draft model, in its own KV pool.
//! - [`disagg`]: the engine behind the protocol's driver core: [`Engine`] as a decode
//!   worker's loop, [`Prefiller`] as a prefill worker's compute.
//! - [`load`]: model, tokenizer and chat template from one GGUF file.

pub mod batch;
pub mod choose;
pub mod detok;
pub mod disagg;
pub mod draft;
pub mod load;
pub mod rng;
pub mod sampling;
pub mod speculate;
pub mod stop;

pub use batch::{DEFAULT_PREFILL_CHUNK, Engine, EngineConfig, EngineError, Event, GenRequest};
pub use bulkhead_protocol::{FinishReason, Sampling};
pub use choose::{Choice, ChooseError, Chooser, Vocabulary};
pub use detok::Utf8Stream;
pub use disagg::Prefiller;
pub use draft::{DraftError, DraftModel};
pub use load::{LoadError, LoadedModel, load_model, load_model_with};
pub use rng::Rng;
pub use sampling::{Sampler, SamplingError};
pub use speculate::{SpecCounters, Speculation};
pub use stop::{StopMatcher, StopOutcome};
