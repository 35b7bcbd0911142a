//! The gateway's state machine: worker membership, a bounded queue of requests waiting for
//! capacity, routing each to one decode and one prefill worker, and exactly one terminal
//! outcome per request to the client (I3).
//!
//! Lifecycle of a request: `Queued` → `Reserving` (Reserve sent to decode) → `Prefilling`
//! (Prefill sent) → `Decoding` (tokens flowing) → terminal. It goes back to `Queued`, as a
//! new *attempt*, when the decode worker has no room for it now (`Rejected(Capacity)`),
//! when the decode loop retracted it to let others grow (`Retracted`: it resumes from the
//! tokens it already generated), when its prefill worker left before `Prefill` was sent,
//! and once when its prefill worker was lost before any token reached the client. A
//! request leaves the table at its terminal outcome; anything arriving for it afterwards
//! is ignored, so a second terminal outcome cannot reach the client.
//!
//! Fairness: each tenant has its own queue, first come first served within it (lower
//! `priority` first). The next request comes from the tenant with the least recent prefill
//! use per unit of weight ([`USAGE_HALF_LIFE_MS`], [`TenantPolicy::weight`]), ties going to
//! the first after the tenant served last; so a light tenant's burst goes ahead of a tenant
//! that keeps the server busy, two busy tenants share by weight, and nothing reorders a
//! queue by what is cached. Routing: a request goes to the decode worker, and to the
//! prefill worker, that reported the longest run of its page keys cached (`CacheReport`),
//! unless the prefill workers' loads are out of balance; keys are scoped by tenant and
//! salt, so what another tenant cached never moves a request.
//!
//! Attempts: workers know a request by its attempt id ([`attempt_id`]): the client's id
//! for the first attempt, the client's id with the attempt number in the high bits for
//! later ones. Messages about an earlier attempt are ignored, so a late report from a
//! worker that lost an attempt cannot end the one that replaced it.

use bulkhead_fingerprint::Fingerprint;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bulkhead_kv::{PageKey, RequestId};

use crate::admission::{Generate, admit};
use crate::cache::CacheScope;
use crate::msg::*;

/// A tenant, as the API layer numbers them (from the API key, never from the body).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Fingerprint)]
pub struct TenantId(pub u32);

/// Prefill loads (requests routed and not yet streaming) further apart than this are out
/// of balance: the least loaded worker wins over cache affinity (after SGLang's router,
/// scaled to a few workers).
pub const BALANCE_ABS_THRESHOLD: usize = 2;

/// Client request ids must stay below this; the bits above hold the attempt number.
pub const CLIENT_ID_LIMIT: u64 = 1 << 48;

/// Where a client request id holds its gateway ([`GatewayId`]): the 8 bits below
/// [`CLIENT_ID_LIMIT`]'s.
const GATEWAY_SHIFT: u32 = 40;

/// The id of the `n`th client request (from 1) of gateway `gateway`: its number in the
/// low 40 bits, the gateway above them. Gateway 0's ids are its numbers.
pub fn request_id(gateway: GatewayId, n: u64) -> RequestId {
    RequestId((u64::from(gateway.0) << GATEWAY_SHIFT) | (n % (1 << GATEWAY_SHIFT)))
}

/// A request's number at its gateway (its attempts share it).
pub fn request_number(req: RequestId) -> u64 {
    req.0 % (1 << GATEWAY_SHIFT)
}

/// The gateway a request (or an attempt of it) came from: its messages go there.
pub fn gateway_of(req: RequestId) -> GatewayId {
    GatewayId(((req.0 % CLIENT_ID_LIMIT) >> GATEWAY_SHIFT) as u8)
}

/// Where a worker's message to "the gateway" goes, among the gateways it is registered
/// with (each given with what the caller writes to it through, `T`): a request's message
/// (any attempt's) to the gateway that made the request ([`gateway_of`]) only, or nowhere
/// when that gateway is not among them (its requests on the worker were ended with its
/// connection); anything else (load, cache reports, room) to every one, in their order.
/// The worker's gateway links, the fault schedules and the model checker all route by it.
pub fn gateways_for<T, I>(msg: &Message, registered: I) -> impl Iterator<Item = T> + use<T, I>
where
    I: IntoIterator<Item = (GatewayId, T)>,
{
    let to = msg.req().map(gateway_of);
    registered.into_iter().filter(move |(g, _)| to.is_none_or(|t| t == *g)).map(|(_, t)| t)
}

/// The id workers know attempt `n` (0 = the first) of client request `client` by.
pub fn attempt_id(client: RequestId, n: u32) -> RequestId {
    RequestId((client.0 % CLIENT_ID_LIMIT) | (u64::from(n) << 48))
}

/// The client request an attempt id belongs to.
pub fn client_of(attempt: RequestId) -> RequestId {
    RequestId(attempt.0 % CLIENT_ID_LIMIT)
}

/// Limits of the gateway.
#[derive(Clone, Debug, Fingerprint)]
pub struct GatewayConfig {
    /// The model's context. The served context is this or the smallest any registered
    /// worker accepts, whichever is smaller (I5).
    pub model_context: usize,
    /// Digest of the model file; a worker serving another model is refused.
    pub model_digest: u64,
    /// Whether the gateway checks the context limit itself (tests turn it off to show the
    /// workers' own admission holds).
    pub admission_check: bool,
    /// A request not finished after this long fails.
    pub request_timeout_ms: u64,
    /// Requests one tenant may have waiting for capacity at once; one more is refused
    /// (HTTP 429).
    pub max_queued: usize,
    /// How long a request may wait in the queue before it is refused (HTTP 429).
    pub queue_timeout_ms: u64,
    /// How many times one request may move to another decode worker because the one it
    /// was on was lost (I11); past that, it fails as before.
    pub migration_limit: u32,
    /// Prompt tokens a prefill worker is given at once (being reserved for, queued there or
    /// computed); a prompt that would pass it waits in the gateway's queue, where tenants
    /// are served by recent use per weight, unless the worker has none. 0: no window (every prompt goes on
    /// at once and waits in the prefill worker's own first-come queue).
    pub prefill_window_tokens: usize,
    /// Each tenant's share and limits; a tenant not named here has weight 1 and none.
    pub tenants: BTreeMap<TenantId, TenantPolicy>,
}

/// A tenant's share of the queue and its limits (the tenants file's `weight`,
/// `max_concurrent_requests`, `tokens_per_minute`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub struct TenantPolicy {
    /// Its share of the queue, at least 1: the queue serves next the tenant whose recent
    /// prefill use divided by its weight is least.
    pub weight: u32,
    /// Requests it may have in flight (queued or running) at once.
    pub max_concurrent_requests: Option<u32>,
    /// Prompt tokens plus `max_tokens` it may be charged per minute (a token bucket of that
    /// size refilled at that rate); what a request did not use is refunded when it ends.
    pub tokens_per_minute: Option<u64>,
}

impl Default for TenantPolicy {
    fn default() -> Self {
        TenantPolicy { weight: 1, max_concurrent_requests: None, tokens_per_minute: None }
    }
}

/// A tenant's token bucket, in token-milliminutes: a full bucket holds `tokens_per_minute`
/// × 60,000 and refills by `tokens_per_minute` every millisecond, so integers suffice. The
/// level goes below zero when a request used more than it was charged at admission (a
/// request without `max_tokens` is charged an estimate): the debt delays the next request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
struct Bucket {
    level: i64,
    #[fingerprint(clock)]
    at_ms: u64,
}

