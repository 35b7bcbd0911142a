//! The engine behind the protocol's driver core ([`bulkhead_protocol::driver`]): the decode
//! loop of a decode worker ([`Engine`] as a [`DecodeEngine`]) and the prompt compute of a
//! prefill worker ([`Prefiller`]). The server's workers and the fault schedules on the real
//! model use these same two adapters.

use std::sync::Arc;

use bulkhead_kv::{KvPool, RequestId, SequenceKv};
use bulkhead_model::{Llama, SeqInput};
use bulkhead_protocol::decode::{DecodeStart, LocalStart, Retired};
use bulkhead_protocol::driver::decode::{DecodeEngine, GenEvent};
use bulkhead_protocol::driver::prefill::{Chunk, First, PrefillCompute};
use bulkhead_tokenizer::Tokenizer;

use crate::batch::{Engine, EngineError};
use crate::choose::Vocabulary;

impl DecodeEngine for Engine {
    type Error = EngineError;

    fn pool_mut(&mut self) -> &mut KvPool {
        Engine::pool_mut(self)
    }

    fn add_verified(&mut self, s: DecodeStart) -> Result<Vec<GenEvent>, EngineError> {
        let (_, events) = Engine::add_verified(self, s)?;
        Ok(events)
    }

    fn add_local(&mut self, s: LocalStart) -> Result<Vec<GenEvent>, EngineError> {
        Engine::add_local(self, s)?;
        Ok(Vec::new())
    }

    fn step(&mut self) -> Result<Vec<GenEvent>, EngineError> {
        Engine::step(self)
    }

    fn abort(&mut self, req: RequestId) {
        // Releasing a live sequence's leases cannot fail; if it did, its pages stay leased
        // (never reused) and the pool's statistics show them.
        if let Err(e) = Engine::abort(self, req) {
            tracing::error!(request = req.0, error = %e, "aborting a sequence");
        }
    }

    fn active(&self) -> usize {
        Engine::active(self)
    }

    fn keep_finished(&mut self) {
        Engine::keep_finished(self);
    }

    fn take_retired(&mut self) -> Vec<Retired> {
        Engine::take_retired(self)
    }

    fn lend_computed(&mut self, req: RequestId, f: &mut dyn FnMut(&mut KvPool, &mut SequenceKv)) -> bool {
        Engine::lend_computed(self, req, f)
    }
}

/// A prefill worker's compute: the model's paged forward pass over the worker's own pool,
/// and the first token picked from the last position's logits as the request's sampling
/// says (penalties, bias and grammar included), with its log-probabilities.
#[derive(Clone)]
pub struct Prefiller {
    model: Arc<Llama>,
    vocab: Arc<Vocabulary>,
}

impl Prefiller {
    /// The compute of `model`, picking tokens over `tokenizer`'s vocabulary.
    pub fn new(model: Arc<Llama>, tokenizer: Arc<Tokenizer>) -> Self {
        Prefiller { model, vocab: Arc::new(Vocabulary::new(tokenizer)) }
    }
}

impl PrefillCompute for Prefiller {
    type Error = EngineError;

    /// One forward pass over every chunk (each weight read once for all of them), then the
    /// first token of each prompt that ended.
    fn compute(&mut self, pool: &mut KvPool, chunks: &mut [Chunk<'_>]) -> Result<Vec<Option<First>>, EngineError> {
        let mut inputs: Vec<SeqInput<'_>> = chunks
            .iter_mut()
            .map(|c| SeqInput { kv: &mut *c.seq, tokens: &c.tokens[c.from..c.to], logit_rows: usize::from(c.to == c.tokens.len()) })
            .collect();
        let logits = self.model.forward(pool, &mut inputs)?;
        drop(inputs);
        let vocab = self.model.config.vocab;
        let mut rows = logits.chunks_exact(vocab);
        chunks
            .iter()
            .map(|c| {
                if c.to != c.tokens.len() {
                    return Ok(None);
                }
                let logits = rows.next().ok_or(EngineError::MissingLogits)?;
                // The prompt ends with the tokens a retracted request already generated:
                // the chooser follows them as if it had picked them (draws, penalties,
                // grammar).
                let generated = (c.first.skip_draws as usize).min(c.tokens.len());
                let (prompt, earlier) = c.tokens.split_at(c.tokens.len() - generated);
                let mut chooser = self.vocab.chooser(c.first.sampling.clone(), prompt)?;
                for &t in earlier {
                    chooser.replay(t)?;
                }
                let choice = chooser.choose(logits)?;
                Ok(Some((choice.token, choice.logprobs)))
            })
            .collect()
    }
}
