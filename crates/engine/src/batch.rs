//! Continuous batching over one model and one KV pool.
//!
//! Admission reserves every page a request can ever need (prompt + `max_tokens`) at once, all
//! or nothing, so a running sequence can never stall for memory and nothing is preempted.
//! Each [`Engine::step`] runs one forward call over every active sequence: decode sequences
//! feed their last sampled token, sequences still prefilling feed a chunk of their prompt
//! (bounded by `prefill_chunk` tokens per step in total), and new requests join between
//! steps. Finished or aborted sequences leave and release their pages in the same step.

use std::sync::Arc;

use bulkhead_kv::{KvError, KvPool, RequestId, SequenceKv, Unreleased};
use bulkhead_model::{Llama, ModelError, SeqInput};
use bulkhead_protocol::admission::{admit, Generate, Refusal};
use bulkhead_protocol::driver::decode::GenEvent;
use bulkhead_protocol::{FinishReason, Sampling};
use bulkhead_tokenizer::Tokenizer;

use crate::detok::Utf8Stream;
use crate::sampling::{Sampler, SamplingError};
use crate::stop::StopMatcher;

/// What one step produced for one request: the protocol's [`GenEvent`], so the engine's
/// events travel to the gateway unchanged.
pub type Event = GenEvent;

/// Prompt tokens a step feeds when nothing else is said: enough to keep both cores busy
/// on a chunk of a long prompt, few enough that decode steps are not held up for long.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// How an [`Engine`] batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Most prompt tokens fed per step, over all prefilling sequences (at least one
    /// sequence always makes progress). Irrelevant where every sequence arrives prefilled.
    pub prefill_chunk: usize,
    /// Longest request admitted (prompt + `max_tokens`); capped at the model's context.
    pub context_limit: usize,
}

impl EngineConfig {
    /// The default chunk, and requests up to `context_limit` tokens.
    pub fn for_context(context_limit: usize) -> Self {
        EngineConfig { prefill_chunk: DEFAULT_PREFILL_CHUNK, context_limit }
    }
}

/// What one generation asks for.
#[derive(Debug, Clone)]
pub struct GenRequest {
    /// Prompt token ids (chat template already applied).
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling settings.
    pub sampling: Sampling,
    /// Stop strings: generation ends before the first one, which is not returned.
    pub stop: Vec<String>,
}

/// Why a request was not admitted or a step failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error("a verified sequence of {prompt} prompt tokens has room for {reserved} tokens, not {max_tokens} more")]
    NoRoom { prompt: usize, max_tokens: usize, reserved: usize },
    #[error("KV pool has too few free pages for this request: {0}")]
    PoolFull(KvError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("pages could not be given back: {0}")]
    Unreleased(#[from] Unreleased),
}

struct Seq {
    id: RequestId,
    kv: SequenceKv,
    /// Prompt tokens still to prefill here (empty for a verified, prefilled sequence).
    prompt: Vec<u32>,
    prompt_len: usize,
    /// Token sampled last step, not yet fed (None while prefilling).
    next: Option<u32>,
    generated: usize,
    max_tokens: usize,
    sampler: Sampler,
    utf8: Utf8Stream,
    stop: StopMatcher,
}

/// Batches requests over one model and pool.
pub struct Engine {
    model: Arc<Llama>,
    tokenizer: Arc<Tokenizer>,
    pool: KvPool,
    seqs: Vec<Seq>,
    next_id: u64,
    prefill_chunk: usize,
    context_limit: usize,
}

impl Engine {
    /// An engine over `pool`, batching as `cfg` says.
    pub fn new(model: Arc<Llama>, tokenizer: Arc<Tokenizer>, pool: KvPool, cfg: EngineConfig) -> Self {
        let context_limit = cfg.context_limit.min(model.config.context_length);
        Engine { model, tokenizer, pool, seqs: Vec::new(), next_id: 1, prefill_chunk: cfg.prefill_chunk.max(1), context_limit }
    }

    /// The pool, for statistics.
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Requests admitted and not finished.
    pub fn active(&self) -> usize {
        self.seqs.len()
    }

