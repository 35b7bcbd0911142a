//! What a schedule needs of a model: the production driver core's model traits (a prefill
//! side that computes prompt KV into its own pool, a decode loop of verified sequences),
//! the evidence a mock keeps, and a reference output for a prompt. [`crate::mock`] and
//! [`crate::real`] implement it.

use bulkhead_kv::{KvLayout, KvPool};
use bulkhead_protocol::driver::decode::{DecodeEngine, GenEvent};
use bulkhead_protocol::driver::prefill::PrefillCompute;
use bulkhead_protocol::{FinishReason, Sampling};

/// A model step failed (a refused KV access, an engine error).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ModelFault(pub String);

impl From<bulkhead_kv::KvError> for ModelFault {
    fn from(e: bulkhead_kv::KvError) -> Self {
        ModelFault(e.to_string())
    }
}

/// What a client must receive for a prompt that finishes: the same model run alone on a
/// fresh private pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expected {
    /// Every token's text and the final text, concatenated.
    pub text: String,
    /// How it ended.
    pub finish: FinishReason,
    /// Tokens generated.
    pub completion_tokens: u32,
}

impl Expected {
    /// The outcome the events describe, if they end with `Finished`.
    pub fn from_events(events: &[GenEvent]) -> Option<Expected> {
        let mut text = String::new();
        for e in events {
            match e {
                GenEvent::Token { text: t, .. } => text.push_str(t),
                GenEvent::Finished { finish, text: t, completion_tokens, .. } => {
                    text.push_str(t);
                    return Some(Expected { text, finish: *finish, completion_tokens: *completion_tokens });
                }
                GenEvent::Failed { .. } | GenEvent::Retracted { .. } => return None,
            }
        }
        None
    }
}

/// The limits a model family puts on schedules.
#[derive(Clone, Debug)]
pub struct Shape {
    /// Page layouts a schedule picks one from (prefill and decode pools share it).
    pub layouts: Vec<KvLayout>,
    /// Prompt tokens are drawn from `0..vocab`.
    pub vocab: u32,
    /// The model's context: no worker advertises more.
    pub model_context: usize,
    /// Most requests in one schedule.
    pub max_requests: u64,
    /// Longest prompt drawn for a request meant to fit.
    pub max_prompt: usize,
    /// Most tokens a request meant to fit asks for.
    pub max_generate: u32,
    /// Decode pool size in pages, smallest and largest drawn.
    pub decode_pages: (u64, u64),
    /// Prefill pool size in pages, smallest and largest drawn.
    pub prefill_pages: (u64, u64),
}

/// The compute of a prefill worker, over its own pool.
pub trait PrefillModel: PrefillCompute {
    /// Reads that were refused or found a slot missing (a mock's evidence; 0 otherwise).
    fn read_faults(&self) -> u64 {
        0
    }
}

/// The decode loop of a decode worker.
pub trait DecodeModel: DecodeEngine {
    /// Its KV pool, for the verdict.
    fn pool(&self) -> &KvPool;
    /// Sequences it retracted to let others grow.
    fn retractions(&self) -> u64;
    /// Reads that were refused or found a slot missing (a mock's evidence; 0 otherwise).
    fn read_faults(&self) -> u64 {
        0
    }
    /// Plant [`Sabotage::KeepRejectedDrafts`](crate::Sabotage): leave rejected speculative
    /// drafts' KV in place. Models that cannot plant it ignore it.
    fn keep_rejected_drafts(&mut self) {}
}

/// A model family: workers' compute and the reference.
pub trait Models {
    /// Prefill compute.
    type Prefill: PrefillModel;
    /// Decode loop.
    type Decode: DecodeModel;
    /// The limits schedules are drawn within.
    fn shape(&self) -> Shape;
    /// A prefill worker's compute.
    fn prefill(&self) -> Self::Prefill;
    /// A decode worker's loop over `pool`, admitting requests up to `max_context`.
    fn decode(&self, pool: KvPool, max_context: usize) -> Self::Decode;
    /// What `prompt` with `max_tokens`, its tokens picked as `sampling` says, must produce,
    /// computed alone on a fresh pool.
    fn reference(&self, layout: KvLayout, prompt: &[u32], max_tokens: u32, sampling: &Sampling) -> Result<Expected, ModelFault>;
}
