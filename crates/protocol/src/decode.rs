//! The decode worker's protocol state machine.
//!
//! It owns the decode side of every handoff: reserving pages (admission, I3/I5), checking
//! each KV chunk against the reservation as it lands and the completion claim before any
//! decode step (I1/I2, through [`bulkhead_kv::Inbound`]), and keeping pages quarantined while
//! a chunk for them may still arrive (I4). A page under transfer is released only when its
//! writer is fenced: its `Done` or `Fenced` for the request arrived, or its connection
//! closed. A timeout fails the request but never frees its pages.
//!
//! The transfer timeout is a silence timer: a reservation fails when its prefill worker has
//! sent nothing on its KV connection for `transfer_timeout_ms` (since the reservation, or
//! since its last frame: a chunk for any request, `Done`, `Fenced` or a `KvKeepalive`). A
//! prompt queued behind others at a busy prefill therefore waits as long as it must (the
//! gateway's request timeout bounds that), while a cut link or a hung prefill is noticed
//! within the timeout.

use bulkhead_fingerprint::Fingerprint;
use std::collections::{BTreeMap, BTreeSet};

use bulkhead_kv::{
    CacheStats, Inbound, KvError, KvPool, LocalPrefill, PageTag, PrefixCache, Quarantined, RequestId, SequenceKv, TransferError,
    VerifiedSequence,
};

use crate::admission::{Generate, admit};
use crate::cache::CacheScope;
use crate::gateway::gateway_of;
use crate::msg::*;

/// Limits of a decode worker.
#[derive(Clone, Debug, Fingerprint)]
pub struct DecodeConfig {
    /// Longest request (prompt + generation) admitted.
    pub max_context: usize,
    /// How long a reservation may go without any frame from its prefill worker before it
    /// fails (see the module docs).
    pub transfer_timeout_ms: u64,
    /// A reservation that finds part of its prompt in this worker's cache (a conversation's
    /// earlier turns) and at most this many tokens missing computes the rest here instead
    /// of receiving it: no transfer, no prefill queue, and the previous answer, which only
    /// this worker holds, is not computed again. 0: always receive.
    pub local_prefill_tokens: usize,
}

/// Something that happened to the decode worker.
#[derive(Debug)]
pub enum DecodeEvent {
    /// A message from gateway `from`.
    Gateway { from: GatewayId, msg: Message },
    /// A message from a prefill worker's KV connection.
    Prefill { from: WorkerId, msg: Message },
    /// A prefill worker opened its KV connection (its `KvHello` arrived).
    PrefillConnected { from: WorkerId },
    /// A prefill worker's KV connection closed: nothing more can arrive from it.
    PrefillClosed { from: WorkerId },
    /// The connection to gateway `gateway` closed: its clients are gone with it, so its
    /// requests here end. A reservation's prefill worker is asked to stop (it may never
    /// have got the job, and only it can say so) and the pages wait for its fence (I4).
    GatewayLost { gateway: GatewayId },
    /// The clock moved.
    Tick { now_ms: u64 },
}

/// A verified request, ready for the decode loop.
#[derive(Debug)]
pub struct DecodeStart {
    /// The request.
    pub req: RequestId,
    /// Its pages, prompt KV verified in place.
    pub seq: VerifiedSequence,
    /// First generated token (sampled by the prefill worker).
    pub first_token: u32,
    /// Its log-probabilities, when the request asked for them.
    pub first_logprobs: Option<TokenLogprobs>,
    /// Most tokens to generate, the first included.
    pub max_tokens: u32,
    /// Sampling settings.
    pub sampling: Sampling,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Tokens an earlier attempt generated (the client has them): the last ones of the
    /// verified prompt, replayed by the decode loop so it picks up where it was.
    pub resume: Vec<u32>,
    /// The client's prompt tokens (penalties and speculation's lookups read them).
    pub prompt: Vec<u32>,
}

/// A reserved request whose prompt the decode loop computes itself, from the first position
/// past its shared prefix (see [`DecodeConfig::local_prefill_tokens`]).
#[derive(Debug)]
pub struct LocalStart {
    /// The request.
    pub req: RequestId,
    /// Its pages: the shared prefix, then its own pages for the rest and the first output.
    pub seq: LocalPrefill,
    /// The attempt's prompt: the client's, then `resume`.
    pub tokens: Vec<u32>,
    /// Most tokens to generate, the first included.
    pub max_tokens: u32,
    /// Sampling settings.
    pub sampling: Sampling,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Tokens an earlier attempt generated (the client has them): the last ones of
    /// `tokens`, replayed by the decode loop so it picks up where it was.
    pub resume: Vec<u32>,
}

/// What the driver must do.
#[derive(Debug)]
pub enum DecodeAction {
    /// Send to the gateway.
    ToGateway(Message),
    /// Send to a prefill worker.
    ToPrefill { to: WorkerId, msg: Message },
    /// Hand a verified request to the decode loop.
    Start(DecodeStart),
    /// Hand a request to the decode loop to compute the rest of its prompt here.
    StartLocal(LocalStart),
    /// The decode loop must end this request now and release its pages.
    Stop { req: RequestId },
    /// Close the KV connection of prefill worker `prefill`, reading nothing more from it:
    /// it left the cluster before its connection arrived.
    Disconnect { prefill: WorkerId },
}

