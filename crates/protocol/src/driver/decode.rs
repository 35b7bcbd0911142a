//! The decode action dispatch, over any transport and any decode loop.
//!
//! [`DecodeDriver::handle`] feeds an event to the decode role and carries out its actions:
//! messages go to the transport, a verified sequence goes to the decode loop, a stopped
//! request leaves it. [`DecodeDriver::step`] runs one step of the decode loop and turns
//! what it produced into messages, telling the role which requests ended.

use bulkhead_kv::{KvError, KvPool, RequestId, SequenceKv};

use crate::decode::{DecodeAction, DecodeEvent, DecodeRole, DecodeStart, LocalStart, Retired};
use crate::driver::Honest;
use crate::msg::{FailReason, FinishReason, Message, TokenLogprobs, WorkerId};

/// What a decode loop produced for one request.
#[derive(Clone, Debug, PartialEq)]
pub enum GenEvent {
    /// A token was generated; `text` is what may be shown now (possibly empty while a
    /// UTF-8 character or a possible stop string is incomplete), with the token's
    /// log-probabilities when the request asked for them.
    Token { req: RequestId, token: u32, text: String, logprobs: Option<TokenLogprobs> },
    /// The request ended; `text` is any text released at the end.
    Finished { req: RequestId, finish: FinishReason, text: String, prompt_tokens: u32, completion_tokens: u32 },
    /// The request failed alone and left the loop, its pages given back: a KV read check
    /// (a stale lease, the poison canary or the auditor) before its step ran, or no token
    /// could be picked for it (its grammar failed). `detail` says which.
    Failed { req: RequestId, detail: String },
    /// The loop could not grow the pages of its sequences and gave this request's back
    /// (through the pool's release: new generations) so the others go on. `tokens` is
    /// everything it generated, which the client has: it resumes from there later.
    Retracted { req: RequestId, tokens: Vec<u32> },
}

impl GenEvent {
    /// The request it is about.
    pub fn req(&self) -> RequestId {
        match self {
            GenEvent::Token { req, .. }
            | GenEvent::Finished { req, .. }
            | GenEvent::Failed { req, .. }
            | GenEvent::Retracted { req, .. } => *req,
        }
    }

    /// Whether the request leaves the loop with it.
    pub fn is_terminal(&self) -> bool {
        !matches!(self, GenEvent::Token { .. })
    }

    /// The message that carries it to the gateway; a finished request's usage counts
    /// `cached_tokens` prompt tokens from the prefill's cache.
    pub fn into_message(self, cached_tokens: u32) -> Message {
        match self {
            GenEvent::Token { req, token, text, logprobs } => Message::Token { req, token, text, logprobs },
            GenEvent::Finished { req, finish, text, prompt_tokens, completion_tokens } => {
                Message::Finished { req, finish, text, prompt_tokens, completion_tokens, cached_tokens }
            }
            GenEvent::Failed { req, detail } => Message::Failed { req, reason: FailReason::Internal, detail },
            GenEvent::Retracted { req, tokens } => Message::Retracted { req, tokens },
        }
    }
}

/// The decode loop: continuous batching over verified sequences in the worker's pool.
pub trait DecodeEngine {
    /// The loop's error; a failed step ends the worker.
    type Error: std::fmt::Display;
    /// The worker's KV pool, for the role's reservations.
    fn pool_mut(&mut self) -> &mut KvPool;
    /// Take a verified request with the first token its prefill sampled; the events of
    /// that token. On error the request's pages are given back.
    fn add_verified(&mut self, start: DecodeStart) -> Result<Vec<GenEvent>, Self::Error>;
    /// Take a request whose prompt past its shared prefix the loop computes itself (in its
    /// next steps, beside the decoding sequences), then samples its first token; no events
    /// until then. On error the request's pages are given back.
    fn add_local(&mut self, start: LocalStart) -> Result<Vec<GenEvent>, Self::Error>;
    /// One step of every active request.
    fn step(&mut self) -> Result<Vec<GenEvent>, Self::Error>;
    /// End a request now and give its pages back.
    fn abort(&mut self, req: RequestId);
    /// Requests in the loop.
    fn active(&self) -> usize;
    /// From now on, keep the pages of a request that finishes normally and hand them over
    /// through [`DecodeEngine::take_retired`] instead of giving them back (the driver
    /// publishes their full pages to the decode-side cache).
    fn keep_finished(&mut self);
    /// The sequences kept since the last call (see [`DecodeEngine::keep_finished`]).
    fn take_retired(&mut self) -> Vec<Retired>;
    /// Lend `req`'s sequence, with the pool, to `f` if the loop holds it and has computed
    /// its prompt (every prompt position written and committed): the driver publishes a
    /// locally computed prompt's full pages through it. False otherwise.
    fn lend_computed(&mut self, req: RequestId, f: &mut dyn FnMut(&mut KvPool, &mut SequenceKv)) -> bool;
}

