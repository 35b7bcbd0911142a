//! Continuous batching over one model and one KV pool.
//!
//! Admission reserves every page a request can ever need (prompt + `max_tokens`) at once, all
//! or nothing, so a running sequence can never stall for memory and nothing is preempted.
//! Each [`Engine::step`] runs one forward call over every active sequence: decode sequences
//! feed their last sampled token, sequences still prefilling feed a chunk of their prompt
//! (bounded by `prefill_chunk` tokens per step in total), and new requests join between
//! steps. Finished or aborted sequences leave and release their pages in the same step.

use std::sync::Arc;

use bulkhead_kv::{KvError, KvPool, RequestId, SequenceKv};
use bulkhead_model::{Llama, ModelError, SeqInput};
use bulkhead_tokenizer::Tokenizer;

use crate::detok::Utf8Stream;
use crate::sampling::{Sampler, SamplingError, SamplingParams};
use crate::stop::StopMatcher;

/// What one generation asks for.
#[derive(Debug, Clone)]
pub struct GenRequest {
    /// Prompt token ids (chat template already applied).
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Stop strings: generation ends before the first one, which is not returned.
    pub stop: Vec<String>,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// End-of-generation token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Aborted by the caller.
    Abort,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Something a step produced for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A token was sampled; `text` is what may be shown now (possibly empty while a UTF-8
    /// character or a possible stop string is incomplete).
    Token { id: RequestId, token: u32, text: String },
    /// The request ended; `text` is any text released at the end.
    Finished { id: RequestId, reason: FinishReason, text: String, prompt_tokens: usize, completion_tokens: usize },
    /// The request failed a KV read check (a stale lease, the poison canary or the
    /// auditor) and was removed before its step ran; its pages are given back.
    Failed { id: RequestId, error: KvError },
}

/// Why a request was not admitted or a step failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("prompt is empty")]
    EmptyPrompt,
    #[error(
        "this request needs {needed} tokens of context (prompt {prompt} + max_tokens {max_tokens}), the limit is {limit}"
    )]
    ContextLength { needed: usize, prompt: usize, max_tokens: usize, limit: usize },
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("KV pool has too few free pages for this request: {0}")]
    PoolFull(KvError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Kv(#[from] KvError),
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
    /// An engine over `pool`; each step feeds at most `prefill_chunk` prompt tokens (at
    /// least one sequence always makes progress). Requests longer than `context_limit`
    /// tokens (prompt + max_tokens) are refused.
    pub fn new(model: Arc<Llama>, tokenizer: Arc<Tokenizer>, pool: KvPool, prefill_chunk: usize, context_limit: usize) -> Self {
        let context_limit = context_limit.min(model.config.context_length);
        Engine { model, tokenizer, pool, seqs: Vec::new(), next_id: 1, prefill_chunk: prefill_chunk.max(1), context_limit }
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

    /// Admit a request: check it, reserve all its pages, queue it for the next step.
    pub fn add(&mut self, req: GenRequest) -> Result<RequestId, EngineError> {
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if req.max_tokens == 0 {
            return Err(EngineError::ZeroMaxTokens);
        }
        let needed = req.prompt.len().saturating_add(req.max_tokens);
        if needed > self.context_limit {
            return Err(EngineError::ContextLength {
                needed,
                prompt: req.prompt.len(),
                max_tokens: req.max_tokens,
                limit: self.context_limit,
            });
        }
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
        events.push(Event::Token { id: s.id, token: tok, text: out.emit });
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
        sampling: SamplingParams,
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
            kv.release(&mut self.pool)?;
            return Err(EngineError::ZeroMaxTokens);
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
        let (id, prompt_tokens, completion_tokens) = (s.id, s.prompt_len, s.generated);
        s.kv.release(&mut self.pool)?;
        events.push(Event::Finished { id, reason, text, prompt_tokens, completion_tokens });
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
                    if let Err(e) = s.kv.release(&mut self.pool) {
                        // Its leases are stale: recover whatever is still leased to it.
                        tracing::error!(request = owner.0, error = %e, "releasing a failed sequence");
                        for q in self.pool.revoke_owner(owner) {
                            self.pool.release_quarantined(q)?;
                        }
                    }
                    failed.push(Event::Failed { id: owner, error: source });
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