impl DecodeAction {
    /// The prefill worker and request of a transfer this action gives up on timeout (the
    /// `Abort { reason: Timeout }` a silent prefill gets), if it is one.
    pub fn timeout_abort(&self) -> Option<(WorkerId, RequestId)> {
        match self {
            DecodeAction::ToPrefill { to, msg: Message::Abort { req, reason: AbortReason::Timeout } } => Some((*to, *req)),
            _ => None,
        }
    }
}

/// Why a KV chunk was refused. Any of these fails the request (I1, I2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChunkRefusal {
    /// It came on the KV connection of another prefill worker than the one the
    /// reservation names (the pool's verifier knows no workers, so this check is here).
    #[error("chunk from {from}, the transfer was assigned to {assigned}")]
    WrongSender { from: WorkerId, assigned: WorkerId },
    /// The verifier refused it.
    #[error(transparent)]
    Transfer(#[from] TransferError),
}

/// Where a request stands on a decode worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestState {
    /// Reserved (or its `Reserve` held back for a sibling's transfer), its KV transfer not
    /// yet verified.
    Pending,
    /// Its transfer was given up; its pages wait in quarantine for the writer's fence.
    Fencing,
    /// Verified and handed to the decode loop.
    Decoding,
}

/// A page the role holds: a reservation's lease, or a quarantined page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldPage {
    /// Which page, at which generation, for whom.
    pub tag: PageTag,
    /// Quarantined (awaiting a fence) rather than leased.
    pub quarantined: bool,
}

/// Evidence (I6): every check that ran and every one that failed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Reservations granted.
    pub reserved: u64,
    /// Reservations refused: over the context limit.
    pub rejected_context: u64,
    /// Reservations refused: no free pages.
    pub rejected_capacity: u64,
    /// Reservations refused: malformed or duplicate.
    pub rejected_invalid: u64,
    /// Chunks that passed every check.
    pub chunks_verified: u64,
    /// Chunks refused (wrong page, generation, order, range, checksum or sender).
    pub chunks_refused: u64,
    /// Of those, chunks whose bytes did not match their checksum (checked only once every
    /// earlier check passed, so chunks checksummed = `chunks_verified + checksum_failed`).
    pub checksum_failed: u64,
    /// Completion claims verified (coverage, count, manifest).
    pub coverage_verified: u64,
    /// Completion claims refused.
    pub coverage_failed: u64,
    /// Pages put in quarantine.
    pub pages_quarantined: u64,
    /// Quarantined pages released because their writer was fenced.
    pub fenced_releases: u64,
    /// Chunks for requests no longer receiving (dropped unread).
    pub late_chunks: u64,
    /// Transfers that timed out: nothing from their prefill worker for the transfer timeout.
    pub timeouts: u64,
    /// KV connections refused: they arrived after their prefill worker left the cluster.
    pub refused_connections: u64,
    /// Prompt tokens reservations found in this worker's cache (not sent by the prefill).
    pub held_tokens: u64,
    /// Prompt tokens sent by prefill workers and verified (the rest of each prompt).
    pub transferred_tokens: u64,
    /// Reservations whose rest of the prompt this worker computed itself.
    pub local_prefills: u64,
    /// Prompt tokens those computed here (past their shared prefixes).
    pub local_prefill_tokens: u64,
    /// Finished sequences not published to the cache because their written extent was not
    /// the client's prompt and what was generated (a bug: say, a rejected speculative
    /// draft's KV left in place); their pages were given back instead. Always 0.
    pub extent_mismatches: u64,
}

#[derive(Debug, Fingerprint)]
struct Pending {
    inbound: Inbound,
    prefill: WorkerId,
    max_tokens: u32,
    sampling: Sampling,
    stop: Vec<String>,
    resume: Vec<u32>,
    prompt: Vec<u32>,
    /// The request's cache scope and its client's prompt: its full pages are published
    /// here when it ends.
    publish: Option<(CacheScope, Vec<u32>)>,
    /// `transfer_timeout_ms` after the reservation or the last frame from its prefill worker,
    /// whichever is later: a prefill that keeps talking (chunks for any request, keepalives)
    /// may have this prompt queued behind others; one silent that long is cut off or hung.
    #[fingerprint(clock)]
    deadline_ms: u64,
}

#[derive(Debug, Fingerprint)]
struct Fencing {
    pages: Vec<Quarantined>,
    prefill: WorkerId,
    /// Prompt tokens a sender had written when the transfer was given up.
    received: usize,
}

/// A request in the decode loop.
#[derive(Debug, Fingerprint)]
struct Decoding {
    /// The prompt tokens not computed for it (for its usage): what its prefill took from the
    /// prefill's cache, or, computed here, its shared prefix.
    cached: u32,
    /// Its cache scope and the tokens before what the loop generates (the client's prompt;
    /// the resumed tokens are the loop's): its full pages are published under this scope
    /// when it ends.
    publish: Option<(CacheScope, Vec<u32>)>,
    /// The loop computes its prompt itself and has not yet published the prompt's full
    /// pages ([`DecodeRole::publish_local`]): a sibling's `Reserve` that needs them waits.
    computing: bool,
}

/// The decode worker's prefix cache (design I10) and what its keys need.
#[derive(Debug, Fingerprint)]
struct DecodeCache {
    cache: PrefixCache,
    model_digest: u64,
}

/// A sequence the decode loop finished, handed back for the cache: `generated` holds every
/// token it generated (resumed ones first), in position order after the client's prompt.
#[derive(Debug)]
pub struct Retired {
    /// Its pages.
    pub seq: SequenceKv,
    /// The tokens the loop generated for it (an earlier attempt's first).
    pub generated: Vec<u32>,
}