const MS_PER_MINUTE: u64 = 60_000;

/// Completion tokens charged at admission for a request that did not set `max_tokens`
/// (the official clients' default), on top of its prompt; its real use is settled when it
/// ends. Charging the rest of the context instead would make such a request larger than a
/// small tenant's whole budget, refused for ever.
pub const IMPLICIT_COMPLETION_CHARGE: u32 = 256;

/// How fast a tenant's recent use of prefill ([`Usage`]) is forgotten: it halves every this
/// many milliseconds. Long against a prompt's prefill (a second or two), so a light tenant
/// keeps its credit through a burst of its own; short against a busy tenant's minutes.
pub const USAGE_HALF_LIFE_MS: u64 = 30_000;

/// A tenant's recent use of prefill: the prompt tokens the queue gave it, halving every
/// [`USAGE_HALF_LIFE_MS`]. The queue serves the tenant with the least use per weight.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Fingerprint)]
struct Usage {
    tokens: u64,
    #[fingerprint(clock)]
    at_ms: u64,
}

impl Usage {
    /// The tokens left at `now_ms`: halved per half-life passed, and linearly within one
    /// (1 − x/2 for a fraction x of a half-life, close to 2^−x and exact at 0 and 1).
    fn at(self, now_ms: u64) -> u64 {
        let passed = now_ms.saturating_sub(self.at_ms);
        let halvings = passed / USAGE_HALF_LIFE_MS;
        let t = if halvings >= 64 { 0 } else { self.tokens >> halvings };
        let rest = passed % USAGE_HALF_LIFE_MS;
        t - (u128::from(t) * u128::from(rest) / u128::from(2 * USAGE_HALF_LIFE_MS)) as u64
    }
}

/// A request as the gateway admits it: what the client asked for, tokenised, with the
/// tenant its key named and the cache scope derived from them. The HTTP side builds it
/// once; the gateway's role keeps it as is for the request's life, and builds every
/// attempt's `Reserve` and `Prefill` from it, adding what it owns (ids, route, resumed
/// tokens).
#[derive(Clone, Debug, Fingerprint)]
pub struct Submission {
    /// The prompt's tokens.
    pub tokens: Vec<u32>,
    /// Tokens to generate at most: the client's `max_tokens`, or the rest of the context.
    pub max_tokens: u32,
    /// Whether the client set `max_tokens` (else its tenant's bucket is charged
    /// [`IMPLICIT_COMPLETION_CHARGE`] at admission).
    pub max_tokens_set: bool,
    /// How tokens are chosen (seeded: the API draws a seed for a request without one).
    pub sampling: Sampling,
    /// Stop strings.
    pub stop: Vec<String>,
    /// The request's trace, request id and tenant name, for every process's logs.
    pub trace: TraceContext,
    /// The tenant its API key named (never its body).
    pub tenant: TenantId,
    /// Its prefix-cache scope (tenant and salt under the cluster's secret); none with the
    /// cache off.
    pub cache: Option<CacheScope>,
    /// Its place within its tenant's queue: lower first (vLLM's `priority`, default 0).
    pub priority: i64,
}

/// What happened at the gateway.
#[derive(Debug)]
pub enum GatewayEvent {
    /// A client asked for a generation; `req` is the gateway's id for it.
    Submit { req: RequestId, submission: Submission },
    /// The client went away.
    ClientGone { req: RequestId },
    /// A worker sent a message.
    FromWorker { from: WorkerId, msg: Message },
    /// A worker's connection closed.
    WorkerLeft { id: WorkerId },
    /// The clock moved.
    Tick { now_ms: u64 },
}

/// A tenant's limit that a request is over at admission.
enum OverLimit {
    /// For now (HTTP 429).
    Busy(BusyReason, String),
    /// For ever: it is larger than the tenant's whole bucket (HTTP 400).
    Never(String),
}

/// `tokens` in the buckets' unit (token-milliminutes), saturating.
fn milli_minutes(tokens: u64) -> i64 {
    i64::try_from(tokens.saturating_mul(MS_PER_MINUTE)).unwrap_or(i64::MAX)
}

/// Why a request is turned away for now (HTTP 429, with `Retry-After`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub enum BusyReason {
    /// The queue is full.
    QueueFull,
    /// It waited in the queue for the queue timeout.
    QueueTimeout,
    /// Its tenant has `max_concurrent_requests` in flight.
    ConcurrencyLimit,
    /// Its tenant's `tokens_per_minute` would be exceeded; enough is refilled in
    /// `retry_after_s` seconds.
    TokenLimit { retry_after_s: u32 },
}

impl BusyReason {
    /// The error `code` clients see.
    pub fn code(self) -> &'static str {
        match self {
            BusyReason::QueueFull => "queue_full",
            BusyReason::QueueTimeout => "queue_timeout",
            BusyReason::ConcurrencyLimit => "concurrency_limit_exceeded",
            BusyReason::TokenLimit { .. } => "tokens_per_minute_exceeded",
        }
    }

    /// Seconds the client should wait before retrying (`Retry-After`).
    pub fn retry_after_s(self) -> u32 {
        match self {
            BusyReason::TokenLimit { retry_after_s } => retry_after_s.max(1),
            _ => 1,
        }
    }
}

/// The one terminal outcome of a request, or a streamed token.
#[derive(Clone, Debug, PartialEq)]
pub enum ClientOutput {
    /// One generated token, the text it released, and its log-probabilities when the
    /// request asked for them.
    Token { token: u32, text: String, logprobs: Option<TokenLogprobs> },
    /// Ended normally. `cached_tokens`: prompt tokens its prefill took from the cache.
    Finished { finish: FinishReason, text: String, prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32 },
    /// Refused before running (over-context: HTTP 400).
    Rejected { reason: RejectReason, detail: String },
    /// Failed while running.
    Failed { reason: FailReason, detail: String },
    /// Turned away for now: too much is waiting (HTTP 429).
    Busy { reason: BusyReason, detail: String },
    /// Larger than its tenant's whole `tokens_per_minute`: it can never be admitted, so
    /// no retry helps (HTTP 400).
    OverBudget { detail: String },
    /// No worker of a needed role is registered (HTTP 503); `detail` says whether the
    /// server is starting or lost its workers, and since when.
    Unavailable { detail: String },
}

impl ClientOutput {
    /// Whether this ends the request.
    pub fn is_terminal(&self) -> bool {
        !matches!(self, ClientOutput::Token { .. })
    }
}

/// What the driver must do.
#[derive(Debug, PartialEq)]
pub enum GatewayAction {
    /// Send to a worker.
    ToWorker { to: WorkerId, msg: Message },
    /// Deliver to the client of `req`.
    ToClient { req: RequestId, out: ClientOutput },
}

/// Where a request stands at the gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Fingerprint)]
pub enum Phase {
    /// Waiting for capacity (or for workers).
    Queued,
    /// `Reserve` sent to the decode worker; no `Prefill` sent yet.
    Reserving,
    /// `Prefill` sent; no token yet.
    Prefilling,
    /// Tokens flowing.
    Decoding,
}