/// Where a decode worker's messages go.
pub trait DecodeLink {
    /// Send to the gateway.
    fn to_gateway(&mut self, msg: Message);
    /// Send on the KV connection of prefill worker `to` (dropped if it is gone: its close
    /// reaches the role as [`DecodeEvent::PrefillClosed`]).
    fn to_prefill(&mut self, to: WorkerId, msg: Message);
    /// Close the KV connection of prefill worker `prefill` and read nothing more from it.
    fn disconnect(&mut self, prefill: WorkerId);
    /// Requests are about to end, their last messages next: the place to send evidence
    /// that must arrive before them (the server pushes its metrics here).
    fn ending(&mut self, role: &DecodeRole, pool: &KvPool) {
        let _ = (role, pool);
    }
}

/// Where a driver may depart from the role's decisions. Production uses [`Honest`]; the
/// broken implementations live in the checkers' crates.
pub trait DecodePolicy {
    /// An event on its way to the role; `None` drops it.
    fn inbound(&mut self, ev: DecodeEvent) -> Option<DecodeEvent> {
        Some(ev)
    }
    /// The role's actions on their way out. May change them, and may name events to feed
    /// the role once they are carried out.
    fn outbound(&mut self, acts: Vec<DecodeAction>, feedback: &mut Vec<DecodeEvent>) -> Vec<DecodeAction> {
        let _ = feedback;
        acts
    }
}

impl DecodePolicy for Honest {}

/// The decode driver: the role and the decode loop, so that protocol decisions and decode
/// steps never race.
#[derive(Debug)]
pub struct DecodeDriver<E, P: DecodePolicy = Honest> {
    role: DecodeRole,
    engine: E,
    policy: P,
}

impl<E: DecodeEngine> DecodeDriver<E, Honest> {
    /// The production driver.
    pub fn new(role: DecodeRole, engine: E) -> Self {
        Self::with_policy(role, engine, Honest)
    }
}

impl<E: DecodeEngine, P: DecodePolicy> DecodeDriver<E, P> {
    /// A driver that departs from the role where `policy` says so.
    pub fn with_policy(role: DecodeRole, mut engine: E, policy: P) -> Self {
        if role.cache().is_some() {
            engine.keep_finished();
        }
        DecodeDriver { role, engine, policy }
    }

    /// The role.
    pub fn role(&self) -> &DecodeRole {
        &self.role
    }

    /// The decode loop.
    pub fn engine(&self) -> &E {
        &self.engine
    }

    /// The decode loop, for what only its owner does (statistics, test hooks).
    pub fn engine_mut(&mut self) -> &mut E {
        &mut self.engine
    }

    /// Whether nothing is reserved, quarantined or decoding.
    pub fn is_idle(&self) -> bool {
        !self.role.busy() && self.engine.active() == 0
    }

    /// Process one event and carry out the role's actions.
    pub fn handle(&mut self, ev: DecodeEvent, link: &mut impl DecodeLink) {
        let Some(ev) = self.policy.inbound(ev) else { return };
        let acts = self.role.handle(self.engine.pool_mut(), ev);
        let mut feedback = Vec::new();
        let acts = self.policy.outbound(acts, &mut feedback);
        for a in acts {
            self.dispatch(a, link);
        }
        for ev in feedback {
            self.handle(ev, link);
        }
        self.report_cache(link);
    }

    /// What the cache stored and evicted, for the gateway's routing index.
    fn report_cache(&mut self, link: &mut impl DecodeLink) {
        if let Some(m) = self.role.cache_report() {
            link.to_gateway(m);
        }
    }