    /// Admit a request: check it ([`admit`], the decision every role shares), reserve all
    /// its pages, queue it for the next step.
    pub fn add(&mut self, req: GenRequest) -> Result<RequestId, EngineError> {
        let needed = admit(req.prompt.len(), Generate::Tokens(req.max_tokens), self.context_limit)?;
        let sampler = Sampler::new(req.sampling)?;
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let mut kv = SequenceKv::new(id);
        kv.reserve(&mut self.pool, needed).map_err(EngineError::PoolFull)?;
        self.seqs.push(Seq {
            id,
            kv,
            prompt_len: req.prompt.len(),
            prompt: req.prompt,
            next: None,
            generated: 0,
            max_tokens: req.max_tokens,
            sampler,
            utf8: Utf8Stream::new(),
            stop: StopMatcher::new(req.stop),
        });
        Ok(id)
    }

    /// End a request now and give its pages back. Returns false if it was not active.
    pub fn abort(&mut self, id: RequestId) -> Result<bool, EngineError> {
        let Some(i) = self.seqs.iter().position(|s| s.id == id) else { return Ok(false) };
        let s = self.seqs.swap_remove(i);
        s.kv.release(&mut self.pool)?;
        Ok(true)
    }

    /// Take the first token of `i` (sampled here or by a prefill worker): emit its text, and
    /// return why the sequence ends if it does.
    fn on_token(&mut self, i: usize, tok: u32, events: &mut Vec<Event>) -> Option<(FinishReason, String)> {
        let s = &mut self.seqs[i];
        s.generated += 1;
        let eog = self.tokenizer.is_eog(tok);
        if eog && !s.sampler.params().ignore_eos {
            let mut text = s.stop.push(&s.utf8.finish()).emit;
            text.push_str(&s.stop.finish());
            return Some((FinishReason::Stop, text));
        }
        // Under ignore_eos an end-of-generation token counts but, being special, shows no text.
        let bytes = if eog { &[][..] } else { self.tokenizer.token_bytes(tok).unwrap_or(&[]) };
        let piece = s.utf8.push(bytes);
        let out = s.stop.push(&piece);
        events.push(Event::Token { req: s.id, token: tok, text: out.emit });
        if out.stopped {
            Some((FinishReason::Stop, String::new()))
        } else if s.generated >= s.max_tokens {
            let mut text = s.stop.push(&s.utf8.finish()).emit;
            text.push_str(&s.stop.finish());
            Some((FinishReason::Length, text))
        } else {
            s.next = Some(tok);
            None
        }
    }

    /// Admit a request whose prompt KV arrived from a prefill worker and was verified, with
    /// the first token that worker sampled. Returns the events of that first token (its
    /// text, and `Finished` if it already ends the request).
    pub fn add_verified(
        &mut self,
        seq: bulkhead_kv::VerifiedSequence,
        first_token: u32,
        max_tokens: usize,
        sampling: Sampling,
        stop: Vec<String>,
    ) -> Result<(RequestId, Vec<Event>), EngineError> {
        let prompt_tokens = seq.prompt_tokens();
        let mut sampler = match Sampler::new(sampling) {
            Ok(s) => s,
            Err(e) => {
                seq.into_sequence().release(&mut self.pool)?;
                return Err(e.into());
            }
        };
        sampler.skip_draw();
        let kv = seq.into_sequence();
        let id = kv.owner();
        if max_tokens == 0 || prompt_tokens + max_tokens > kv.reserved_tokens() {
            let reserved = kv.reserved_tokens();
            kv.release(&mut self.pool)?;
            return Err(EngineError::NoRoom { prompt: prompt_tokens, max_tokens, reserved });
        }
        self.seqs.push(Seq {
            id,
            kv,
            prompt: Vec::new(),
            prompt_len: prompt_tokens,
            next: None,
            generated: 0,
            max_tokens,
            sampler,
            utf8: Utf8Stream::new(),
            stop: StopMatcher::new(stop),
        });
        let i = self.seqs.len() - 1;
        let mut events = Vec::new();
        if let Some((reason, text)) = self.on_token(i, first_token, &mut events) {
            self.finish(i, reason, text, &mut events)?;
        }
        Ok((id, events))
    }