/// The decode worker's protocol state.
#[derive(Debug, Fingerprint)]
pub struct DecodeRole {
    cfg: DecodeConfig,
    #[fingerprint(clock)]
    now_ms: u64,
    pending: BTreeMap<RequestId, Pending>,
    fencing: BTreeMap<RequestId, Fencing>,
    /// Requests in the decode loop.
    decoding: BTreeMap<RequestId, Decoding>,
    /// Prefill workers whose KV connection closed. Worker ids are never reused (a restarted
    /// worker, or one that lost a KV connection, registers anew), so nothing can arrive from
    /// these again: a transfer naming one is fenced by construction, and a new connection
    /// from one is refused.
    closed_prefills: BTreeSet<WorkerId>,
    /// Prefill workers whose KV connection opened here.
    connected_prefills: BTreeSet<WorkerId>,
    /// Prefill workers that left the cluster.
    departed: BTreeSet<WorkerId>,
    /// A reservation was refused for want of room and the gateway has not been told of
    /// pages freed since (`Room`): it holds its queue back until then.
    owes_room: bool,
    /// Full pages of ended requests, shared read-only with later requests of their scope.
    cache: Option<DecodeCache>,
    /// `Reserve`s held back until a transfer of their scope lands the first full page they
    /// miss (the siblings of `n > 1`, sent together): then they share it instead of
    /// receiving a copy. In arrival order.
    deferred: Vec<Message>,
    /// A prompt computed here was published, or its request left before: the deferred
    /// `Reserve`s may go on ([`DecodeRole::release_deferred`]).
    unblocked: bool,
    #[fingerprint(skip)]
    stats: DecodeStats,
}

fn failed(req: RequestId, reason: FailReason, detail: impl Into<String>) -> DecodeAction {
    DecodeAction::ToGateway(Message::Failed { req, reason, detail: detail.into() })
}

impl DecodeRole {
    /// A decode role with nothing in flight.
    pub fn new(cfg: DecodeConfig) -> Self {
        DecodeRole {
            cfg,
            now_ms: 0,
            pending: BTreeMap::new(),
            fencing: BTreeMap::new(),
            decoding: BTreeMap::new(),
            closed_prefills: BTreeSet::new(),
            connected_prefills: BTreeSet::new(),
            departed: BTreeSet::new(),
            owes_room: false,
            cache: None,
            deferred: Vec::new(),
            unblocked: false,
            stats: DecodeStats::default(),
        }
    }

    /// The same role with a prefix cache over the worker's pool, for the model with digest
    /// `model_digest` (part of every page key): requests of a cache scope share the cached
    /// pages of their prompt, read-only, and leave their full pages behind when they end.
    pub fn with_cache(mut self, cache: PrefixCache, model_digest: u64) -> Self {
        self.cache = Some(DecodeCache { cache, model_digest });
        self
    }

    /// The prefix cache, if there is one.
    pub fn cache(&self) -> Option<&PrefixCache> {
        self.cache.as_ref().map(|c| &c.cache)
    }

    /// The cache's counters, if there is one.
    pub fn cache_stats(&self) -> Option<CacheStats> {
        self.cache().map(PrefixCache::stats)
    }

    /// The pages the cache stored and evicted since the last call, for the gateway's
    /// routing index: `None` when there is nothing to report.
    pub fn cache_report(&mut self) -> Option<Message> {
        let (stored, evicted) = self.cache.as_mut()?.cache.take_changes();
        (!stored.is_empty() || !evicted.is_empty()).then_some(Message::CacheReport { stored, evicted })
    }

    /// Evicts cached pages nobody reads until `free` pages are free (or nothing more can
    /// go): the decode loop calls this before it grows its sequences, so a cache entry is
    /// always evicted before a live sequence is retracted.
    pub fn make_room(&mut self, pool: &mut KvPool, free: usize) {
        if let Some(c) = self.cache.as_mut() {
            c.cache.make_room(pool, free);
        }
    }

    /// The decode loop finished a sequence normally: its own full pages are published to
    /// the cache under its request's scope (their keys chain the client's prompt and what
    /// was generated, up to the positions whose KV is written), the rest given back.
    pub fn retire(&mut self, pool: &mut KvPool, r: Retired) {
        let req = r.seq.owner();
        let publish = self.decoding.get(&req).and_then(|d| d.publish.as_ref());
        let (Some(c), Some((scope, prompt))) = (self.cache.as_mut(), publish) else {
            return self.release_seq(pool, r.seq);
        };
        // Every position but the last generated token's (never fed) holds KV, and nothing
        // more: a rejected draft's KV left in place would be published under the keys of
        // tokens that were never generated there.
        if r.seq.len() + 1 != prompt.len() + r.generated.len() {
            self.stats.extent_mismatches += 1;
            return self.release_seq(pool, r.seq);
        }
        let tokens: Vec<u32> = prompt.iter().chain(&r.generated).copied().take(r.seq.len()).collect();
        let keys = scope.page_keys(c.model_digest, &tokens, pool.layout().page_size);
        c.cache.finish(pool, r.seq, &keys, scope.fence());
    }

    /// Counters.
    pub fn stats(&self) -> DecodeStats {
        self.stats
    }

    /// Requests reserved and waiting for their transfer.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Requests whose pages are quarantined awaiting their writer's fence.
    pub fn fencing(&self) -> usize {
        self.fencing.len()
    }

    /// Requests handed to the decode loop and not yet reported finished.
    pub fn decoding(&self) -> usize {
        self.decoding.len()
    }