    fn dispatch(&mut self, a: DecodeAction, link: &mut impl DecodeLink) {
        match a {
            DecodeAction::ToGateway(m) => link.to_gateway(m),
            DecodeAction::ToPrefill { to, msg } => link.to_prefill(to, msg),
            DecodeAction::Start(start) => {
                let req = start.req;
                let added = self.engine.add_verified(start);
                self.started(req, added, link);
            }
            DecodeAction::StartLocal(start) => {
                let req = start.req;
                let added = self.engine.add_local(start);
                self.started(req, added, link);
                self.publish_computed(link);
            }
            DecodeAction::Stop { req } => {
                self.engine.abort(req);
                self.role.finished(req);
                if let Some(m) = self.role.room() {
                    link.to_gateway(m);
                }
            }
            DecodeAction::Disconnect { prefill } => link.disconnect(prefill),
        }
    }

    /// Send what a request's start in the loop produced, or its failure.
    fn started(&mut self, req: RequestId, added: Result<Vec<GenEvent>, E::Error>, link: &mut impl DecodeLink) {
        match added {
            Ok(events) => self.emit(events, link),
            Err(e) => {
                self.role.finished(req);
                link.ending(&self.role, self.engine.pool_mut());
                link.to_gateway(Message::Failed { req, reason: FailReason::Internal, detail: e.to_string() });
            }
        }
    }

    /// Run one step of the decode loop and send what it produced. An error leaves the
    /// loop's sequences in an unknown state: the caller ends the worker.
    pub fn step(&mut self, link: &mut impl DecodeLink) -> Result<(), E::Error> {
        // Each sequence grows by a page at most per step: cached pages nobody reads give
        // way first, so no live sequence is retracted while the cache could make room.
        let active = self.engine.active();
        self.role.make_room(self.engine.pool_mut(), active);
        let events = self.engine.step()?;
        self.emit(events, link);
        Ok(())
    }

    /// Send the loop's events. The role learns first which requests left the loop, and the
    /// transport gets its chance to send evidence before their last messages.
    fn emit(&mut self, events: Vec<GenEvent>, link: &mut impl DecodeLink) {
        for r in self.engine.take_retired() {
            self.role.retire(self.engine.pool_mut(), r);
        }
        let mut ended = false;
        let retracted = events.iter().any(|e| matches!(e, GenEvent::Retracted { .. }));
        let events_freed = events.iter().any(|e| e.is_terminal() && !matches!(e, GenEvent::Retracted { .. }));
        let mut cached = Vec::with_capacity(events.len());
        for e in &events {
            let terminal = e.is_terminal();
            cached.push(if terminal { self.role.finished(e.req()) } else { 0 });
            ended |= terminal;
        }
        if ended {
            link.ending(&self.role, self.engine.pool_mut());
        }
        for (e, cached) in events.into_iter().zip(cached) {
            link.to_gateway(e.into_message(cached));
        }
        self.publish_computed(link);
        // A retraction hands pages to another sequence: it frees none, but the gateway now
        // waits for room, which the next pages freed (here, or later) owe it.
        if retracted {
            self.role.retracted();
        }
        let freed = events_freed;
        if let Some(m) = freed.then(|| self.role.room()).flatten() {
            link.to_gateway(m);
        }
        self.report_cache(link);
    }

    /// Publish the prompts the loop has computed here, and let the reservations held back
    /// for them (or for requests that left first) go on: their answers before any `Room`,
    /// as in [`DecodeRole::handle`].
    fn publish_computed(&mut self, link: &mut impl DecodeLink) {
        for req in self.role.computing_here() {
            let role = &mut self.role;
            self.engine.lend_computed(req, &mut |pool, seq| role.publish_local(pool, req, seq));
        }
        for a in self.role.release_deferred(self.engine.pool_mut()) {
            self.dispatch(a, link);
        }
    }
}

/// A sequence of a decode loop, as KV on demand sees it.
pub trait Growing {
    /// Its pages.
    fn kv(&mut self) -> &mut SequenceKv;
    /// Its pages, to look at.
    fn kv_ref(&self) -> &SequenceKv;
    /// Whether its next step writes the next position (it is decoding, not prefilling).
    fn decoding(&self) -> bool;
    /// When it joined the loop (larger is newer).
    fn order(&self) -> u64;
}

