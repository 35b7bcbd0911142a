//! The real model behind the same schedules: prefill workers run [`Llama::forward`] on
//! their chunks and sample the first token, as `crates/server`'s prefill worker does;
//! decode workers run an [`Engine`] over their pool, as its decode worker does. The
//! reference is the same engine generating in process on a fresh pool
//! ([`Engine::add`]), greedy; the forward pass is row-deterministic (a sequence's logits
//! do not depend on batching or chunking), so every finished output must equal it token
//! for token.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;

use bulkhead_engine::{Engine, Event, FinishReason, GenRequest, Sampler, SamplingParams};
use bulkhead_kv::{KvChecks, KvLayout, KvPool, PoolConfig, RequestId, SequenceKv};
use bulkhead_model::{Llama, SeqInput};
use bulkhead_protocol::decode::DecodeStart;
use bulkhead_protocol::{Finish, Sampling};
use bulkhead_tokenizer::Tokenizer;

use crate::model::{DecodeModel, Expected, GenEvent, ModelFault, Models, PrefillModel, Shape};

fn fault(e: impl std::fmt::Display) -> ModelFault {
    ModelFault(e.to_string())
}

fn params(s: &Sampling) -> SamplingParams {
    SamplingParams { temperature: s.temperature, top_k: s.top_k as usize, top_p: s.top_p, seed: s.seed, ignore_eos: s.ignore_eos }
}

fn events(evs: Vec<Event>) -> Vec<GenEvent> {
    evs.into_iter()
        .map(|e| match e {
            Event::Token { id, token, text } => GenEvent::Token { req: id, token, text },
            Event::Finished { id, reason, text, prompt_tokens, completion_tokens } => GenEvent::Finished {
                req: id,
                finish: if reason == FinishReason::Length { Finish::Length } else { Finish::Stop },
                text,
                prompt_tokens: prompt_tokens as u32,
                completion_tokens: completion_tokens as u32,
            },
            Event::Failed { id, error } => GenEvent::Failed { req: id, detail: format!("KV read check failed: {error}") },
        })
        .collect()
}

/// A prefill worker's compute on the real model.
pub struct RealPrefill {
    model: Arc<Llama>,
    pool: KvPool,
}

impl PrefillModel for RealPrefill {
    fn pool(&self) -> &KvPool {
        &self.pool
    }
    fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }
    fn compute(&mut self, seq: &mut SequenceKv, tokens: &[u32], from: usize, to: usize, sampling: &Sampling) -> Result<Option<u32>, ModelFault> {
        let last = to == tokens.len();
        let logits = self.model.forward(&mut self.pool, &mut [SeqInput { kv: seq, tokens: &tokens[from..to], want_logits: last }]).map_err(fault)?;
        if !last {
            return Ok(None);
        }
        let mut sampler = Sampler::new(params(sampling)).map_err(fault)?;
        Ok(Some(sampler.sample(&logits).map_err(fault)?))
    }
}

/// A decode worker's engine.
pub struct RealDecode(Engine);

impl DecodeModel for RealDecode {
    fn pool(&self) -> &KvPool {
        self.0.pool()
    }
    fn pool_mut(&mut self) -> &mut KvPool {
        self.0.pool_mut()
    }
    fn add_verified(&mut self, s: DecodeStart) -> Result<Vec<GenEvent>, ModelFault> {
        let (_, evs) = self.0.add_verified(s.seq, s.first_token, s.max_tokens as usize, params(&s.sampling), s.stop).map_err(fault)?;
        Ok(events(evs))
    }
    fn step(&mut self) -> Result<Vec<GenEvent>, ModelFault> {
        Ok(events(self.0.step().map_err(fault)?))
    }
    fn abort(&mut self, req: RequestId) {
        // Releasing a live sequence's leases cannot fail; if it did, the end-of-schedule
        // pool check reports the pages still leased.
        let _ = self.0.abort(req);
    }
    fn active(&self) -> usize {
        self.0.active()
    }
}

/// The real model family: one layout (the model's), prompts of real token ids.
pub struct RealModels {
    model: Arc<Llama>,
    tokenizer: Arc<Tokenizer>,
    page_size: usize,
    /// The same prompt is asked for again when a schedule repeats; the engine is slow.
    references: RefCell<BTreeMap<(Vec<u32>, u32), Expected>>,
}

impl RealModels {
    /// Schedules over `model` with pages of `page_size` tokens.
    pub fn new(model: Arc<Llama>, tokenizer: Arc<Tokenizer>, page_size: usize) -> Self {
        RealModels { model, tokenizer, page_size, references: RefCell::new(BTreeMap::new()) }
    }
}

impl Models for RealModels {
    type Prefill = RealPrefill;
    type Decode = RealDecode;

    fn shape(&self) -> Shape {
        Shape {
            layouts: vec![self.model.kv_layout(self.page_size)],
            vocab: self.model.config.vocab as u32,
            // Small pools and short requests: a schedule costs a few dozen forward calls.
            model_context: 12 * self.page_size,
            max_requests: 4,
            max_prompt: 3 * self.page_size,
            max_generate: 6,
            decode_pages: (4, 12),
            prefill_pages: (3, 8),
        }
    }

    fn prefill(&self, pool: KvPool) -> RealPrefill {
        RealPrefill { model: self.model.clone(), pool }
    }

    fn decode(&self, pool: KvPool, max_context: usize) -> RealDecode {
        RealDecode(Engine::new(self.model.clone(), self.tokenizer.clone(), pool, 512, max_context))
    }

    fn reference(&self, layout: KvLayout, prompt: &[u32], max_tokens: u32) -> Result<Expected, ModelFault> {
        let key = (prompt.to_vec(), max_tokens);
        if let Some(e) = self.references.borrow().get(&key) {
            return Ok(e.clone());
        }
        let total = prompt.len() + max_tokens as usize;
        let pool = KvPool::new(PoolConfig { layout, pages: layout.pages_for_tokens(total).max(1), checks: KvChecks::all() })?;
        let mut engine = Engine::new(self.model.clone(), self.tokenizer.clone(), pool, 512, total);
        let req = GenRequest { prompt: prompt.to_vec(), max_tokens: max_tokens as usize, sampling: SamplingParams::default(), stop: Vec::new() };
        engine.add(req).map_err(fault)?;
        let mut evs = Vec::new();
        while engine.active() > 0 {
            evs.extend(events(engine.step().map_err(fault)?));
        }
        let want = Expected::from_events(&evs).ok_or_else(|| ModelFault("the reference did not finish".into()))?;
        self.references.borrow_mut().insert(key, want.clone());
        Ok(want)
    }
}
