//! The real model behind the same schedules: prefill workers compute with
//! [`Prefiller`] and decode workers run an [`Engine`] over their pool, the very adapters
//! the worker processes (`crates/worker`) use. The
//! reference is the same engine generating in process on a fresh pool
//! ([`Engine::add`]), greedy; the forward pass is row-deterministic (a sequence's logits
//! do not depend on batching or chunking), so every finished output must equal it token
//! for token.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;

use bulkhead_engine::{Engine, EngineConfig, GenRequest, Prefiller, Speculation};
use bulkhead_kv::{KvChecks, KvLayout, KvPool, PoolConfig};
use bulkhead_model::Llama;
use bulkhead_protocol::Sampling;
use bulkhead_tokenizer::Tokenizer;

use crate::model::{DecodeModel, Expected, ModelFault, Models, PrefillModel, Shape};

fn fault(e: impl std::fmt::Display) -> ModelFault {
    ModelFault(e.to_string())
}

/// A prefill worker's compute on the real model: the server's own adapter.
impl PrefillModel for Prefiller {}

/// A decode worker's loop on the real model: the server's own engine.
impl DecodeModel for Engine {
    fn pool(&self) -> &KvPool {
        Engine::pool(self)
    }
    fn retractions(&self) -> u64 {
        Engine::retractions(self)
    }
}

/// A reference generation's key: prompt, maximum tokens and the sampling settings' text.
type ReferenceKey = (Vec<u32>, u32, String);

/// The real model family: one layout (the model's), prompts of real token ids.
pub struct RealModels {
    model: Arc<Llama>,
    tokenizer: Arc<Tokenizer>,
    page_size: usize,
    /// The same prompt is asked for again when a schedule repeats; the engine is slow.
    references: RefCell<BTreeMap<ReferenceKey, Expected>>,
}

impl RealModels {
    /// Schedules over `model` with pages of `page_size` tokens.
    pub fn new(model: Arc<Llama>, tokenizer: Arc<Tokenizer>, page_size: usize) -> Self {
        RealModels { model, tokenizer, page_size, references: RefCell::new(BTreeMap::new()) }
    }
}

impl Models for RealModels {
    type Prefill = Prefiller;
    type Decode = Engine;

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

    fn prefill(&self) -> Prefiller {
        Prefiller::new(self.model.clone(), self.tokenizer.clone())
    }

    /// The decode loop as `serve` runs it by default: speculating (against references
    /// computed without).
    fn decode(&self, pool: KvPool, max_context: usize) -> Engine {
        let cfg = EngineConfig { speculation: Speculation::Ngram { tokens: 4 }, ..EngineConfig::for_context(max_context) };
        Engine::new(self.model.clone(), self.tokenizer.clone(), pool, cfg)
    }

    fn reference(&self, layout: KvLayout, prompt: &[u32], max_tokens: u32, sampling: &Sampling) -> Result<Expected, ModelFault> {
        let key = (prompt.to_vec(), max_tokens, format!("{sampling:?}"));
        if let Some(e) = self.references.borrow().get(&key) {
            return Ok(e.clone());
        }
        let total = prompt.len() + max_tokens as usize;
        let pool = KvPool::new(PoolConfig { layout, pages: layout.pages_for_tokens(total).max(1), checks: KvChecks::all() })?;
        let mut engine = Engine::new(self.model.clone(), self.tokenizer.clone(), pool, EngineConfig::for_context(total));
        let req = GenRequest { prompt: prompt.to_vec(), max_tokens: max_tokens as usize, sampling: sampling.clone(), stop: Vec::new() };
        engine.add(req).map_err(fault)?;
        let mut evs = Vec::new();
        while engine.active() > 0 {
            evs.extend(engine.step().map_err(fault)?);
        }
        let want = Expected::from_events(&evs).ok_or_else(|| ModelFault("the reference did not finish".into()))?;
        self.references.borrow_mut().insert(key, want.clone());
        Ok(want)
    }
}