/// KV on demand, for every decode loop (the engine's and the checkers' mocks): lease a page
/// for each decoding sequence whose next position has none, oldest first. When the pool has
/// no page left, retract the newest sequence that holds any (it may be the one that needs
/// to grow): its pages go back through the pool's release path, so each gets a new
/// generation and nothing can read them through its old leases, and it is taken out of
/// `seqs` and returned, holding an empty sequence, for the caller to resume later.
///
/// Sequences that cannot grow while nothing in `seqs` holds a page (the pool is held by
/// reservations in transfer or by quarantine) are left to wait a step.
pub fn make_room<S: Growing>(pool: &mut KvPool, seqs: &mut Vec<S>) -> Result<Vec<S>, KvError> {
    let mut retracted = Vec::new();
    loop {
        let grower = seqs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.decoding() && s.kv_ref().reserved_tokens() <= s.kv_ref().len())
            .min_by_key(|(_, s)| s.order());
        let Some(i) = grower.map(|(i, _)| i) else { return Ok(retracted) };
        let want = seqs[i].kv_ref().len() + 1;
        match seqs[i].kv().reserve(pool, want) {
            Ok(()) => {}
            Err(KvError::Exhausted { .. }) => {
                let victim = seqs.iter().enumerate().filter(|(_, s)| !s.kv_ref().pages().is_empty()).max_by_key(|(_, s)| s.order());
                let Some(v) = victim.map(|(v, _)| v) else { return Ok(retracted) };
                let mut s = seqs.swap_remove(v);
                let owner = s.kv_ref().owner();
                let kv = std::mem::replace(s.kv(), SequenceKv::new(owner));
                if let Err(u) = kv.release(pool) {
                    // A stale lease is a bug; the pages are still leased to `owner`.
                    u.reclaim(pool);
                }
                retracted.push(s);
            }
            Err(e) => return Err(e),
        }
    }
}

/// The verification of one speculative step of one sequence, sans-IO, shared by the engine
/// and the checkers' mocks. The step fed the sequence's last token and `drafts` after it
/// and committed all of them; row `r` of its logits gives the token after the `r`-th fed
/// one. The caller picks row after row ([`Verification::next_row`]) with its usual draw,
/// emitting each pick as it would without speculation, and reports it
/// ([`Verification::emitted`]); rows are accepted while the pick equals the draft fed
/// after it, so the text is exactly what one token per step would give (one draw per
/// emitted token, I11). [`Verification::settle`] then rolls the sequence's KV back to the
/// positions of emitted tokens: a rejected draft's KV is never attended to, published or
/// counted (I2, amended for speculation).
#[derive(Debug)]
pub struct Verification {
    drafts: Vec<u32>,
    emitted: usize,
    done: bool,
}

impl Verification {
    /// Verification of a step that fed `drafts` after the sequence's last token.
    pub fn new(drafts: Vec<u32>) -> Self {
        Verification { drafts, emitted: 0, done: false }
    }

    /// The logits row to pick from next; `None` once verification is over.
    pub fn next_row(&self) -> Option<usize> {
        (!self.done && self.emitted <= self.drafts.len()).then_some(self.emitted)
    }

    /// The token picked from [`Verification::next_row`] was emitted; `ends` if it ended
    /// the request. The next row is verified only if this pick is the draft fed after it.
    pub fn emitted(&mut self, token: u32, ends: bool) {
        let accepted = self.drafts.get(self.emitted) == Some(&token);
        self.emitted += 1;
        self.done |= ends || !accepted;
    }

    /// Drafts accepted: emitted tokens that were fed as drafts.
    pub fn accepted(&self) -> usize {
        self.emitted.saturating_sub(1)
    }

    /// Drafts fed.
    pub fn drafted(&self) -> usize {
        self.drafts.len()
    }

    /// Rolls `seq` back to the positions of what was emitted ([`SequenceKv::roll_back`]):
    /// the fed token and each accepted draft keep their KV; every rejected draft's (and
    /// those after a request's end) is un-written. Returns the drafts accepted.
    pub fn settle(self, pool: &mut KvPool, seq: &mut SequenceKv) -> Result<usize, KvError> {
        let unread = self.drafts.len() + 1 - self.emitted.max(1);
        if unread > 0 {
            seq.roll_back(pool, seq.len().saturating_sub(unread))?;
        }
        Ok(self.accepted())
    }
}
