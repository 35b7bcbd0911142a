//! Continuous batching over one model and one KV pool, with KV on demand.
//!
//! A sequence holds pages for what it has computed and grows page by page as it generates
//! (admission reserves the prompt; a verified sequence arrives with its prompt and a first
//! page of output). When the pool cannot grow a decoding sequence, the newest sequence is
//! retracted: its pages go back through the pool's release path (each page gets a new
//! generation, so nothing of the retracted sequence can be read through them again). A
//! request admitted here ([`Engine::add`]) is then recomputed here, over its prompt and
//! what it generated, when pages are free; one that arrived verified from a prefill
//! worker ([`Engine::add_verified`]) leaves the loop with [`Event::Retracted`] and its
//! generated tokens, for the gateway to queue again. Either way the client sees one
//! uninterrupted answer: the detokeniser, the stop matcher and the sampler carry on where
//! they were, and the forward pass is row-deterministic, so greedy output does not change.
//!
//! Each [`Engine::step`] runs one forward call over every active sequence: decode sequences
//! feed their last sampled token, sequences still prefilling feed a chunk of their prompt
//! (bounded by `prefill_chunk` tokens per step in total, and by the free pages: a chunk
//! that does not fit waits), and new requests join between steps. Finished or aborted
//! sequences leave and release their pages in the same step.

use std::sync::Arc;
use std::time::Instant;

use bulkhead_kv::{KvError, KvPool, RequestId, SequenceKv, Unreleased};
use bulkhead_model::{Llama, ModelError, SeqInput};
use bulkhead_protocol::admission::{Generate, Refusal, admit};
use bulkhead_protocol::decode::{DecodeStart, LocalStart, Retired};
use bulkhead_protocol::driver::decode::{GenEvent, Growing, Verification, make_room};
use bulkhead_protocol::{FinishReason, Sampling, TokenLogprobs};
use bulkhead_tokenizer::{TokenType, Tokenizer};

use crate::choose::{ChooseError, Chooser, Vocabulary};
use crate::detok::Utf8Stream;
use crate::draft::{DraftModel, Want};
use crate::sampling::SamplingError;
use crate::speculate::{self, Luck, MAX_SPECULATIVE_BATCH, SpecCounters, Speculation, StepCost};
use crate::stop::StopMatcher;

/// What one step produced for one request: the protocol's [`GenEvent`], so the engine's
/// events travel to the gateway unchanged.
pub type Event = GenEvent;

/// Prompt tokens a step feeds when nothing else is said: enough to keep both cores busy
/// on a chunk of a long prompt, few enough that decode steps are not held up for long.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// How a sequence of a step ended: its finish reason and text, or the grammar's refusal.
type SequenceEnd = Result<(FinishReason, String), ChooseError>;

/// How an [`Engine`] batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Most prompt tokens fed per step, over all prefilling sequences (at least one
    /// sequence always makes progress). Irrelevant where every sequence arrives prefilled.
    pub prefill_chunk: usize,
    /// Longest request admitted (prompt + `max_tokens`); capped at the model's context.
    pub context_limit: usize,
    /// Whether decoding sequences feed drafted tokens to verify beside their last one.
    pub speculation: Speculation,
}

impl EngineConfig {
    /// The default chunk, and requests up to `context_limit` tokens, without speculation.
    pub fn for_context(context_limit: usize) -> Self {
        EngineConfig { prefill_chunk: DEFAULT_PREFILL_CHUNK, context_limit, speculation: Speculation::Off }
    }
}

