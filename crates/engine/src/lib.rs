#![forbid(unsafe_code)]
//! Bulkhead engine: token sampling, stop-string handling and streaming
//! detokenisation for batched generation.
//!
//! # Layout
//!
//! - [`rng`]: a small seeded PRNG (xoshiro256\*\* seeded through SplitMix64);
//!   no external `rand` dependency.
//! - [`sampling`]: [`SamplingParams`] and the per-sequence [`Sampler`]
//!   (greedy, temperature, top-k, top-p).
//! - [`stop`]: [`StopMatcher`], stop-string matching over streamed text.
//! - [`detok`]: [`Utf8Stream`], incremental UTF-8 assembly of token byte pieces.
//! - [`batch`]: [`Engine`], continuous batching of requests over one model and KV pool.
//! - [`load`]: model, tokenizer and chat template from one GGUF file.

pub mod batch;
pub mod detok;
pub mod load;
pub mod rng;
pub mod sampling;
pub mod stop;

pub use batch::{Engine, EngineError, Event, FinishReason, GenRequest};
pub use detok::Utf8Stream;
pub use load::{load_model, LoadError, LoadedModel};
pub use rng::Rng;
pub use sampling::{Sampler, SamplingError, SamplingParams};
pub use stop::{StopMatcher, StopOutcome};