/// The KV layout every worker of one gateway must share.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub struct KvShape {
    /// Tokens per page.
    pub page_size: u32,
    /// KV bytes per token.
    pub kv_bytes_per_token: u32,
}

/// Why a worker was refused at registration.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// It serves another model file.
    #[error("model digest {worker:#x} differs from the gateway's {gateway:#x}")]
    Model { worker: u64, gateway: u64 },
    /// Its KV layout differs from the workers already registered.
    #[error(
        "KV layout (page size {}, {} bytes/token) differs from the registered workers' ({}, {})",
        worker.page_size, worker.kv_bytes_per_token, registered.page_size, registered.kv_bytes_per_token
    )]
    Layout { worker: KvShape, registered: KvShape },
    /// The id is taken.
    #[error("{0} is already registered")]
    Duplicate(WorkerId),
}

/// A registered worker.
#[derive(Clone, Debug, Fingerprint)]
struct Member {
    role: Role,
    max_context: usize,
    kv_addr: String,
}

/// The workers an attempt went to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
struct Route {
    decode: WorkerId,
    /// The decode worker itself when it computes the prompt (`Reserved.local`).
    prefill: WorkerId,
}

#[derive(Debug, Fingerprint)]
struct InFlight {
    /// What the client asked for, as admitted.
    sub: Submission,
    phase: Phase,
    /// The current attempt's number (its id is [`attempt_id`] of the client's and this).
    attempt: u32,
    /// Where the current attempt went; `None` while queued.
    route: Option<Route>,
    /// Tokens generated by earlier attempts (the client has them): they end the next
    /// attempt's prompt.
    resume: Vec<u32>,
    /// Every token forwarded to the client, earlier attempts' included: what a migrated
    /// attempt resumes from.
    sent: Vec<u32>,
    /// Times it moved off a lost decode worker.
    migrations: u32,
    /// Tokens charged to its tenant's bucket at admission (prompt + `max_tokens`, or +
    /// [`IMPLICIT_COMPLETION_CHARGE`] when the client did not set it).
    charged: u64,
    #[fingerprint(clock)]
    deadline_ms: u64,
    /// When it began waiting for room: set when queued, kept while decode workers refuse
    /// it for want of room (so being offered around does not restart the queue timeout),
    /// cleared when one reserves pages for it.
    queued_at_ms: Option<u64>,
    /// It was sent again after losing its prefill worker (once at most).
    retried: bool,
    /// A decode worker has refused it for want of room (counted once in the stats).
    waited_for_room: bool,
    /// A prefill worker not to send its next attempt to (the one it lost).
    avoid: Option<WorkerId>,
    /// The key of its prompt's first page, once routed (derived from the submission's tokens and cache scope):
    /// a request of the same scope and first page sent meanwhile goes to the same decode
    /// worker, to share the pages this one's transfer lands there (the siblings of `n > 1`).
    #[fingerprint(skip)]
    first_key: Option<PageKey>,
}

/// Counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GatewayStats {
    /// Requests submitted.
    pub submitted: u64,
    /// Refused by the gateway's own admission check.
    pub rejected_at_gateway: u64,
    /// Refused by a worker.
    pub rejected_by_worker: u64,
    /// Finished normally.
    pub finished: u64,
    /// Failed while running.
    pub failed: u64,
    /// Ended because the client left.
    pub client_gone: u64,
    /// Turned away: the queue was full.
    pub queue_full: u64,
    /// Turned away: waited for the queue timeout.
    pub queue_timeouts: u64,
    /// Requests sent back to the queue because a decode worker had no room for them, each
    /// counted once however often it was offered around again.
    pub requeued_capacity: u64,
    /// Retracted by a decode worker and queued to resume.
    pub retracted: u64,
    /// Sent again after losing their prefill worker.
    pub retried: u64,
    /// Moved to another decode worker after losing theirs (I11).
    pub migrated: u64,
    /// Turned away by their tenant's `max_concurrent_requests` or `tokens_per_minute`.
    pub over_limit: u64,
    /// Sent to the prefill worker with the longest cached prefix of theirs (a hit > 0).
    pub routed_by_cache: u64,
    /// Sent to the decode worker with the longest cached prefix of theirs (a hit > 0).
    pub decode_routed_by_cache: u64,
    /// Sent to the least loaded prefill worker because loads were out of balance.
    pub routed_by_load: u64,
    /// Requests that left the queue, for a decode worker's pages or by timing out, by how
    /// long they waited: one slot per bucket of [`QUEUE_WAIT_BUCKETS`] (not cumulative),
    /// then those past the last bound.
    pub queue_waits: [u64; QUEUE_WAIT_BUCKETS.len() + 1],
    /// The sum of those waits, in milliseconds.
    pub queue_wait_ms_total: u64,
}

