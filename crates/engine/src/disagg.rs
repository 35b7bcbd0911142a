//! The engine behind the protocol's driver core ([`bulkhead_protocol::driver`]): the decode
//! loop of a decode worker ([`Engine`] as a [`DecodeEngine`]) and the prompt compute of a
//! prefill worker ([`Prefiller`]). The server's workers and the fault schedules on the real
//! model use these same two adapters.

use std::sync::Arc;

use bulkhead_kv::{KvPool, RequestId, SequenceKv};
use bulkhead_model::{Llama, SeqInput};
use bulkhead_protocol::decode::DecodeStart;
use bulkhead_protocol::driver::decode::{DecodeEngine, GenEvent};
use bulkhead_protocol::driver::prefill::{FirstToken, PrefillCompute};
use bulkhead_protocol::TokenLogprobs;
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

    fn compute(&mut self, pool: &mut KvPool, seq: &mut SequenceKv, tokens: &[u32], from: usize, to: usize, first: FirstToken<'_>) -> Result<Option<(u32, Option<TokenLogprobs>)>, EngineError> {
        let last = to == tokens.len();
        let logits = self.model.forward(pool, &mut [SeqInput { kv: seq, tokens: &tokens[from..to], want_logits: last }])?;
        if !last {
            return Ok(None);
        }
        // The prompt ends with the tokens a retracted request already generated: the
        // chooser follows them as if it had picked them (draws, penalties, grammar).
        let generated = (first.skip_draws as usize).min(tokens.len());
        let (prompt, earlier) = tokens.split_at(tokens.len() - generated);
        let mut chooser = self.vocab.chooser(first.sampling.clone(), prompt)?;
        for &t in earlier {
            chooser.replay(t)?;
        }
        let c = chooser.choose(&logits)?;
        Ok(Some((c.token, c.logprobs)))
    }
}