/// What one sequence feeds a step.
struct Feed {
    /// Index in the loop's sequences.
    seq: usize,
    /// Tokens, at the sequence's next positions: a prompt chunk, or the last sampled token
    /// and any drafts after it.
    tokens: Vec<u32>,
    /// Logit rows wanted: the last `rows` of `tokens` (a decode step's `1 + drafts`, a
    /// prompt's last chunk 1, other chunks 0).
    rows: usize,
    /// Drafted tokens (the last of `tokens`), verified against the rows.
    drafts: usize,
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
    #[error("{resumed} resumed tokens in a verified prompt of {prompt}")]
    BadResume { prompt: usize, resumed: usize },
    #[error("KV pool has too few free pages for this request: {0}")]
    PoolFull(KvError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Choose(#[from] ChooseError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("pages could not be given back: {0}")]
    Unreleased(#[from] Unreleased),
    /// A bug: the forward pass returned fewer logit rows than sequences asked for.
    #[error("the model returned no logits for a sequence that asked for them")]
    MissingLogits,
}

struct Seq {
    id: RequestId,
    /// Admission order: the newest sequence is retracted first.
    order: u64,
    kv: SequenceKv,
    /// Tokens whose KV this sequence holds or must compute, in position order; positions
    /// `kv.len()..` are still to prefill here (none for a verified sequence; the rest past
    /// its shared prefix for one computed here, [`Engine::add_local`]).
    feed: Vec<u32>,
    /// The prompt, for a request admitted here: after a retraction it is recomputed over
    /// this and `history`. `None` for a request of the gateway's (verified, or computed
    /// here from a shared prefix): retracted, it goes back to the gateway.
    prompt: Option<Vec<u32>>,
    /// Prompt tokens the client sent (what `usage` reports).
    prompt_len: usize,
    /// Every token generated, in order (the last one not yet fed while decoding).
    history: Vec<u32>,
    /// Token sampled last step, not yet fed (None while prefilling).
    next: Option<u32>,
    /// Most tokens to generate, in all.
    max_tokens: usize,
    /// The client's prompt (when the loop was given it), then every generated token: where
    /// proposals are looked up.
    context: Vec<u32>,
    /// Recent acceptance of this sequence's proposals.
    luck: Luck,
    chooser: Chooser,
    utf8: Utf8Stream,
    stop: StopMatcher,
}

impl Growing for Seq {
    fn kv(&mut self) -> &mut SequenceKv {
        &mut self.kv
    }
    fn kv_ref(&self) -> &SequenceKv {
        &self.kv
    }
    fn decoding(&self) -> bool {
        self.next.is_some()
    }
    fn order(&self) -> u64 {
        self.order
    }
}

/// Batches requests over one model and pool.
pub struct Engine {
    model: Arc<Llama>,
    tokenizer: Arc<Tokenizer>,
    vocab: Arc<Vocabulary>,
    pool: KvPool,
    seqs: Vec<Seq>,
    next_id: u64,
    next_order: u64,
    prefill_chunk: usize,
    context_limit: usize,
    retractions: u64,
    /// The last step's logits; its memory serves the next step.
    logits: Vec<f32>,
    /// Keep finished sequences for the decode-side cache ([`Engine::keep_finished`]).
    keep_finished: bool,
    retired: Vec<Retired>,
    speculation: Speculation,
    spec: Arc<SpecCounters>,
    /// What drafted rows cost, from the steps so far.
    step_cost: StepCost,
    /// Proposal buffer, reused.
    drafts: Vec<u32>,
    /// The draft model of [`Speculation::Draft`].
    drafter: Option<DraftModel>,
    /// The fewest tokens a sequence emitted in the last step that emitted any.
    step_tokens: usize,
}

impl Engine {
    /// An engine over `pool`, batching as `cfg` says.
    pub fn new(model: Arc<Llama>, tokenizer: Arc<Tokenizer>, pool: KvPool, cfg: EngineConfig) -> Self {
        // A sequence must fit the pool alone: KV on demand retracts others to let it grow,
        // but one larger than the pool would retract itself for ever.
        let context_limit = cfg.context_limit.min(model.config.context_length).min(pool.capacity_tokens());
        model.reserve_attention(context_limit, pool.layout().page_size);
        Engine {
            model,
            vocab: Arc::new(Vocabulary::new(Arc::clone(&tokenizer))),
            tokenizer,
            pool,
            seqs: Vec::new(),
            next_id: 1,
            next_order: 0,
            logits: Vec::new(),
            prefill_chunk: cfg.prefill_chunk.max(1),
            context_limit,
            retractions: 0,
            keep_finished: false,
            retired: Vec::new(),
            speculation: cfg.speculation,
            spec: Arc::default(),
            step_cost: StepCost::default(),
            drafts: Vec::new(),
            drafter: None,
            step_tokens: 1,
        }
    }

    /// Draft with `draft` ([`Speculation::Draft`]); until it is given, nothing is drafted.
    pub fn set_draft_model(&mut self, draft: DraftModel) {
        self.drafter = Some(draft);
    }

    /// The draft model, if any.
    pub fn draft_model(&self) -> Option<&DraftModel> {
        self.drafter.as_ref()
    }

    /// What speculation did so far (shared: a worker pushes it as metrics).
    pub fn spec_counters(&self) -> Arc<SpecCounters> {
        Arc::clone(&self.spec)
    }

    /// From now on, a request that finishes normally leaves its pages to
    /// [`Engine::take_retired`] (for the decode worker's cache) instead of giving them back.
    pub fn keep_finished(&mut self) {
        self.keep_finished = true;
    }

    /// The sequences kept since the last call, each with every token it generated.
    pub fn take_retired(&mut self) -> Vec<Retired> {
        std::mem::take(&mut self.retired)
    }

    /// Lend `req`'s pages, with the pool, to `f` once its prompt is computed (every position
    /// it feeds written and committed); false while it is not, or not here.
    pub fn lend_computed(&mut self, req: RequestId, f: &mut dyn FnMut(&mut KvPool, &mut SequenceKv)) -> bool {
        let Some(s) = self.seqs.iter_mut().find(|s| s.id == req && s.kv.len() >= s.feed.len()) else { return false };
        f(&mut self.pool, &mut s.kv);
        true
    }

    /// Sequences retracted so far to let others grow.
    pub fn retractions(&self) -> u64 {
        self.retractions
    }

    fn order(&mut self) -> u64 {
        self.next_order += 1;
        self.next_order
    }

    /// The pool, for statistics.
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// The pool, for the protocol state machine that reserves and fills pages in it.
    pub fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The fewest tokens any sequence got from the last step that emitted tokens: 1
    /// without speculation, more where every sequence's drafts were accepted. Whatever paces
    /// the steps for a per-token target may space the next one that many tokens apart.
    pub fn step_tokens(&self) -> usize {
        self.step_tokens
    }

    /// Requests admitted and not finished.
    pub fn active(&self) -> usize {
        self.seqs.len()
    }

    /// Admit a request: check it ([`admit`], the decision every role shares), reserve the
    /// pages of its prompt, queue it for the next step. Its output pages are leased as it
    /// generates.
    pub fn add(&mut self, req: GenRequest) -> Result<RequestId, EngineError> {
        admit(req.prompt.len(), Generate::Tokens(req.max_tokens), self.context_limit)?;
        let chooser = self.vocab.chooser(req.sampling, &req.prompt)?;
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let mut kv = SequenceKv::new(id);
        kv.reserve(&mut self.pool, req.prompt.len()).map_err(EngineError::PoolFull)?;
        let order = self.order();
        self.seqs.push(Seq {
            id,
            order,
            kv,
            feed: req.prompt.clone(),
            prompt_len: req.prompt.len(),
            context: req.prompt.clone(),
            prompt: Some(req.prompt),
            history: Vec::new(),
            next: None,
            max_tokens: req.max_tokens,
            luck: Luck::default(),
            chooser,
            utf8: Utf8Stream::new(),
            stop: StopMatcher::new(req.stop),
        });
        Ok(id)
    }

    /// End a request now and give its pages back. Returns false if it was not active.
    pub fn abort(&mut self, id: RequestId) -> Result<bool, EngineError> {
        let Some(i) = self.seqs.iter().position(|s| s.id == id) else { return Ok(false) };
        let s = self.seqs.swap_remove(i);
        self.give_back(s.kv);
        self.forget_drafts();
        Ok(true)
    }

    /// The draft model gives back the KV of sequences that left the loop.
    fn forget_drafts(&mut self) {
        let seqs = &self.seqs;
        if let Some(d) = &mut self.drafter {
            d.retain(|id| seqs.iter().any(|s| s.id == id));
        }
    }

    /// A sequence's pages go back to the pool; stale ones (a bug) are reclaimed all the same.
    fn give_back(&mut self, kv: SequenceKv) {
        if let Err(u) = kv.release(&mut self.pool) {
            tracing::error!(request = u.seq.owner().0, error = %u, "releasing a sequence");
            u.reclaim(&mut self.pool);
        }
    }

    /// Whether `tok` shows no text: an end-of-generation token, or a special (control)
    /// token unless the request asked to see them.
    fn hidden(&self, s: &Seq, tok: u32) -> bool {
        self.tokenizer.is_eog(tok) || (s.chooser.params().skip_special_tokens && self.tokenizer.token_type(tok) == Some(TokenType::Control))
    }

    /// Take the next token of `i` (sampled here or by a prefill worker), with its
    /// log-probabilities if asked for: emit its text, and return why the sequence ends if
    /// it does.
    fn on_token(&mut self, i: usize, tok: u32, logprobs: Option<TokenLogprobs>, events: &mut Vec<Event>) -> Option<(FinishReason, String)> {
        let hidden = self.hidden(&self.seqs[i], tok);
        let s = &mut self.seqs[i];
        s.history.push(tok);
        s.context.push(tok);
        let ends = (self.tokenizer.is_eog(tok) && !s.chooser.params().ignore_eos) || s.chooser.is_stop_token(tok);
        // An end token shows no text but still reports its log-probability.
        let bytes = if hidden || ends { &[][..] } else { self.tokenizer.token_bytes(tok).unwrap_or(&[]) };
        let piece = s.utf8.push(bytes);
        let out = s.stop.push(&piece);
        events.push(Event::Token { req: s.id, token: tok, text: out.emit, logprobs });
        if ends || s.chooser.grammar_done() {
            // A finished grammar ends the answer as an end-of-generation token would.
            let mut text = s.stop.push(&s.utf8.finish()).emit;
            text.push_str(&s.stop.finish());
            Some((FinishReason::Stop, text))
        } else if out.stopped {
            Some((FinishReason::Stop, String::new()))
        } else if s.history.len() >= s.max_tokens {
            let mut text = s.stop.push(&s.utf8.finish()).emit;
            text.push_str(&s.stop.finish());
            Some((FinishReason::Length, text))
        } else {
            s.next = Some(tok);
            None
        }
    }

    /// Admit a request whose prompt KV arrived from a prefill worker and was verified, with
    /// the first token that worker sampled (and its log-probabilities). `resume` holds the
    /// tokens an earlier attempt generated (the client has them; they end the verified
    /// prompt): the detokeniser, the stop matcher and the chooser replay them silently, so
    /// the answer carries on where it was. `prompt` is the prompt's tokens when the
    /// repetition penalty needs them. `max_tokens` counts what is left to generate. Returns
    /// the events of the first token (its text, and `Finished` if it already ends the
    /// request).
    pub fn add_verified(&mut self, start: DecodeStart) -> Result<(RequestId, Vec<Event>), EngineError> {
        let DecodeStart { seq, first_token, first_logprobs, max_tokens, sampling, stop, resume, prompt, .. } = start;
        let max_tokens = max_tokens as usize;
        let verified = seq.prompt_tokens();
        let kv = seq.into_sequence();
        let checked = if resume.len() >= verified {
            Err(EngineError::BadResume { prompt: verified, resumed: resume.len() })
        } else {
            admit(verified, Generate::Tokens(max_tokens), self.context_limit)
                .map_err(EngineError::from)
                .and_then(|_| Ok(self.vocab.chooser(sampling, &prompt)?))
                .and_then(|mut c| {
                    // The picks made so far: the resumed ones and the prefill's.
                    for &t in resume.iter().chain([&first_token]) {
                        c.replay(t)?;
                    }
                    Ok(c)
                })
        };
        let i = self.join(kv, verified - resume.len(), max_tokens + resume.len(), stop, &resume, prompt, checked)?;
        let id = self.seqs[i].id;
        let mut events = Vec::new();
        if let Some((reason, text)) = self.on_token(i, first_token, first_logprobs, &mut events) {
            self.finish(i, reason, text, &mut events);
        }
        Ok((id, events))
    }

    /// Tokens an earlier attempt generated, which the client has: only the state that
    /// follows from them matters (the detokeniser, the stop matcher, the history).
    fn replay_resumed(&self, s: &mut Seq, resume: &[u32]) {
        for &tok in resume {
            let hidden = self.hidden(s, tok);
            let bytes = if hidden { &[][..] } else { self.tokenizer.token_bytes(tok).unwrap_or(&[]) };
            let piece = s.utf8.push(bytes);
            s.stop.push(&piece);
            s.history.push(tok);
            s.context.push(tok);
        }
    }

    /// Admit a request whose prompt this worker holds all but a short rest of (its shared
    /// prefix): the rest is computed here in the next steps, within the prefill budget and
    /// beside the decoding sequences, and its first token sampled from the last position's
    /// logits as a prefill worker would (the chooser follows `resume` first). Retracted
    /// before it is done, it leaves with [`Event::Retracted`] like a verified sequence.
    pub fn add_local(&mut self, start: LocalStart) -> Result<RequestId, EngineError> {
        let LocalStart { seq, tokens, max_tokens, sampling, stop, resume, .. } = start;
        let prompt_tokens = seq.prompt_tokens();
        let kv = seq.into_sequence();
        let checked = if resume.len() >= prompt_tokens || tokens.len() != prompt_tokens {
            Err(EngineError::BadResume { prompt: prompt_tokens, resumed: resume.len() })
        } else {
            admit(prompt_tokens, Generate::Tokens(max_tokens as usize), self.context_limit).map_err(EngineError::from).and_then(|_| {
                let mut c = self.vocab.chooser(sampling, &tokens[..prompt_tokens - resume.len()])?;
                for &t in &resume {
                    c.replay(t)?;
                }
                Ok(c)
            })
        };
        let client_prompt = tokens.get(..prompt_tokens - resume.len()).unwrap_or_default().to_vec();
        let i = self.join(kv, prompt_tokens - resume.len(), max_tokens as usize + resume.len(), stop, &resume, client_prompt, checked)?;
        // The rest past its shared prefix is computed in the next steps.
        self.seqs[i].feed = tokens;
        Ok(self.seqs[i].id)
    }

    /// Join a request of the gateway's to the loop (nothing to feed yet): its pages `kv`,
    /// the client's prompt length, the tokens it may generate in all (resumed ones
    /// included), the client's prompt if known (for proposals; empty otherwise) and its
    /// chooser, or the error that refused it (its pages go back). The resumed tokens are
    /// replayed silently. Returns its index in the loop.
    #[allow(clippy::too_many_arguments)] // one caller each for verified and local starts
    fn join(
        &mut self,
        kv: SequenceKv,
        prompt_len: usize,
        max_tokens: usize,
        stop: Vec<String>,
        resume: &[u32],
        prompt: Vec<u32>,
        chooser: Result<Chooser, EngineError>,
    ) -> Result<usize, EngineError> {
        let chooser = match chooser {
            Ok(c) => c,
            Err(e) => {
                self.give_back(kv);
                return Err(e);
            }
        };
        let order = self.order();
        let mut s = Seq {
            id: kv.owner(),
            order,
            kv,
            feed: Vec::new(),
            prompt: None,
            prompt_len,
            history: Vec::new(),
            next: None,
            max_tokens,
            context: prompt,
            luck: Luck::default(),
            chooser,
            utf8: Utf8Stream::new(),
            stop: StopMatcher::new(stop),
        };
        self.replay_resumed(&mut s, resume);
        self.seqs.push(s);
        Ok(self.seqs.len() - 1)
    }

    fn finish(&mut self, i: usize, reason: FinishReason, text: String, events: &mut Vec<Event>) {
        let s = self.seqs.swap_remove(i);
        let (req, prompt_tokens, completion_tokens) = (s.id, s.prompt_len as u32, s.history.len() as u32);
        // Only a verified sequence's positions follow the client's prompt and `history`.
        if self.keep_finished && s.prompt.is_none() {
            self.retired.push(Retired { seq: s.kv, generated: s.history });
        } else {
            self.give_back(s.kv);
        }
        events.push(Event::Finished { req, finish: reason, text, prompt_tokens, completion_tokens });
    }

    /// KV on demand ([`make_room`]): grow every decoding sequence by the page its next
    /// token needs, retracting the newest when the pool is out. A retracted sequence
    /// admitted here starts over from its prompt and what it generated; a verified one
    /// leaves with [`Event::Retracted`].
    fn make_room(&mut self, events: &mut Vec<Event>) -> Result<(), EngineError> {
        for mut s in make_room(&mut self.pool, &mut self.seqs)? {
            self.retractions += 1;
            tracing::info!(request = s.id.0, generated = s.history.len(), "retracted a sequence to let others grow");
            match &s.prompt {
                Some(prompt) => {
                    s.feed = prompt.iter().chain(&s.history).copied().collect();
                    s.next = None;
                    self.seqs.push(s);
                }
                None => events.push(Event::Retracted { req: s.id, tokens: s.history }),
            }
        }
        Ok(())
    }

    /// Run one forward call over all active sequences and return what it produced. A
    /// sequence that fails a KV read check is failed alone (nothing of the step was computed
    /// yet) and the step runs without it.
    pub fn step(&mut self) -> Result<Vec<Event>, EngineError> {
        let mut events = Vec::new();
        self.make_room(&mut events)?;
        loop {
            match self.step_once() {
                Err(EngineError::Model(ModelError::ReadCheck { seq, source })) => {
                    let s = self.seqs.swap_remove(seq);
                    let pages: Vec<u32> = s.kv.pages().iter().map(|l| l.page().0).collect();
                    tracing::error!(request = s.id.0, ?pages, error = %source, "KV read check failed; request failed");
                    let owner = s.id;
                    self.give_back(s.kv);
                    events.push(Event::Failed { req: owner, detail: format!("KV read check failed: {source}") });
                }
                Ok(mut more) => {
                    events.append(&mut more);
                    self.forget_drafts();
                    return Ok(events);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// What each sequence feeds this step. A decoding sequence feeds its last token
    /// (`make_room` gave it a slot, or it waits) and, when speculating, drafts after it in
    /// positions it already holds or can lease without crowding the others; a prefilling
    /// one a chunk within the step's budget whose pages it can lease now.
    fn feeds(&mut self) -> Vec<Feed> {
        let mut budget = self.prefill_chunk;
        let mut feeds = Vec::new();
        let decoding = self.seqs.iter().filter(|s| s.next.is_some()).count();
        let proposals = self.proposals(decoding);
        for (i, s) in self.seqs.iter_mut().enumerate() {
            if let Some(t) = s.next {
                let len = s.kv.len();
                if s.kv.reserved_tokens() <= len {
                    continue;
                }
                let drafts = proposals.get(i).map_or(&[][..], Vec::as_slice);
                // A draft's page is leased only while every decoding sequence could still
                // grow by one: speculation never causes a retraction.
                let want = len + 1 + drafts.len();
                if want > s.kv.reserved_tokens() && self.pool.stats().free_pages > decoding {
                    let _ = s.kv.reserve(&mut self.pool, want);
                }
                let drafts = &drafts[..drafts.len().min(s.kv.reserved_tokens() - len - 1)];
                let tokens: Vec<u32> = std::iter::once(t).chain(drafts.iter().copied()).collect();
                feeds.push(Feed { seq: i, rows: tokens.len(), drafts: tokens.len() - 1, tokens });
                continue;
            }
            let done = s.kv.len();
            let n = s.feed.len().saturating_sub(done).min(budget);
            if n == 0 || s.kv.reserve(&mut self.pool, done + n).is_err() {
                continue;
            }
            budget -= n;
            let last = done + n == s.feed.len();
            feeds.push(Feed { seq: i, tokens: s.feed[done..done + n].to_vec(), rows: usize::from(last), drafts: 0 });
        }
        feeds
    }

    /// Each sequence's drafts for this step (by index in the loop; none, or an empty list,
    /// where it drafts nothing): as
    /// many as pay for it given its luck and what a drafted row costs, from its own tokens
    /// (n-gram) or the draft model.
    fn proposals(&mut self, decoding: usize) -> Vec<Vec<u32>> {
        // Counted with those still prefilling, which decode from the next steps on: a few
        // drafting ahead while a batch fills would leave it out of step once it is full.
        let k = if self.seqs.len() <= MAX_SPECULATIVE_BATCH { self.speculation.tokens() } else { 0 };
        if k == 0 {
            return Vec::new();
        }
        let mut out = vec![Vec::new(); self.seqs.len()];
        let cost = &self.step_cost;
        let mut wants = Vec::with_capacity(self.seqs.len());
        for (i, s) in self.seqs.iter_mut().enumerate() {
            let len = s.kv.len();
            if s.next.is_none() || s.kv.reserved_tokens() <= len {
                continue;
            }
            // Drafts never outrun what the request may still generate or the context.
            let room = s.max_tokens.saturating_sub(s.history.len() + 1).min(self.context_limit.saturating_sub(len + 1));
            if room > 0 {
                wants.push((i, s.luck.drafts(k.min(room), |k| cost.row_cost(decoding, k))));
            }
        }
        match (&mut self.drafter, self.speculation) {
            (Some(d), Speculation::Draft { .. }) => {
                let asked: Vec<Want<'_>> = wants
                    .iter()
                    .filter(|w| w.1 > 0)
                    .map(|&(i, k)| Want { id: self.seqs[i].id, context: &self.seqs[i].context, k })
                    .collect();
                let mut drafted = Vec::new();
                d.propose(&asked, &mut drafted);
                let (seconds, rounds) = d.last_cost();
                self.step_cost.observe_draft(decoding, rounds, seconds);
                for ((i, _), d) in wants.iter().filter(|w| w.1 > 0).zip(drafted) {
                    out[*i] = d;
                }
            }
            (_, Speculation::Ngram { .. }) => {
                for (i, k) in wants {
                    speculate::propose(&self.seqs[i].context, k, &mut self.drafts);
                    out[i].extend_from_slice(&self.drafts);
                }
            }
            _ => {}
        }
        out
    }

    /// One forward call; inputs are in `self.seqs` order, so a `ReadCheck` error's index is a
    /// `self.seqs` index.
    fn step_once(&mut self) -> Result<Vec<Event>, EngineError> {
        let feeds = self.feeds();
        if feeds.is_empty() {
            return Ok(Vec::new());
        }
        let mut logits = std::mem::take(&mut self.logits);
        {
            let mut inputs: Vec<SeqInput<'_>> = Vec::with_capacity(feeds.len());
            let mut it = feeds.iter().peekable();
            for (i, s) in self.seqs.iter_mut().enumerate() {
                if let Some(f) = it.next_if(|f| f.seq == i) {
                    inputs.push(SeqInput { kv: &mut s.kv, tokens: &f.tokens, logit_rows: f.rows });
                }
            }
            let started = Instant::now();
            match self.model.forward_into(&mut self.pool, &mut inputs, &mut logits) {
                Ok(()) => {
                    // Decode-only steps teach what a drafted row costs.
                    if self.speculation != Speculation::Off && feeds.iter().all(|f| f.rows == f.tokens.len()) {
                        let drafted = feeds.iter().map(|f| f.drafts).sum();
                        self.step_cost.observe(feeds.len(), drafted, started.elapsed().as_secs_f64());
                    }
                }
                // The forward call numbers only the fed sequences.
                Err(ModelError::ReadCheck { seq, source }) => {
                    return Err(ModelError::ReadCheck { seq: feeds[seq].seq, source }.into());
                }
                Err(e) => return Err(e.into()),
            }
        }
        let vocab = self.model.config.vocab;
        let mut events = Vec::new();
        let mut finished = Vec::new();
        let mut failed = Vec::new();
        let mut rows = logits.chunks_exact(vocab);
        let mut fewest = usize::MAX;
        for f in feeds {
            let (i, fed_rows) = (f.seq, f.rows);
            if fed_rows == 0 {
                continue;
            }
            let mine: Vec<&[f32]> = rows.by_ref().take(fed_rows).collect();
            if mine.len() < fed_rows {
                return Err(EngineError::MissingLogits);
            }
            // Rows are picked in order with the usual draw while they confirm the drafts
            // (with none, the one row is the step's pick).
            let mut verify = Verification::new(f.tokens[f.tokens.len() - f.drafts..].to_vec());
            while let Some(row) = verify.next_row() {
                match self.seqs[i].chooser.choose(mine[row]) {
                    Ok(c) => {
                        let end = self.on_token(i, c.token, c.logprobs, &mut events);
                        verify.emitted(c.token, end.is_some());
                        if let Some((reason, text)) = end {
                            finished.push((i, reason, text));
                        }
                    }
                    // A grammar that cannot go on fails its own request, not the batch.
                    Err(e) => {
                        failed.push((i, e));
                        break;
                    }
                }
            }
            fewest = fewest.min(verify.accepted() + 1);
            let s = &mut self.seqs[i];
            if f.drafts > 0 {
                // The rejected drafts' KV is un-written before anything else can see it:
                // the next step, the cache a finished sequence goes to, a retraction.
                let accepted = verify.settle(&mut self.pool, &mut s.kv)?;
                s.luck.record(f.drafts, accepted);
                self.spec.record(f.drafts, accepted);
                tracing::debug!(request = s.id.0, drafted = f.drafts, accepted, "speculative step verified");
            }
            // So is the draft model's KV of every draft not emitted.
            if let Some(d) = &mut self.drafter {
                d.settle(s.id, &s.context);
            }
        }
        // Remove from the back so indices stay valid.
        let mut ends: Vec<(usize, SequenceEnd)> =
            finished.into_iter().map(|(i, r, t)| (i, Ok((r, t)))).chain(failed.into_iter().map(|(i, e)| (i, Err(e)))).collect();
        ends.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, end) in ends {
            match end {
                Ok((reason, text)) => self.finish(i, reason, text, &mut events),
                Err(e) => {
                    let s = self.seqs.swap_remove(i);
                    tracing::warn!(request = s.id.0, error = %e, "could not pick a token; request failed");
                    let req = s.id;
                    self.give_back(s.kv);
                    events.push(Event::Failed { req, detail: format!("could not pick a token: {e}") });
                }
            }
        }
        if fewest != usize::MAX {
            self.step_tokens = fewest;
        }
        self.logits = logits;
        Ok(events)
    }
}
