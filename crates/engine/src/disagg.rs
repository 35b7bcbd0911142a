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

use crate::batch::{Engine, EngineError};
use crate::sampling::Sampler;

impl DecodeEngine for Engine {
    type Error = EngineError;

    fn pool_mut(&mut self) -> &mut KvPool {
        Engine::pool_mut(self)
    }

    fn add_verified(&mut self, s: DecodeStart) -> Result<Vec<GenEvent>, EngineError> {
        let (_, events) = Engine::add_verified(self, s.seq, s.first_token, s.max_tokens as usize, s.sampling, s.stop, &s.resume)?;
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
/// and the first token sampled from the last position's logits.
#[derive(Clone)]
pub struct Prefiller(pub Arc<Llama>);

impl PrefillCompute for Prefiller {
    type Error = EngineError;

    fn compute(&mut self, pool: &mut KvPool, seq: &mut SequenceKv, tokens: &[u32], from: usize, to: usize, first: FirstToken<'_>) -> Result<Option<u32>, EngineError> {
        let last = to == tokens.len();
        let logits = self.0.forward(pool, &mut [SeqInput { kv: seq, tokens: &tokens[from..to], want_logits: last }])?;
        if !last {
            return Ok(None);
        }
        let mut sampler = Sampler::new(first.sampling.clone())?;
        for _ in 0..first.skip_draws {
            sampler.skip_draw();
        }
        Ok(Some(sampler.sample(&logits)?))
    }
}