    /// Whether any request holds anything here.
    pub fn busy(&self) -> bool {
        !(self.pending.is_empty() && self.fencing.is_empty() && self.decoding.is_empty() && self.deferred.is_empty())
    }

    /// Where `req` stands here, if it holds anything.
    pub fn state_of(&self, req: RequestId) -> Option<RequestState> {
        if self.pending.contains_key(&req) || self.deferred.iter().any(|m| m.req() == Some(req)) {
            Some(RequestState::Pending)
        } else if self.fencing.contains_key(&req) {
            Some(RequestState::Fencing)
        } else if self.decoding.contains_key(&req) {
            Some(RequestState::Decoding)
        } else {
            None
        }
    }

    /// Every page the role holds (reservations and quarantines; not the decode loop's, and
    /// not the cache's pages a reservation shares, see [`DecodeRole::shared_pages`]).
    pub fn held_pages(&self) -> Vec<HeldPage> {
        let own = self.pending.values().flat_map(|p| p.inbound.pages()).filter(|l| !l.is_shared());
        let leased = own.map(|l| HeldPage { tag: **l, quarantined: false });
        let quarantined = self.fencing.values().flat_map(|f| &f.pages).map(|q| HeldPage { tag: **q, quarantined: true });
        leased.chain(quarantined).collect()
    }

    /// Cached pages the role's reservations share read-only.
    pub fn shared_pages(&self) -> usize {
        self.pending.values().map(|p| p.inbound.pages().iter().filter(|l| l.is_shared()).count()).sum()
    }

    /// Whether prefill worker `prefill` ever opened its KV connection here.
    pub fn has_connected(&self, prefill: WorkerId) -> bool {
        self.connected_prefills.contains(&prefill)
    }

    /// Whether a reservation waits for a transfer from prefill worker `prefill`.
    pub fn awaits(&self, prefill: WorkerId) -> bool {
        self.pending.values().any(|p| p.prefill == prefill)
    }

    /// The decode loop finished `req` (and released its pages); the prompt tokens its
    /// prefill took from the cache.
    pub fn finished(&mut self, req: RequestId) -> u32 {
        let d = self.decoding.remove(&req);
        // One that left before its prompt was computed publishes nothing: those held back
        // for it go on without.
        self.unblocked |= d.as_ref().is_some_and(|d| d.computing);
        d.map_or(0, |d| d.cached)
    }

    /// Requests whose prompt the loop computes here and whose full pages are not yet
    /// published: the driver offers each to [`DecodeRole::publish_local`] once the loop has
    /// computed it.
    pub fn computing_here(&self) -> Vec<RequestId> {
        self.decoding.iter().filter(|(_, d)| d.computing).map(|(r, _)| *r).collect()
    }

    /// The loop computed `req`'s prompt (its positions written and committed in `seq`): its
    /// own full pages go to the cache now, as a verified transfer's do, so the siblings held
    /// back for them share them ([`DecodeRole::release_deferred`]).
    pub fn publish_local(&mut self, pool: &mut KvPool, req: RequestId, seq: &mut SequenceKv) {
        let Some(d) = self.decoding.get_mut(&req).filter(|d| d.computing) else { return };
        d.computing = false;
        self.unblocked = true;
        let (Some(c), Some((scope, prompt))) = (self.cache.as_mut(), d.publish.as_ref()) else { return };
        let ps = pool.layout().page_size;
        if seq.len() < prompt.len() {
            return;
        }
        let keys = scope.page_keys(c.model_digest, prompt, ps);
        c.cache.publish_prefix(pool, seq, &keys, prompt.len() / ps, scope.fence());
    }

    /// Reservations held back for a prompt computed here go on once it is published (or its
    /// request left): their answers, for the driver to carry out before anything else.
    pub fn release_deferred(&mut self, pool: &mut KvPool) -> Vec<DecodeAction> {
        let mut out = Vec::new();
        if std::mem::take(&mut self.unblocked) {
            for m in std::mem::take(&mut self.deferred) {
                self.on_gateway(pool, m, &mut out);
            }
        }
        out
    }

    /// The decode loop retracted a sequence for want of pages: the gateway counts this
    /// worker full until it hears of room, so the next pages freed (a request that ends or
    /// is stopped) owe it a `Room` as a refused reservation does (found by the model
    /// checker: a client that left after a retraction freed pages nobody was told about).
    pub fn retracted(&mut self) {
        self.owes_room = true;
    }

    /// The decode loop freed pages (it ended sequences): the `Room` owed to the gateway,
    /// if a reservation was refused for want of room since the last one.
    pub fn room(&mut self) -> Option<Message> {
        std::mem::take(&mut self.owes_room).then_some(Message::Room)
    }

    /// Process one event.
    pub fn handle(&mut self, pool: &mut KvPool, ev: DecodeEvent) -> Vec<DecodeAction> {
        let mut out = Vec::new();
        let free_before = pool.stats().free_pages;
        let pending_before = self.pending.len();
        self.on_event(pool, ev, &mut out);
        if self.pending.len() < pending_before && !self.deferred.is_empty() {
            // A transfer ended: reservations held back for it go on (and may wait again).
            // Their answers go first: a refusal for want of room must reach the gateway
            // before the `Room` that the event's own actions may bring (a request that
            // starts and ends at once), or the gateway would wait for a `Room` already
            // spent (found by the model checker).
            let mut first = Vec::new();
            for m in std::mem::take(&mut self.deferred) {
                self.on_gateway(pool, m, &mut first);
            }
            first.append(&mut out);
            out = first;
        }
        if pool.stats().free_pages > free_before {
            out.extend(self.room().map(DecodeAction::ToGateway));
        }
        out
    }