/// Upper bounds, in seconds, of the buckets of [`GatewayStats::queue_waits`].
pub const QUEUE_WAIT_BUCKETS: &[f64] = &[0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

/// Count a wait in the queue that began at `since_ms` and ends at `now_ms`.
fn record_queue_wait(stats: &mut GatewayStats, since_ms: u64, now_ms: u64) {
    let ms = now_ms.saturating_sub(since_ms);
    let i = QUEUE_WAIT_BUCKETS.partition_point(|b| *b < ms as f64 / 1000.0);
    stats.queue_waits[i] += 1;
    stats.queue_wait_ms_total = stats.queue_wait_ms_total.saturating_add(ms);
}

/// The gateway's protocol state.
#[derive(Debug, Fingerprint)]
pub struct GatewayRole {
    cfg: GatewayConfig,
    /// This gateway's number, told to each worker in its `Welcome`.
    id: GatewayId,
    #[fingerprint(clock)]
    now_ms: u64,
    /// The served context (see [`GatewayConfig::model_context`]).
    max_context: usize,
    /// The layout of the first registered worker, which every later one must share.
    shape: Option<KvShape>,
    members: BTreeMap<WorkerId, Member>,
    prefills: Vec<WorkerId>,
    decodes: Vec<WorkerId>,
    /// When the last worker of each role (prefill, decode) left, while none is registered.
    lost_since_ms: [Option<u64>; 2],
    #[fingerprint(turn)]
    next_pick: usize,
    /// By client request id.
    inflight: BTreeMap<RequestId, InFlight>,
    /// Client request ids waiting for capacity, one queue per tenant, each first come
    /// first served; the tenant of least recent use per weight goes next.
    queues: BTreeMap<TenantId, VecDeque<RequestId>>,
    /// The tenant whose queue was served last (among tenants of equal use per weight, the
    /// next one after it goes first).
    last_served: Option<TenantId>,
    /// Each tenant's recent use of prefill, for the queue's order.
    usage: BTreeMap<TenantId, Usage>,
    /// Token buckets of the tenants with `tokens_per_minute`.
    buckets: BTreeMap<TenantId, Bucket>,
    /// Page keys each prefill worker reported cached.
    cached: BTreeMap<WorkerId, BTreeSet<PageKey>>,
    /// Decode workers that refused or retracted for lack of room since they last freed
    /// something (or since the last tick): not sent new reservations meanwhile.
    full: BTreeSet<WorkerId>,
    /// (prefill, decode) pairs whose KV connection the prefill worker reported lost: no
    /// request takes that route until the prefill worker rejoins under a new id.
    unreachable: BTreeSet<(WorkerId, WorkerId)>,
    #[fingerprint(skip)]
    stats: GatewayStats,
}

fn role_index(r: Role) -> usize {
    usize::from(r == Role::Decode)
}

fn role_name(r: Role) -> &'static str {
    match r {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

impl GatewayRole {
    /// A gateway with no workers.
    pub fn new(cfg: GatewayConfig) -> Self {
        GatewayRole {
            max_context: cfg.model_context,
            cfg,
            id: GatewayId::default(),
            now_ms: 0,
            shape: None,
            members: BTreeMap::new(),
            prefills: Vec::new(),
            decodes: Vec::new(),
            lost_since_ms: [None, None],
            next_pick: 0,
            inflight: BTreeMap::new(),
            queues: BTreeMap::new(),
            last_served: None,
            usage: BTreeMap::new(),
            buckets: BTreeMap::new(),
            cached: BTreeMap::new(),
            full: BTreeSet::new(),
            unreachable: BTreeSet::new(),
            stats: GatewayStats::default(),
        }
    }

    /// The same role as gateway `id` of a cluster with several (gateway 0 by default).
    pub fn with_id(mut self, id: GatewayId) -> Self {
        self.id = id;
        self
    }

    /// Counters.
    pub fn stats(&self) -> GatewayStats {
        self.stats
    }

    /// The served context: the model's, or the smallest any registered worker accepts.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Requests not yet terminal (queued ones included).
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Requests waiting in the queues.
    pub fn queued(&self) -> usize {
        self.queues.values().map(VecDeque::len).sum()
    }

    /// How long each queued request has waited, in milliseconds.
    pub fn queue_waits_ms(&self) -> impl Iterator<Item = u64> + '_ {
        self.queues.values().flatten().filter_map(|r| self.inflight.get(r)?.queued_at_ms).map(|t| self.now_ms.saturating_sub(t))
    }

    /// Takes `req` out of whichever queue holds it.
    fn unqueue(&mut self, req: RequestId) {
        for q in self.queues.values_mut() {
            q.retain(|r| *r != req);
        }
        self.queues.retain(|_, q| !q.is_empty());
    }

    /// The next tenant to serve: of those with anything queued, the one that used least
    /// prefill lately per unit of weight (a light tenant's burst goes ahead of a tenant
    /// that keeps the server busy; two busy tenants share by weight), the first after the
    /// last served among equals.
    fn next_tenant(&self) -> Option<TenantId> {
        let key = |t: TenantId| {
            let used = self.usage.get(&t).map_or(0, |u| u.at(self.now_ms));
            (u128::from(used) << 32) / u128::from(self.policy(t).weight.max(1))
        };
        let waiting = self.queues.iter().filter(|(_, q)| !q.is_empty()).map(|(t, _)| *t);
        let (after, upto): (Vec<TenantId>, Vec<TenantId>) = waiting.partition(|t| self.last_served.is_some_and(|l| *t > l));
        // Round-robin order from the one after the last served; `min_by_key` keeps the first
        // of equal keys.
        after.into_iter().chain(upto).min_by_key(|t| key(*t))
    }

    fn policy(&self, tenant: TenantId) -> TenantPolicy {
        self.cfg.tenants.get(&tenant).copied().unwrap_or_default()
    }

    /// The tenant's limits at admission: `Some` when over one, else the request is charged
    /// to its bucket. A refusal leaves nothing charged.
    fn over_limit(&mut self, f: &mut InFlight) -> Option<OverLimit> {
        let policy = self.policy(f.sub.tenant);
        if let Some(most) = policy.max_concurrent_requests {
            let running = self.inflight.values().filter(|o| o.sub.tenant == f.sub.tenant).count();
            if running >= most as usize {
                let detail = format!("this tenant has {running} requests in flight, its max_concurrent_requests is {most}");
                return Some(OverLimit::Busy(BusyReason::ConcurrencyLimit, detail));
            }
        }
        let tpm = policy.tokens_per_minute?.max(1);
        let now = self.now_ms;
        let full = milli_minutes(tpm);
        let bucket = self.buckets.entry(f.sub.tenant).or_insert(Bucket { level: full, at_ms: now });
        // `tpm` token-milliminutes a millisecond.
        let refill = i64::try_from(now.saturating_sub(bucket.at_ms).saturating_mul(tpm)).unwrap_or(i64::MAX);
        bucket.level = bucket.level.saturating_add(refill).min(full);
        bucket.at_ms = now;
        let (completion, what) = if f.sub.max_tokens_set {
            (f.sub.max_tokens, "prompt and max_tokens")
        } else {
            (f.sub.max_tokens.min(IMPLICIT_COMPLETION_CHARGE), "prompt and an estimate of the completion, as max_tokens is not set")
        };
        let tokens = f.sub.tokens.len() as u64 + u64::from(completion);
        let cost = milli_minutes(tokens);
        if cost > full {
            let detail = format!(
                "this request counts {tokens} tokens ({what}), more than this tenant's tokens_per_minute of {tpm}: it can never be admitted; send a shorter prompt or a smaller max_tokens"
            );
            return Some(OverLimit::Never(detail));
        }
        if cost > bucket.level {
            // Refilled at `tpm` per ms: whole seconds until it holds `cost`; finite, as the
            // cost fits a full bucket and a debt is at most one context's tokens.
            let wait_ms = (cost.saturating_sub(bucket.level)).unsigned_abs().div_ceil(tpm);
            let retry_after_s = u32::try_from(wait_ms.div_ceil(1000)).unwrap_or(u32::MAX);
            let detail = format!(
                "this request counts {tokens} tokens ({what}); this tenant's tokens_per_minute ({tpm}) allows it in {retry_after_s} s"
            );
            return Some(OverLimit::Busy(BusyReason::TokenLimit { retry_after_s }, detail));
        }
        bucket.level -= cost;
        f.charged = tokens;
        None
    }

    /// Ends `req`'s record and settles its tenant's bucket: the prompt and the tokens it
    /// generated are used; what it was charged beyond that goes back, what it used beyond
    /// its charge (an estimate, when `max_tokens` was not set) is taken (the level may go
    /// below zero).
    fn end(&mut self, req: &RequestId) -> Option<InFlight> {
        let f = self.inflight.remove(req)?;
        let used = (f.sub.tokens.len() + f.sent.len()) as u64;
        let tpm = self.cfg.tenants.get(&f.sub.tenant).and_then(|p| p.tokens_per_minute);
        if let (Some(b), Some(tpm), true) = (self.buckets.get_mut(&f.sub.tenant), tpm, f.charged > 0) {
            let settle = milli_minutes(f.charged).saturating_sub(milli_minutes(used));
            b.level = b.level.saturating_add(settle).min(milli_minutes(tpm));
        }
        Some(f)
    }

    /// Where the request that workers know as `attempt` stands, if that attempt is current.
    pub fn phase_of(&self, attempt: RequestId) -> Option<Phase> {
        self.current(attempt).map(|f| f.phase)
    }

    /// Registered workers of `role`, in the order they joined.
    pub fn workers(&self, role: Role) -> &[WorkerId] {
        match role {
            Role::Prefill => &self.prefills,
            Role::Decode => &self.decodes,
        }
    }

    /// Whether at least one worker of each role is registered.
    pub fn ready(&self) -> bool {
        !self.prefills.is_empty() && !self.decodes.is_empty()
    }

    /// Whether every role without a worker lost its last one less than the queue timeout
    /// ago (so one may rejoin while a request waits).
    fn may_rejoin(&self) -> bool {
        [Role::Prefill, Role::Decode]
            .into_iter()
            .filter(|r| self.workers(*r).is_empty())
            .all(|r| self.lost_since_ms[role_index(r)].is_some_and(|t| self.now_ms.saturating_sub(t) < self.cfg.queue_timeout_ms))
    }

    /// Why requests cannot be served now, if no worker of a role is registered: the server
    /// is starting (none ever registered), or lost its last one this long ago.
    pub fn unavailable(&self) -> Option<String> {
        [Role::Prefill, Role::Decode]
            .into_iter()
            .filter(|r| self.workers(*r).is_empty())
            .map(|r| match self.lost_since_ms[role_index(r)] {
                None => format!("the server is starting: no {} worker has registered yet", role_name(r)),
                Some(t) => format!(
                    "no {} worker is registered: the last one was lost {:.1} s ago",
                    role_name(r),
                    self.now_ms.saturating_sub(t) as f64 / 1000.0
                ),
            })
            .next()
    }

    /// Register a worker from its `Hello`, under the id it names: refused if it serves
    /// another model or KV layout, or a live worker has that id. On success: its
    /// `Welcome`, the introductions that let prefill workers open KV connections to decode
    /// workers (`DecodePeer`), and any queued requests it lets go.
    pub fn join(&mut self, hello: &Hello) -> Result<Vec<GatewayAction>, RegisterError> {
        let id = hello.worker;
        if hello.model_digest != self.cfg.model_digest {
            return Err(RegisterError::Model { worker: hello.model_digest, gateway: self.cfg.model_digest });
        }
        let worker = KvShape { page_size: hello.page_size, kv_bytes_per_token: hello.kv_bytes_per_token };
        match self.shape {
            Some(registered) if registered != worker => return Err(RegisterError::Layout { worker, registered }),
            _ => {}
        }
        if self.members.contains_key(&id) {
            return Err(RegisterError::Duplicate(id));
        }
        self.shape = Some(worker);
        let mut out = vec![GatewayAction::ToWorker { to: id, msg: Message::Welcome { gateway: self.id } }];
        match hello.role {
            Role::Prefill => {
                for (&d, m) in self.members.iter().filter(|(_, m)| m.role == Role::Decode) {
                    out.push(GatewayAction::ToWorker { to: id, msg: Message::DecodePeer { worker: d, addr: m.kv_addr.clone() } });
                }
                self.prefills.push(id);
            }
            Role::Decode => {
                for &p in &self.prefills {
                    out.push(GatewayAction::ToWorker { to: p, msg: Message::DecodePeer { worker: id, addr: hello.kv_addr.clone() } });
                }
                self.decodes.push(id);
            }
        }
        self.lost_since_ms[role_index(hello.role)] = None;
        let member = Member { role: hello.role, max_context: hello.max_context as usize, kv_addr: hello.kv_addr.clone() };
        self.members.insert(id, member);
        self.update_context();
        self.dispatch(&mut out);
        Ok(out)
    }

    /// The served context is the smallest any worker accepts (I5).
    fn update_context(&mut self) {
        let workers = self.members.values().map(|m| m.max_context).min();
        self.max_context = workers.unwrap_or(self.cfg.model_context).min(self.cfg.model_context);
    }

    /// Process one event.
    pub fn handle(&mut self, ev: GatewayEvent) -> Vec<GatewayAction> {
        let mut out = Vec::new();
        match ev {
            GatewayEvent::Submit { req, submission } => {
                let f = InFlight {
                    sub: submission,
                    phase: Phase::Queued,
                    attempt: 0,
                    route: None,
                    resume: Vec::new(),
                    deadline_ms: self.now_ms.saturating_add(self.cfg.request_timeout_ms),
                    queued_at_ms: Some(self.now_ms),
                    retried: false,
                    waited_for_room: false,
                    sent: Vec::new(),
                    migrations: 0,
                    charged: 0,
                    avoid: None,
                    first_key: None,
                };
                self.submit(req, f, &mut out);
            }
            GatewayEvent::ClientGone { req } => {
                if let Some(f) = self.end(&req) {
                    self.stats.client_gone += 1;
                    self.unqueue(req);
                    Self::abort_workers(req, &f, AbortReason::ClientGone, None, &mut out);
                }
            }
            GatewayEvent::FromWorker { from, msg } => self.on_worker(from, msg, &mut out),
            GatewayEvent::WorkerLeft { id } => self.worker_left(id, &mut out),
            GatewayEvent::Tick { now_ms } => {
                self.now_ms = now_ms;
                // A tenant whose use has faded away and who waits for nothing is forgotten.
                let queues = &self.queues;
                self.usage.retain(|t, u| u.at(now_ms) > 0 || queues.contains_key(t));
                self.expire(&mut out);
                // Capacity may have freed without a word from the decode worker (a request
                // it held failed on another path): try again.
                self.full.clear();
                self.dispatch(&mut out);
            }
        }
        out
    }

    fn submit(&mut self, req: RequestId, f: InFlight, out: &mut Vec<GatewayAction>) {
        self.stats.submitted += 1;
        if self.cfg.admission_check
            && let Err(refusal) = admit(f.sub.tokens.len(), Generate::Tokens(f.sub.max_tokens as usize), self.max_context)
        {
            // Rejected before any Reserve (I3, I5).
            self.stats.rejected_at_gateway += 1;
            return out.push(Self::reject(req, refusal.reason(), refusal.to_string()));
        }
        if self.inflight.contains_key(&req) || req.0 >= CLIENT_ID_LIMIT {
            let detail = format!("request id {req} is in use or out of range");
            return out.push(GatewayAction::ToClient { req, out: ClientOutput::Unavailable { detail } });
        }
        // A role that never had a worker: the server is starting, say so at once. A role
        // that lost its last worker: wait in the queue for one to rejoin (a restarted worker
        // takes seconds), up to the queue timeout.
        if let Some(detail) = self.unavailable().filter(|_| !self.may_rejoin()) {
            return out.push(GatewayAction::ToClient { req, out: ClientOutput::Unavailable { detail } });
        }
        let waiting = self.queues.get(&f.sub.tenant).map_or(0, VecDeque::len);
        if waiting >= self.cfg.max_queued {
            self.stats.queue_full += 1;
            let detail = format!("{waiting} requests of this tenant are waiting, the most this server queues per tenant");
            return out.push(GatewayAction::ToClient { req, out: ClientOutput::Busy { reason: BusyReason::QueueFull, detail } });
        }
        let mut f = f;
        if let Some(over) = self.over_limit(&mut f) {
            self.stats.over_limit += 1;
            let out_ = match over {
                OverLimit::Busy(reason, detail) => ClientOutput::Busy { reason, detail },
                OverLimit::Never(detail) => ClientOutput::OverBudget { detail },
            };
            return out.push(GatewayAction::ToClient { req, out: out_ });
        }
        // Within the tenant's queue, lower priority values first, first come first served
        // among equals, never ahead of a request sent back to the queue (it was admitted
        // before); another tenant's queue is never affected.
        let inflight = &self.inflight;
        let queue = self.queues.entry(f.sub.tenant).or_default();
        let behind = |o: &InFlight| o.attempt == 0 && o.sub.priority > f.sub.priority;
        let at = queue.iter().position(|r| inflight.get(r).is_some_and(behind)).unwrap_or(queue.len());
        queue.insert(at, req);
        self.inflight.insert(req, f);
        self.dispatch(out);
    }

    /// Send queued requests on while a decode worker may have room: the tenant of least
    /// recent use per weight goes next, and each queue is first come, first served (a head that does not fit holds
    /// the others back, so a long prompt is not overtaken for ever by short ones).
    fn dispatch(&mut self, out: &mut Vec<GatewayAction>) {
        while let Some(tenant) = self.next_tenant() {
            let Some(&req) = self.queues.get(&tenant).and_then(VecDeque::front) else { return };
            let Some(route) = self.pick(req) else { return };
            if !self.prefill_has_room(req, route.prefill) {
                // It waits here, in its tenant's turn, not in the prefill worker's queue
                // behind another tenant's burst; the next prompt to end frees the window.
                return;
            }
            self.last_served = Some(tenant);
            let tokens = self.inflight.get(&req).map_or(0, |f| f.sub.tokens.len() + f.resume.len()) as u64;
            let now_ms = self.now_ms;
            let usage = self.usage.entry(tenant).or_default();
            *usage = Usage { tokens: usage.at(now_ms).saturating_add(tokens), at_ms: now_ms };
            self.unqueue(req);
            // Admitted against the context served when it arrived, perhaps while a role had no
            // worker; a worker that joined since may serve less (the served context is the
            // smallest any worker accepts): check again before anything is reserved (I3, I5).
            let refused = self
                .inflight
                .get(&req)
                .filter(|f| self.cfg.admission_check && f.resume.is_empty())
                .and_then(|f| admit(f.sub.tokens.len(), Generate::Tokens(f.sub.max_tokens as usize), self.max_context).err());
            if let Some(refusal) = refused {
                self.end(&req);
                self.stats.rejected_at_gateway += 1;
                out.push(Self::reject(req, refusal.reason(), refusal.to_string()));
                continue;
            }
            let Some(f) = self.inflight.get_mut(&req) else { continue };
            f.phase = Phase::Reserving;
            f.route = Some(route);
            let resumed = f.resume.len() as u32;
            let msg = Message::Reserve {
                req: attempt_id(req, f.attempt),
                prompt_tokens: f.sub.tokens.len() as u32 + resumed,
                max_tokens: f.sub.max_tokens.saturating_sub(resumed),
                prefill: route.prefill,
                sampling: f.sub.sampling.clone(),
                stop: f.sub.stop.clone(),
                resume: f.resume.clone(),
                prompt: if f.sub.sampling.needs_prompt() || f.sub.cache.is_some() { f.sub.tokens.clone() } else { Vec::new() },
                trace: f.sub.trace.clone(),
                cache: f.sub.cache,
            };
            out.push(GatewayAction::ToWorker { to: route.decode, msg });
        }
    }

    /// Where `req` goes: a decode worker that may have room (the one holding the longest
    /// cached prefix of the request's scope, else one receiving a prompt with the same first
    /// page, else round robin) and a prefill worker (not
    /// the one it lost, if another exists), chosen by [`Self::pick_prefill`].
    fn pick(&mut self, req: RequestId) -> Option<Route> {
        let decodes: Vec<WorkerId> = self.decodes.iter().copied().filter(|d| !self.full.contains(d)).collect();
        let avoid = self.inflight.get(&req).and_then(|f| f.avoid);
        if decodes.is_empty() {
            return None;
        }
        self.next_pick = self.next_pick.wrapping_add(1);
        // Round robin over the decode workers, each with the prefill workers that can still
        // reach it; the first decode worker some prefill worker reaches. One that holds a
        // cached prefix of this request's scope goes first (the sort is stable: round robin
        // among equals), so a conversation's next turn goes where its last one ended.
        let keys = self.page_keys(req);
        let first = keys.as_ref().and_then(|k| k.first().copied());
        if let Some(f) = self.inflight.get_mut(&req) {
            f.first_key = first;
        }
        // Next, one where a request with the same first page (so of the same scope) is
        // being transferred: its pages will be published there for this one to share.
        let landing = |d: WorkerId| {
            first.is_some()
                && self.inflight.iter().any(|(r, f)| {
                    *r != req
                        && f.first_key == first
                        && matches!(f.phase, Phase::Reserving | Phase::Prefilling)
                        && f.route.is_some_and(|x| x.decode == d)
                })
        };
        let start = self.next_pick % decodes.len();
        let mut order: Vec<(usize, bool, WorkerId)> =
            decodes.iter().cycle().skip(start).take(decodes.len()).map(|&d| (self.hit(d, keys.as_deref()), landing(d), d)).collect();
        order.sort_by_key(|&(hit, landing, _)| std::cmp::Reverse((hit, landing)));
        for (hit, _, decode) in order {
            let reach: Vec<WorkerId> = self.prefills.iter().copied().filter(|p| !self.unreachable.contains(&(*p, decode))).collect();
            let preferred: Vec<WorkerId> = reach.iter().copied().filter(|p| Some(*p) != avoid).collect();
            let prefills = if preferred.is_empty() { reach } else { preferred };
            if !prefills.is_empty() {
                if hit > 0 {
                    self.stats.decode_routed_by_cache += 1;
                }
                return Some(Route { decode, prefill: self.pick_prefill(keys.as_deref(), &prefills) });
            }
        }
        None
    }

    /// Whether prefill worker `p` may be given `req`'s prompt now: its prompts in flight
    /// (reserving or prefilling) and this one stay within the window, or it has none.
    fn prefill_has_room(&self, req: RequestId, p: WorkerId) -> bool {
        let window = self.cfg.prefill_window_tokens;
        if window == 0 {
            return true;
        }
        let tokens = |f: &InFlight| f.sub.tokens.len() + f.resume.len();
        let busy: usize = self
            .inflight
            .values()
            .filter(|f| f.route.is_some_and(|r| r.prefill == p) && matches!(f.phase, Phase::Reserving | Phase::Prefilling))
            .map(tokens)
            .sum();
        busy == 0 || busy + self.inflight.get(&req).map_or(0, tokens) <= window
    }

    /// The page keys of the prompt of `req`'s next attempt (the client's prompt, then what
    /// earlier attempts generated), if it uses the cache.
    fn page_keys(&self, req: RequestId) -> Option<Vec<PageKey>> {
        let (f, shape) = (self.inflight.get(&req)?, self.shape?);
        let scope = f.sub.cache?;
        let tokens: std::borrow::Cow<'_, [u32]> =
            if f.resume.is_empty() { (&f.sub.tokens[..]).into() } else { [&f.sub.tokens[..], &f.resume[..]].concat().into() };
        Some(scope.page_keys(self.cfg.model_digest, &tokens, shape.page_size as usize))
    }

    /// How many of `keys`, from the first, worker `w` reported cached. Keys are scoped by
    /// tenant and salt, so another scope's entries never count.
    fn hit(&self, w: WorkerId, keys: Option<&[PageKey]>) -> usize {
        match (keys, self.cached.get(&w)) {
            (Some(keys), Some(set)) => keys.iter().take_while(|k| set.contains(k)).count(),
            _ => 0,
        }
    }

    /// The prefill worker with the longest cached run of `keys`, ties broken by load, then
    /// round robin; the least loaded one when loads are out of balance.
    fn pick_prefill(&mut self, keys: Option<&[PageKey]>, prefills: &[WorkerId]) -> WorkerId {
        let start = self.next_pick % prefills.len();
        let order = prefills.iter().cycle().skip(start).take(prefills.len()).copied();
        let load = |p: WorkerId| {
            self.inflight
                .values()
                .filter(|f| f.route.is_some_and(|r| r.prefill == p) && matches!(f.phase, Phase::Reserving | Phase::Prefilling))
                .count()
        };
        let loads: Vec<(WorkerId, usize)> = order.map(|p| (p, load(p))).collect();
        let (min, max) = (loads.iter().map(|l| l.1).min().unwrap_or(0), loads.iter().map(|l| l.1).max().unwrap_or(0));
        let least = loads.iter().min_by_key(|l| l.1).map_or(prefills[start], |l| l.0);
        if max - min > BALANCE_ABS_THRESHOLD {
            self.stats.routed_by_load += 1;
            return least;
        }
        if keys.is_none() {
            return least;
        }
        let best = loads.iter().map(|&(p, l)| (self.hit(p, keys), std::cmp::Reverse(l), p)).max_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        match best {
            Some((h, _, p)) if h > 0 => {
                self.stats.routed_by_cache += 1;
                p
            }
            _ => least,
        }
    }

    /// Back to the queue's front as a new attempt (it was admitted before everything that
    /// waits behind it). The workers of the old attempt, but `except`, are told to let it go.
    fn requeue(&mut self, req: RequestId, except: Option<WorkerId>, out: &mut Vec<GatewayAction>) {
        let now = self.now_ms;
        let Some(f) = self.inflight.get_mut(&req) else { return };
        let old = attempt_id(req, f.attempt);
        Self::abort_attempt(old, f, AbortReason::Failed, except, out);
        f.attempt += 1;
        f.phase = Phase::Queued;
        f.route = None;
        f.queued_at_ms.get_or_insert(now);
        self.queues.entry(f.sub.tenant).or_default().push_front(req);
    }

    /// Requests that waited too long: 429 from the queue, a failure elsewhere.
    fn expire(&mut self, out: &mut Vec<GatewayAction>) {
        let now = self.now_ms;
        let waited: Vec<RequestId> = self
            .queues
            .values()
            .flatten()
            .copied()
            // A retracted request has streamed tokens: a 429 now would cut a live stream, so
            // only the request timeout bounds its wait (it waits at the queue's head).
            .filter(|r| {
                self.inflight
                    .get(r)
                    .filter(|f| f.resume.is_empty())
                    .and_then(|f| f.queued_at_ms)
                    .is_some_and(|t| t.saturating_add(self.cfg.queue_timeout_ms) <= now)
            })
            .collect();
        for req in waited {
            self.unqueue(req);
            if let Some(f) = self.end(&req) {
                self.stats.queue_timeouts += 1;
                record_queue_wait(&mut self.stats, f.queued_at_ms.unwrap_or(now), now);
                // No worker of a role came back while it waited: 503, not 429.
                let client = match self.unavailable() {
                    Some(detail) => ClientOutput::Unavailable { detail },
                    None => {
                        let detail = format!("waited {} ms in the queue for capacity", self.cfg.queue_timeout_ms);
                        ClientOutput::Busy { reason: BusyReason::QueueTimeout, detail }
                    }
                };
                out.push(GatewayAction::ToClient { req, out: client });
            }
        }
        let late: Vec<RequestId> = self.inflight.iter().filter(|(_, f)| f.deadline_ms <= now).map(|(r, _)| *r).collect();
        for req in late {
            self.fail(req, FailReason::Timeout, "request timed out".into(), None, out);
        }
    }

    fn worker_left(&mut self, id: WorkerId, out: &mut Vec<GatewayAction>) {
        let Some(left) = self.members.remove(&id) else { return };
        self.cached.remove(&id);
        self.prefills.retain(|w| *w != id);
        self.decodes.retain(|w| *w != id);
        self.full.remove(&id);
        self.unreachable.retain(|&(p, d)| p != id && d != id);
        if self.workers(left.role).is_empty() {
            self.lost_since_ms[role_index(left.role)] = Some(self.now_ms);
        }
        self.update_context();
        match left.role {
            Role::Prefill => {
                // A decode worker it never connected to has no other way to learn that it
                // can no longer write there (its quarantines would never end; found by the
                // fault schedules), nor that a connection from it still on its way must be
                // refused.
                for &to in &self.decodes {
                    out.push(GatewayAction::ToWorker { to, msg: Message::PeerLeft { worker: id } });
                }
                // Not yet sent to it: send elsewhere. Sent to it: the decode worker reports
                // whether the prompt had arrived (then it streams on) or not (then it is
                // retried, see `on_worker`).
                let waiting: Vec<RequestId> = self.routed_to(id, |p| p == Phase::Reserving);
                for req in waiting {
                    self.requeue(req, Some(id), out);
                }
            }
            Role::Decode => {
                for &to in &self.prefills {
                    out.push(GatewayAction::ToWorker { to, msg: Message::PeerLeft { worker: id } });
                }
                let lost: Vec<RequestId> = self.routed_to(id, |_| true);
                for req in lost {
                    self.migrate(req, id, out);
                }
            }
        }
        self.dispatch(out);
    }

    /// `req`'s decode worker `lost` is gone (I11): a new attempt resumes from every token
    /// the client has (as a retracted one does: same tokens, same draws skipped), unless the
    /// request moved `migration_limit` times already, or nothing is left to generate (its
    /// end was lost with the worker): then it fails as before. The new attempt waits in
    /// the queue like any other, bounded by the request timeout once it has streamed.
    fn migrate(&mut self, req: RequestId, lost: WorkerId, out: &mut Vec<GatewayAction>) {
        let Some(f) = self.inflight.get_mut(&req) else { return };
        let left = f.sub.max_tokens.saturating_sub(f.sent.len() as u32);
        if f.migrations >= self.cfg.migration_limit || left == 0 {
            let why = if left == 0 { "its last token was sent but not its end" } else { "it reached the migration limit" };
            return self.fail(req, FailReason::WorkerLost, format!("decode {lost} was lost; {why}"), Some(lost), out);
        }
        f.migrations += 1;
        f.resume = f.sent.clone();
        self.stats.migrated += 1;
        self.requeue(req, Some(lost), out);
    }

    /// Requests whose current attempt went to worker `id`, in a phase `phase` accepts.
    fn routed_to(&self, id: WorkerId, phase: impl Fn(Phase) -> bool) -> Vec<RequestId> {
        let on = |r: &Route| r.decode == id || r.prefill == id;
        self.inflight.iter().filter(|(_, f)| f.route.as_ref().is_some_and(on) && phase(f.phase)).map(|(r, _)| *r).collect()
    }

    /// Refuse `req` before anything was reserved for it (I3).
    fn reject(req: RequestId, reason: RejectReason, detail: String) -> GatewayAction {
        GatewayAction::ToClient { req, out: ClientOutput::Rejected { reason, detail } }
    }

    fn abort_workers(req: RequestId, f: &InFlight, reason: AbortReason, except: Option<WorkerId>, out: &mut Vec<GatewayAction>) {
        Self::abort_attempt(attempt_id(req, f.attempt), f, reason, except, out);
    }

    /// Tell the workers of attempt `attempt` (but `except`) to end it.
    fn abort_attempt(attempt: RequestId, f: &InFlight, reason: AbortReason, except: Option<WorkerId>, out: &mut Vec<GatewayAction>) {
        let Some(route) = f.route else { return };
        if f.phase == Phase::Reserving {
            // No Prefill was sent: no worker can write the reservation, so the decode
            // worker may release it at once instead of waiting for a fence.
            if Some(route.decode) != except {
                out.push(GatewayAction::ToWorker { to: route.decode, msg: Message::Cancel { req: attempt } });
            }
            return;
        }
        // A locally computed attempt names its decode worker twice: tell it once.
        let prefill = Some(route.prefill).filter(|p| *p != route.decode);
        for to in [Some(route.decode), prefill].into_iter().flatten().filter(|t| Some(*t) != except) {
            out.push(GatewayAction::ToWorker { to, msg: Message::Abort { req: attempt, reason } });
        }
    }

    fn fail(&mut self, req: RequestId, reason: FailReason, detail: String, except: Option<WorkerId>, out: &mut Vec<GatewayAction>) {
        if let Some(f) = self.end(&req) {
            self.unqueue(req);
            self.stats.failed += 1;
            Self::abort_workers(req, &f, AbortReason::Failed, except, out);
            out.push(GatewayAction::ToClient { req, out: ClientOutput::Failed { reason, detail } });
        }
    }

    /// The request whose current attempt is `attempt`.
    fn current(&self, attempt: RequestId) -> Option<&InFlight> {
        let f = self.inflight.get(&client_of(attempt))?;
        (attempt_id(client_of(attempt), f.attempt) == attempt).then_some(f)
    }

    fn on_worker(&mut self, from: WorkerId, msg: Message, out: &mut Vec<GatewayAction>) {
        // A prefill lost its KV connection to `decode` (or never had one): the decode worker
        // must not wait for fences from it.
        if let Message::KvLost { decode } = msg {
            if self.decodes.contains(&decode) {
                out.push(GatewayAction::ToWorker { to: decode, msg: Message::PrefillUnreachable { worker: from } });
                // New requests take other routes at once (not this one until it rejoins).
                if self.prefills.contains(&from) {
                    self.unreachable.insert((from, decode));
                }
            }
            return;
        }
        if let Message::CacheReport { stored, evicted } = msg {
            if self.prefills.contains(&from) || self.decodes.contains(&from) {
                let set = self.cached.entry(from).or_default();
                set.extend(stored);
                for k in &evicted {
                    set.remove(k);
                }
            }
            return;
        }
        if msg == Message::Room {
            if self.full.remove(&from) {
                self.dispatch(out);
            }
            return;
        }
        let Some(attempt) = msg.req() else { return };
        let req = client_of(attempt);
        // Only the workers of the current attempt speak for a request.
        let Some(route) = self.current(attempt).and_then(|f| f.route) else { return };
        if from != route.decode && from != route.prefill {
            return;
        }
        if from == route.decode && matches!(msg, Message::Finished { .. } | Message::Failed { .. } | Message::Retracted { .. }) {
            // It let go of something: it may have room again.
            self.full.remove(&from);
        }
        let Some(f) = self.inflight.get_mut(&req) else { return };
        match msg {
            Message::Reserved { local: true, .. } if f.phase == Phase::Reserving && from == route.decode => {
                // The decode worker computes the rest itself: it is this attempt's only
                // worker, and the prefill worker picked for it never hears of it.
                f.phase = Phase::Prefilling;
                f.route = Some(Route { decode: route.decode, prefill: route.decode });
                if let Some(since) = f.queued_at_ms.take() {
                    record_queue_wait(&mut self.stats, since, self.now_ms);
                }
            }
            Message::Reserved { held, pages, .. } if f.phase == Phase::Reserving && from == route.decode => {
                if !self.prefills.contains(&route.prefill) {
                    // Its prefill worker left since: send the request elsewhere.
                    return self.requeue(req, None, out);
                }
                f.phase = Phase::Prefilling;
                if let Some(since) = f.queued_at_ms.take() {
                    record_queue_wait(&mut self.stats, since, self.now_ms);
                }
                let mut tokens = f.sub.tokens.clone();
                tokens.extend_from_slice(&f.resume);
                let msg = Message::Prefill {
                    req: attempt,
                    tokens,
                    decode: route.decode,
                    held,
                    pages,
                    sampling: f.sub.sampling.clone(),
                    skip_draws: f.resume.len() as u32,
                    trace: f.sub.trace.clone(),
                    cache: f.sub.cache,
                };
                out.push(GatewayAction::ToWorker { to: route.prefill, msg });
            }
            Message::Token { token, text, logprobs, .. } if from == route.decode => {
                f.phase = Phase::Decoding;
                f.sent.push(token);
                out.push(GatewayAction::ToClient { req, out: ClientOutput::Token { token, text, logprobs } });
            }
            Message::Finished { finish, text, prompt_tokens, completion_tokens, cached_tokens, .. } if from == route.decode => {
                self.end(&req);
                self.stats.finished += 1;
                let cached_tokens = cached_tokens.min(prompt_tokens);
                out.push(GatewayAction::ToClient {
                    req,
                    out: ClientOutput::Finished { finish, text, prompt_tokens, completion_tokens, cached_tokens },
                });
            }
            Message::Retracted { tokens, .. } if from == route.decode => {
                // The decode loop gave its pages to others; it resumes from what it made.
                self.stats.retracted += 1;
                self.full.insert(from);
                f.resume = tokens;
                self.requeue(req, Some(from), out);
            }
            Message::Rejected { reason: RejectReason::Capacity, .. } if from == route.decode && f.phase == Phase::Reserving => {
                // No room there now: wait for it.
                if !f.waited_for_room {
                    f.waited_for_room = true;
                    self.stats.requeued_capacity += 1;
                }
                self.full.insert(from);
                self.requeue(req, Some(from), out);
            }
            Message::Rejected { reason, detail, .. } => {
                self.end(&req);
                self.stats.rejected_by_worker += 1;
                // A prefill rejection leaves a reservation on the decode worker.
                if from == route.prefill && from != route.decode {
                    out.push(GatewayAction::ToWorker {
                        to: route.decode,
                        msg: Message::Abort { req: attempt, reason: AbortReason::Failed },
                    });
                }
                out.push(Self::reject(req, reason, detail));
            }
            // The prompt never reached the decode worker and this attempt streamed nothing
            // (what earlier ones streamed is in `resume`): one more try, on another
            // prefill worker if there is one.
            Message::Failed { reason: FailReason::WorkerLost, .. } if !f.retried && f.phase == Phase::Prefilling => {
                self.stats.retried += 1;
                f.retried = true;
                f.avoid = Some(route.prefill);
                self.requeue(req, Some(from), out);
            }
            Message::Failed { reason, detail, .. } => self.fail(req, reason, detail, Some(from), out),
            _ => {}
        }
        self.dispatch(out);
    }
}
