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
//!
//! # Layout
//! - here: the vocabulary (configuration, events, client outputs, actions, counters) and
//!   the role's state, its constructor and read-only accessors;
//! - `ids`: client request ids, attempt ids and the gateway each belongs to, and where a
//!   worker's message to "the gateway" goes ([`gateways_for`]);
//! - `tenants`: the tenants' queues, limits, token buckets and recent use (which tenant's
//!   queue is served next);
//! - `routing`: sending queued requests on, to which decode and prefill worker;
//! - `events`: the role's event handling: admission, membership, workers' messages,
//!   requeues, migrations and each request's one terminal outcome.

use bulkhead_fingerprint::Fingerprint;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bulkhead_kv::{PageKey, RequestId};

use crate::cache::CacheScope;
use crate::msg::*;

mod events;
mod ids;
mod routing;
mod tenants;

pub use ids::{CLIENT_ID_LIMIT, attempt_id, client_of, gateway_of, gateways_for, request_id, request_number};
pub use routing::BALANCE_ABS_THRESHOLD;
use tenants::{Bucket, Usage};
pub use tenants::{IMPLICIT_COMPLETION_CHARGE, TenantId, TenantPolicy, USAGE_HALF_LIFE_MS};

/// Limits of the gateway.
#[derive(Clone, Debug, Fingerprint)]
pub struct GatewayConfig {
    /// The model's context. The served context is this or the smallest any registered
    /// worker accepts, whichever is smaller (I5).
    pub model_context: usize,
    /// Digest of the model file; a worker serving another model is refused.
    pub model_digest: u64,
    /// Admission, timeouts, the queue, migration and the prefill window.
    pub settings: GatewaySettings,
    /// Each tenant's share and limits; a tenant not named here has weight 1 and none.
    pub tenants: BTreeMap<TenantId, TenantPolicy>,
}

/// The gateway's own settings, declared once: the gateway process is given them (with its
/// flags) and hands them to its role as they are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub struct GatewaySettings {
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
            .all(|r| self.lost_since_ms[role_index(r)].is_some_and(|t| self.now_ms.saturating_sub(t) < self.cfg.settings.queue_timeout_ms))
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

    /// The request whose current attempt is `attempt`.
    fn current(&self, attempt: RequestId) -> Option<&InFlight> {
        let f = self.inflight.get(&client_of(attempt))?;
        (attempt_id(client_of(attempt), f.attempt) == attempt).then_some(f)
    }
}