    fn on_event(&mut self, pool: &mut KvPool, ev: DecodeEvent, out: &mut Vec<DecodeAction>) {
        match ev {
            // A connection that was on its way when its prefill left, or a second one from a
            // prefill whose first one closed (a prefill that loses its connection rejoins
            // under a new id): whatever it carries was fenced already (the pages may belong
            // to others now), so nothing of it is read.
            DecodeEvent::PrefillConnected { from } if self.departed.contains(&from) || self.closed_prefills.contains(&from) => {
                self.stats.refused_connections += 1;
                out.push(DecodeAction::Disconnect { prefill: from });
            }
            DecodeEvent::PrefillConnected { from } => {
                self.heard_from(from);
                self.connected_prefills.insert(from);
                // Reservations given up while it had no connection here: the abort that asks
                // for its fence found no road then (a reservation of a lost gateway whose
                // prefill worker had not connected yet would wait for ever).
                for (&req, _) in self.fencing.iter().filter(|(_, f)| f.prefill == from) {
                    out.push(DecodeAction::ToPrefill { to: from, msg: Message::Abort { req, reason: AbortReason::Failed } });
                }
            }
            // A prefill that can no longer reach us and never connected here can never
            // write here: fenced. One that did connect is fenced when that connection
            // closes, not before (chunks may still be in flight on it).
            DecodeEvent::Gateway { msg: Message::PrefillUnreachable { worker }, .. } if !self.connected_prefills.contains(&worker) => {
                self.prefill_fenced(pool, worker, out);
            }
            // It left the cluster. One whose connection here is open is fenced when that
            // connection closes (chunks may still be on it); one that never connected or
            // whose connection closed already is fenced now (a reservation naming it may
            // have arrived after the close: the gateway names it until it hears it left,
            // and says so after every such reservation), and a connection from it still
            // on its way will be refused. With several gateways it may have left only
            // `from` and live on for the others: the reservations of `from`'s requests it
            // was to write fail now (their jobs may have been lost with its connection to
            // `from`) and wait for its fence, which it is asked for.
            DecodeEvent::Gateway { from, msg: Message::PeerLeft { worker } } => {
                self.departed.insert(worker);
                if !self.connected_prefills.contains(&worker) || self.closed_prefills.contains(&worker) {
                    self.prefill_fenced(pool, worker, out);
                } else {
                    let orphans: Vec<RequestId> =
                        self.pending.iter().filter(|(r, p)| p.prefill == worker && gateway_of(**r) == from).map(|(r, _)| *r).collect();
                    for req in orphans {
                        if let Some(p) = self.pending.remove(&req) {
                            self.quarantine(pool, req, p);
                            out.push(failed(req, FailReason::WorkerLost, "prefill worker left the gateway"));
                        }
                    }
                    // Every quarantine of `from`'s requests it is to fence (those the
                    // gateway aborted too: it could no longer tell the worker) asks for it.
                    for (&req, _) in self.fencing.iter().filter(|(r, f)| f.prefill == worker && gateway_of(**r) == from) {
                        out.push(DecodeAction::ToPrefill { to: worker, msg: Message::Abort { req, reason: AbortReason::Failed } });
                    }
                }
            }
            // Frames of a refused connection that were read before it closed.
            DecodeEvent::Prefill { from, .. } if !self.connected_prefills.contains(&from) => {
                self.stats.late_chunks += 1;
            }
            DecodeEvent::PrefillClosed { from } => self.prefill_fenced(pool, from, out),
            DecodeEvent::GatewayLost { gateway } => {
                self.deferred.retain(|m| m.req().is_none_or(|r| gateway_of(r) != gateway));
                for req in self.requests().into_iter().filter(|r| gateway_of(*r) == gateway) {
                    if let Some(p) = self.pending.remove(&req) {
                        let prefill = p.prefill;
                        self.quarantine(pool, req, p);
                        if self.fencing.contains_key(&req) {
                            out.push(DecodeAction::ToPrefill { to: prefill, msg: Message::Abort { req, reason: AbortReason::ClientGone } });
                        }
                    } else if self.decoding.remove(&req).is_some() {
                        out.push(DecodeAction::Stop { req });
                    }
                }
            }
            DecodeEvent::Gateway { msg, .. } => self.on_gateway(pool, msg, out),
            DecodeEvent::Prefill { from, msg } => {
                self.heard_from(from);
                self.on_prefill(pool, from, msg, out);
            }
            DecodeEvent::Tick { now_ms } => {
                self.now_ms = now_ms;
                let late: Vec<RequestId> = self.pending.iter().filter(|(_, p)| p.deadline_ms <= now_ms).map(|(r, _)| *r).collect();
                for req in late {
                    self.stats.timeouts += 1;
                    if let Some(p) = self.pending.remove(&req) {
                        let prefill = p.prefill;
                        self.quarantine(pool, req, p);
                        let why = format!("KV transfer stalled: nothing from the prefill worker for {} ms", self.cfg.transfer_timeout_ms);
                        out.push(failed(req, FailReason::Timeout, why));
                        out.push(DecodeAction::ToPrefill { to: prefill, msg: Message::Abort { req, reason: AbortReason::Timeout } });
                    }
                }
            }
        }
    }

