//! What a schedule needs of a model: a prefill side that computes prompt KV into its own
//! pool, a decode side shaped like [`bulkhead_engine::Engine`] (verified sequences in,
//! token events out), and a reference output for a prompt. [`crate::mock`] and
//! [`crate::real`] implement it.

use bulkhead_kv::{KvLayout, KvPool, RequestId, SequenceKv};
use bulkhead_protocol::decode::DecodeStart;
use bulkhead_protocol::{Finish, Sampling};

/// What the decode loop produced for one request, as the engine reports it.
#[derive(Clone, Debug, PartialEq)]
pub enum GenEvent {
    /// A token was generated; `text` is what may be shown now.
    Token { req: RequestId, token: u32, text: String },
    /// The request ended.
    Finished { req: RequestId, finish: Finish, text: String, prompt_tokens: u32, completion_tokens: u32 },
    /// The request failed a KV read check and left the loop (its pages are given back).
    Failed { req: RequestId, detail: String },
}

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
    pub finish: Finish,
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
                GenEvent::Failed { .. } => return None,
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
pub trait PrefillModel {
    /// Its KV pool.
    fn pool(&self) -> &KvPool;
    /// Its KV pool, to lease and release the job's pages.
    fn pool_mut(&mut self) -> &mut KvPool;
    /// Compute and commit the KV of prompt positions `from..to` into `seq` (reserved for
    /// the whole prompt, `from` tokens committed). After the last position, the first
    /// generated token, sampled with `sampling`.
    fn compute(&mut self, seq: &mut SequenceKv, tokens: &[u32], from: usize, to: usize, sampling: &Sampling) -> Result<Option<u32>, ModelFault>;
    /// Reads that were refused or found a slot missing (a mock's evidence; 0 otherwise).
    fn read_faults(&self) -> u64 {
        0
    }
}

/// The decode loop of a decode worker, shaped like [`bulkhead_engine::Engine`].
pub trait DecodeModel {
    /// Its KV pool.
    fn pool(&self) -> &KvPool;
    /// Its KV pool, for the decode role's reservations.
    fn pool_mut(&mut self) -> &mut KvPool;
    /// Take a verified request and its first token; the events of that token.
    fn add_verified(&mut self, start: DecodeStart) -> Result<Vec<GenEvent>, ModelFault>;
    /// One step of every active request.
    fn step(&mut self) -> Result<Vec<GenEvent>, ModelFault>;
    /// End a request now and release its pages.
    fn abort(&mut self, req: RequestId);
    /// Requests in the loop.
    fn active(&self) -> usize;
    /// Reads that were refused or found a slot missing (a mock's evidence; 0 otherwise).
    fn read_faults(&self) -> u64 {
        0
    }
}

/// A model family: workers' compute and the reference.
pub trait Models {
    /// Prefill compute.
    type Prefill: PrefillModel;
    /// Decode loop.
    type Decode: DecodeModel;
    /// The limits schedules are drawn within.
    fn shape(&self) -> Shape;
    /// A prefill worker's compute over `pool`.
    fn prefill(&self, pool: KvPool) -> Self::Prefill;
    /// A decode worker's loop over `pool`, admitting requests up to `max_context`.
    fn decode(&self, pool: KvPool, max_context: usize) -> Self::Decode;
    /// What `prompt` with `max_tokens` must produce, computed alone on a fresh pool.
    fn reference(&self, layout: KvLayout, prompt: &[u32], max_tokens: u32) -> Result<Expected, ModelFault>;
}