    fn finish(&mut self, i: usize, reason: FinishReason, text: String, events: &mut Vec<Event>) -> Result<(), EngineError> {
        let s = self.seqs.swap_remove(i);
        let (req, prompt_tokens, completion_tokens) = (s.id, s.prompt_len as u32, s.generated as u32);
        s.kv.release(&mut self.pool)?;
        events.push(Event::Finished { req, finish: reason, text, prompt_tokens, completion_tokens });
        Ok(())
    }

    /// The pool, for the protocol state machine that reserves and fills pages in it.
    pub fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }

    /// Run one forward call over all active sequences and return what it produced. A
    /// sequence that fails a KV read check is failed alone (nothing of the step was computed
    /// yet) and the step runs without it.
    pub fn step(&mut self) -> Result<Vec<Event>, EngineError> {
        let mut failed = Vec::new();
        loop {
            match self.step_once() {
                Err(EngineError::Model(ModelError::ReadCheck { seq, source })) => {
                    let s = self.seqs.swap_remove(seq);
                    let pages: Vec<u32> = s.kv.leases().iter().map(|l| l.page().0).collect();
                    tracing::error!(request = s.id.0, ?pages, error = %source, "KV read check failed; request failed");
                    let owner = s.id;
                    if let Err(u) = s.kv.release(&mut self.pool) {
                        // Its leases are stale: recover whatever is still leased to it.
                        tracing::error!(request = owner.0, error = %u, "releasing a failed sequence");
                        u.reclaim(&mut self.pool);
                    }
                    failed.push(Event::Failed { req: owner, error: source });
                }
                Ok(mut events) => {
                    failed.append(&mut events);
                    return Ok(failed);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One forward call; inputs are in `self.seqs` order, so a `ReadCheck` error's index is a
    /// `self.seqs` index.
    fn step_once(&mut self) -> Result<Vec<Event>, EngineError> {
        if self.seqs.is_empty() {
            return Ok(Vec::new());
        }
        let mut budget = self.prefill_chunk;
        let mut feeds: Vec<(usize, Vec<u32>, bool)> = Vec::new();
        for (i, s) in self.seqs.iter().enumerate() {
            if let Some(t) = s.next {
                feeds.push((i, vec![t], true));
            } else {
                let done = s.kv.len();
                let n = (s.prompt.len().saturating_sub(done)).min(budget);
                if n == 0 {
                    continue;
                }
                budget -= n;
                feeds.push((i, s.prompt[done..done + n].to_vec(), done + n == s.prompt.len()));
            }
        }
        let logits = {
            let mut inputs: Vec<SeqInput<'_>> = Vec::with_capacity(feeds.len());
            let mut it = feeds.iter().peekable();
            for (i, s) in self.seqs.iter_mut().enumerate() {
                if let Some((_, toks, want)) = it.next_if(|f| f.0 == i) {
                    inputs.push(SeqInput { kv: &mut s.kv, tokens: toks, want_logits: *want });
                }
            }
            match self.model.forward(&mut self.pool, &mut inputs) {
                Ok(logits) => logits,
                // The forward call numbers only the fed sequences.
                Err(ModelError::ReadCheck { seq, source }) => {
                    return Err(ModelError::ReadCheck { seq: feeds[seq].0, source }.into());
                }
                Err(e) => return Err(e.into()),
            }
        };
        let vocab = self.model.config.vocab;
        let mut events = Vec::new();
        let mut finished = Vec::new();
        let mut rows = logits.chunks_exact(vocab);
        for (i, _, want) in &feeds {
            if !want {
                continue;
            }
            let Some(l) = rows.next() else { break };
            let tok = self.seqs[*i].sampler.sample(l)?;
            if let Some((reason, text)) = self.on_token(*i, tok, &mut events) {
                finished.push((*i, reason, text));
            }
        }
        // Remove from the back so indices stay valid.
        finished.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, reason, text) in finished {
            self.finish(i, reason, text, &mut events)?;
        }
        Ok(events)
    }
}