    /// Prefill `from` is alive and its link carries frames: re-arm its reservations' timers.
    fn heard_from(&mut self, from: WorkerId) {
        let deadline_ms = self.now_ms.saturating_add(self.cfg.transfer_timeout_ms);
        self.pending.values_mut().filter(|p| p.prefill == from).for_each(|p| p.deadline_ms = deadline_ms);
    }

    /// Nothing more can land from prefill `from` (its KV connection closed, or it left
    /// without ever opening one): its pending transfers fail and its quarantines end.
    fn prefill_fenced(&mut self, pool: &mut KvPool, from: WorkerId, out: &mut Vec<DecodeAction>) {
        self.closed_prefills.insert(from);
        let reqs: Vec<RequestId> = self.pending.iter().filter(|(_, p)| p.prefill == from).map(|(r, _)| *r).collect();
        for req in reqs {
            if let Some(p) = self.pending.remove(&req) {
                self.release_seq(pool, p.inbound.into_sequence());
                out.push(failed(req, FailReason::WorkerLost, "prefill worker gone"));
            }
        }
        let reqs: Vec<RequestId> = self.fencing.iter().filter(|(_, f)| f.prefill == from).map(|(r, _)| *r).collect();
        for req in reqs {
            self.unfence(pool, req);
        }
    }

    fn reject(&mut self, req: RequestId, reason: RejectReason, detail: String) -> DecodeAction {
        match reason {
            RejectReason::ContextLength => self.stats.rejected_context += 1,
            RejectReason::Capacity => {
                self.stats.rejected_capacity += 1;
                self.owes_room = true;
            }
            RejectReason::Duplicate | RejectReason::Invalid => self.stats.rejected_invalid += 1,
        }
        DecodeAction::ToGateway(Message::Rejected { req, reason, detail })
    }

    /// The requests with a reservation, a held-back `Reserve` or a place in the decode loop
    /// here (not those whose pages only wait for their writer's fence): what ends when
    /// their gateway is lost.
    pub fn requests(&self) -> Vec<RequestId> {
        let deferred = self.deferred.iter().filter_map(Message::req);
        self.pending.keys().chain(self.decoding.keys()).copied().chain(deferred).collect()
    }

    /// Whether `req` holds anything here: a reservation, quarantined pages or a place in
    /// the decode loop.
    pub fn known(&self, req: RequestId) -> bool {
        self.state_of(req).is_some()
    }

    fn on_gateway(&mut self, pool: &mut KvPool, m: Message, out: &mut Vec<DecodeAction>) {
        match m {
            Message::Reserve { req, prompt_tokens, max_tokens, prefill, sampling, stop, resume, prompt, trace, cache } => {
                if self.known(req) {
                    out.push(self.reject(req, RejectReason::Duplicate, format!("request {req} is already in flight")));
                    return;
                }
                // Worker-side admission (I3, I5): holds even if the gateway's check is off.
                let total = match admit(prompt_tokens as usize, Generate::Tokens(max_tokens as usize), self.cfg.max_context) {
                    Ok(total) => total,
                    Err(refusal) => {
                        out.push(self.reject(req, refusal.reason(), format!("{refusal} (decode worker)")));
                        return;
                    }
                };
                // KV on demand: the prompt and a first page of output now; the decode loop
                // grows the sequence page by page, and retracts one when it cannot.
                let first_slice = (prompt_tokens as usize + pool.layout().page_size).min(total);
                if resume.len() >= prompt_tokens as usize {
                    out.push(self.reject(
                        req,
                        RejectReason::Invalid,
                        format!("{} resumed tokens in a prompt of {prompt_tokens}", resume.len()),
                    ));
                    return;
                }
                let cache = cache.filter(|_| self.cache.is_some());
                let attempt_prompt: Vec<u32> = prompt.iter().chain(&resume).copied().collect();
                if cache.is_some() && attempt_prompt.len() != prompt_tokens as usize {
                    let why = format!("{} prompt tokens sent for a prompt of {prompt_tokens}", attempt_prompt.len());
                    out.push(self.reject(req, RejectReason::Invalid, why));
                    return;
                }
                if self.awaits_sibling(pool, cache, &attempt_prompt) {
                    let m = Message::Reserve { req, prompt_tokens, max_tokens, prefill, sampling, stop, resume, prompt, trace, cache };
                    self.deferred.push(m);
                    return;
                }
                let shared = match self.shared_prefix(pool, req, cache, &attempt_prompt, first_slice) {
                    Ok(shared) => shared,
                    Err(e) => {
                        out.push(failed(req, FailReason::Internal, format!("decode-side cache lookup refused: {e}")));
                        return;
                    }
                };
                match Inbound::reserve_after(pool, req, shared, prompt_tokens as usize, first_slice) {
                    Ok(inbound) => {
                        self.stats.reserved += 1;
                        let ps = pool.layout().page_size;
                        let held = inbound.shared_tokens();
                        self.stats.held_tokens += held as u64;
                        let rest = prompt_tokens as usize - held;
                        // Only with a cache hit: a miss goes to a prefill worker whatever its
                        // length, and that worker's cache learns the prompt.
                        let local = held > 0 && rest <= self.cfg.local_prefill_tokens && attempt_prompt.len() == prompt_tokens as usize;
                        let inbound = match if local { inbound.compute_here() } else { Err(inbound) } {
                            Ok(seq) => {
                                self.stats.local_prefills += 1;
                                self.stats.local_prefill_tokens += rest as u64;
                                let publish = cache.map(|scope| (scope, prompt.clone()));
                                let computing = publish.is_some();
                                self.decoding.insert(req, Decoding { cached: held as u32, publish, computing });
                                out.push(DecodeAction::ToGateway(Message::Reserved {
                                    req,
                                    held: held as u32,
                                    pages: Vec::new(),
                                    local: true,
                                }));
                                let start = LocalStart { req, seq, tokens: attempt_prompt, max_tokens, sampling, stop, resume };
                                out.push(DecodeAction::StartLocal(start));
                                return;
                            }
                            Err(inbound) => inbound,
                        };
                        let pages = inbound.prompt_pages(ps);
                        let deadline_ms = self.now_ms.saturating_add(self.cfg.transfer_timeout_ms);
                        let publish = cache.map(|scope| (scope, prompt.clone()));
                        let pending = Pending { inbound, prefill, max_tokens, sampling, stop, resume, prompt, publish, deadline_ms };
                        self.pending.insert(req, pending);
                        out.push(DecodeAction::ToGateway(Message::Reserved { req, held: held as u32, pages, local: false }));
                    }
                    Err((e, shared)) => {
                        shared.into_iter().for_each(|l| drop(pool.unshare(l)));
                        match e {
                            KvError::Exhausted { requested, free } => {
                                let why = format!("needs {requested} KV pages, {free} free");
                                out.push(self.reject(req, RejectReason::Capacity, why));
                            }
                            e => out.push(self.reject(req, RejectReason::Invalid, e.to_string())),
                        }
                    }
                }
            }
            // Held back: nothing was reserved, nothing is owed.
            Message::Cancel { req } | Message::Abort { req, .. } if self.deferred.iter().any(|m| m.req() == Some(req)) => {
                self.deferred.retain(|m| m.req() != Some(req));
            }
            // The gateway never dispatched this reservation: no writer knows its pages. If
            // chunks did land, someone did write, so keep waiting for the fence instead.
            Message::Cancel { req } => {
                if self.pending.get(&req).is_some_and(|p| p.inbound.written_tokens() == 0) {
                    if let Some(p) = self.pending.remove(&req) {
                        self.release_seq(pool, p.inbound.into_sequence());
                    }
                } else if self.pending.contains_key(&req) {
                    if let Some(p) = self.pending.remove(&req) {
                        self.quarantine(pool, req, p);
                    }
                } else if self.fencing.get(&req).is_some_and(|f| f.received == 0) {
                    self.unfence(pool, req);
                } else if self.decoding.remove(&req).is_some() {
                    out.push(DecodeAction::Stop { req });
                }
            }
            Message::Abort { req, .. } => {
                if let Some(p) = self.pending.remove(&req) {
                    // The prefill may still be writing: quarantine until it is fenced (I4).
                    self.quarantine(pool, req, p);
                } else if self.decoding.remove(&req).is_some() {
                    out.push(DecodeAction::Stop { req });
                }
            }
            _ => {}
        }
    }

    fn on_prefill(&mut self, pool: &mut KvPool, from: WorkerId, m: Message, out: &mut Vec<DecodeAction>) {
        match m {
            Message::KvChunk { req, header, data } => {
                let Some(p) = self.pending.get_mut(&req) else {
                    self.stats.late_chunks += 1;
                    return;
                };
                let verdict = if p.prefill != from {
                    Err(ChunkRefusal::WrongSender { from, assigned: p.prefill })
                } else {
                    p.inbound.accept(pool, &header, &data).map_err(ChunkRefusal::from)
                };
                if let Err(ChunkRefusal::Transfer(TransferError::Checksum { .. })) = &verdict {
                    self.stats.checksum_failed += 1;
                }
                match verdict {
                    Ok(()) => self.stats.chunks_verified += 1,
                    Err(why) => {
                        self.stats.chunks_refused += 1;
                        if let Some(p) = self.pending.remove(&req) {
                            let prefill = p.prefill;
                            self.quarantine(pool, req, p);
                            out.push(failed(req, FailReason::TransferRefused, why.to_string()));
                            out.push(DecodeAction::ToPrefill { to: prefill, msg: Message::Abort { req, reason: AbortReason::Failed } });
                        }
                    }
                }
            }
            Message::Done { req, tokens, first_token, manifest, cached, first_logprobs } => {
                if self.pending.get(&req).is_some_and(|p| p.prefill == from) {
                    let Some(p) = self.pending.remove(&req) else { return };
                    // Done is the sender's last message for req: from here it is fenced.
                    let sent = p.inbound.written_tokens();
                    match p.inbound.finish(pool, tokens as usize, manifest) {
                        Ok(mut seq) => {
                            self.publish_verified(pool, &mut seq, p.publish.as_ref(), &p.resume);
                            self.stats.coverage_verified += 1;
                            self.stats.transferred_tokens += sent as u64;
                            self.decoding.insert(req, Decoding { cached: cached.min(tokens), publish: p.publish, computing: false });
                            out.push(DecodeAction::Start(DecodeStart {
                                req,
                                seq,
                                first_token,
                                first_logprobs,
                                max_tokens: p.max_tokens,
                                sampling: p.sampling,
                                stop: p.stop,
                                resume: p.resume,
                                prompt: p.prompt,
                            }));
                        }
                        Err((e, seq)) => {
                            self.stats.coverage_failed += 1;
                            self.release_seq(pool, seq);
                            out.push(failed(req, FailReason::TransferRefused, e.to_string()));
                        }
                    }
                } else if self.fencing.get(&req).is_some_and(|f| f.prefill == from) {
                    self.unfence(pool, req);
                }
            }
            Message::Fenced { req } => {
                if self.pending.get(&req).is_some_and(|p| p.prefill == from) {
                    // The prefill gave the request up: it refused it (and told the gateway
                    // why), failed it (likewise), or was told to stop. The terminal outcome
                    // comes from there; a second one from here could race it and replace a
                    // 400 with a 503 (found by the model checker).
                    if let Some(p) = self.pending.remove(&req) {
                        self.release_seq(pool, p.inbound.into_sequence());
                    }
                } else if self.fencing.get(&req).is_some_and(|f| f.prefill == from) {
                    self.unfence(pool, req);
                }
            }
            _ => {}
        }
    }

    /// The cached pages of the prompt `tokens` this worker holds under `scope`, shared to
    /// `req` read-only (none without a scope), and room made for the rest of `total` tokens
    /// by evicting pages nobody reads (with a cache). A lookup the pool's fence refuses
    /// (a key that led to another scope's page) fails the request.
    fn shared_prefix(
        &mut self,
        pool: &mut KvPool,
        req: RequestId,
        scope: Option<CacheScope>,
        tokens: &[u32],
        total: usize,
    ) -> Result<Vec<bulkhead_kv::SharedLease>, KvError> {
        let Some(c) = self.cache.as_mut() else { return Ok(Vec::new()) };
        let shared = match scope {
            Some(scope) => {
                let ps = pool.layout().page_size;
                let keys = scope.page_keys(c.model_digest, tokens, ps);
                // The last position is always sent: its logits pick the first token.
                let most = tokens.len().saturating_sub(1) / ps;
                c.cache.lookup(pool, &keys, most, req, scope.fence(), tokens.len())?
            }
            None => Vec::new(),
        };
        // A cache under pressure gives way: what a cold pool would serve is served.
        c.cache.make_room(pool, pool.layout().pages_for_tokens(total).saturating_sub(shared.len()));
        Ok(shared)
    }

    /// Whether a `Reserve` of `scope` for `tokens` should wait: the first full page it misses
    /// here is one a transfer of its scope under way will land, or one the loop is computing
    /// here (a sibling of `n > 1`, or the same prompt sent twice at once); once that transfer
    /// is verified ([`DecodeRole::publish_verified`]) or that compute done
    /// ([`DecodeRole::publish_local`]) its pages are published and this one shares them.
    fn awaits_sibling(&self, pool: &KvPool, scope: Option<CacheScope>, tokens: &[u32]) -> bool {
        let (Some(c), Some(scope)) = (self.cache.as_ref(), scope) else { return false };
        let ps = pool.layout().page_size;
        let keys = scope.page_keys(c.model_digest, tokens, ps);
        let lookup = tokens.len().saturating_sub(1) / ps;
        let Some(missing) = keys.iter().take(lookup).find(|k| !c.cache.contains(k)) else { return false };
        let lands = |publish: &Option<(CacheScope, Vec<u32>)>, resume: &[u32]| match publish {
            Some((s, prompt)) if *s == scope => {
                let theirs: Vec<u32> = prompt.iter().chain(resume).copied().collect();
                let full = theirs.len() / ps;
                scope.page_keys(c.model_digest, &theirs, ps).iter().take(full).any(|k| k == missing)
            }
            _ => false,
        };
        self.pending.values().any(|p| lands(&p.publish, &p.resume)) || self.decoding.values().any(|d| d.computing && lands(&d.publish, &[]))
    }

    /// A verified prompt's own full pages go to the cache now, not when the request ends,
    /// so a sibling held back for them shares them while this one decodes.
    fn publish_verified(
        &mut self,
        pool: &mut KvPool,
        seq: &mut VerifiedSequence,
        publish: Option<&(CacheScope, Vec<u32>)>,
        resume: &[u32],
    ) {
        let (Some(c), Some((scope, prompt))) = (self.cache.as_mut(), publish) else { return };
        let tokens: Vec<u32> = prompt.iter().chain(resume).copied().collect();
        let keys = scope.page_keys(c.model_digest, &tokens, pool.layout().page_size);
        seq.publish_prompt(pool, &mut c.cache, &keys, scope.fence());
    }

    fn quarantine(&mut self, pool: &mut KvPool, req: RequestId, p: Pending) {
        // Its writer's connection is already closed: no fence will ever come, and none is
        // needed (found by the model checker: such pages used to stay quarantined for ever).
        if self.closed_prefills.contains(&p.prefill) {
            self.release_seq(pool, p.inbound.into_sequence());
            return;
        }
        let received = p.inbound.written_tokens();
        let pages = match p.inbound.into_sequence().quarantine(pool) {
            Ok(pages) => pages,
            // Leases this role made are live unless the pool was tampered with; keep them
            // out of circulation rather than free anything we cannot account for.
            Err(u) => pool.revoke_owner(u.seq.owner()),
        };
        self.stats.pages_quarantined += pages.len() as u64;
        self.fencing.insert(req, Fencing { pages, prefill: p.prefill, received });
    }

    fn unfence(&mut self, pool: &mut KvPool, req: RequestId) {
        if let Some(f) = self.fencing.remove(&req) {
            for q in f.pages {
                if pool.release_quarantined(q).is_ok() {
                    self.stats.fenced_releases += 1;
                }
            }
        }
    }

    fn release_seq(&mut self, pool: &mut KvPool, seq: SequenceKv) {
        if let Err(u) = seq.release(pool) {
            // Unreachable with live leases; never leave pages leased to a dead request.
            u.reclaim(pool);
        }
    }
}
