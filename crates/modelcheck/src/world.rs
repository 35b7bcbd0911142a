//! The world the checker explores: the production gateway role and the production
//! prefill and decode drivers ([`bulkhead_protocol::driver`]) over real KV pools, with a
//! network between them and per-request bookkeeping that the properties read.
//!
//! Nothing here decides anything the production code decides. The transports below move
//! messages onto the network; the mock model ([`crate::drivers`]) computes KV values that
//! are a function of request and position, reads KV back through `KvPool::read` and
//! records what it saw. The broken [`Variant`]s are driver policies ([`crate::drivers`])
//! or changes to the gateway's driver here; the roles and the driver core are the
//! production ones in every variant.

use bulkhead_fingerprint::{Fingerprint, Fingerprinter};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;

use bulkhead_kv::{KvChecks, KvPool, PoolConfig, PrefixCache, RequestId};
use bulkhead_protocol::cache::CacheSecret;
use bulkhead_protocol::decode::{DecodeConfig, DecodeEvent, DecodeRole};
use bulkhead_protocol::driver::decode::{DecodeDriver, DecodeLink};
use bulkhead_protocol::driver::prefill::{Batching, LinkDown, PrefillDriver, PrefillLink, Step};
use bulkhead_protocol::gateway::{
    BusyReason, ClientOutput, GatewayAction, GatewayConfig, GatewayEvent, GatewayRole, Phase, Submission, TenantId, client_of, gateway_of,
    gateways_for, request_number,
};
use bulkhead_protocol::prefill::{PrefillConfig, PrefillEvent, PrefillRole};
use bulkhead_protocol::{FailReason, GatewayId, Hello, Message, RejectReason, Role, Sampling, TraceContext, WorkerId};

use crate::config::{Config, LAYOUT, TICK_MS, Variant};
use crate::drivers::{MockDecode, MockPrefill, Started, decode_policy, prefill_policy};
use bulkhead_protocol::driver::sabotage::{DecodeSabotage, PrefillSabotage};

/// The decode worker's id.
pub const DECODE: WorkerId = WorkerId(1);
/// First prefill worker id; the others and restarted workers follow.
const FIRST_PREFILL: u32 = 2;
/// The first token the mock prefill samples.
pub const FIRST_TOKEN: u32 = 7;
/// The model digest every worker of the model announces.
const DIGEST: u64 = 1;
/// An end of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Fingerprint)]
pub enum Node {
    /// A gateway (its index in the configuration).
    Gateway(u8),
    /// A prefill worker.
    Prefill(WorkerId),
    /// The decode worker.
    Decode,
}

/// One step of the world: the nondeterministic choices the checker makes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// A client submits its request (requests are submitted in order).
    Submit(RequestId),
    /// The client of a request goes away.
    ClientGone(RequestId),
    /// The first message (or close) on connection `from → to` arrives.
    Deliver(Node, Node),
    /// The first message on `from → to` arrives and a copy of it stays first in line.
    Duplicate(Node, Node),
    /// The first message on `from → to` is lost.
    Lose(Node, Node),
    /// The second message on `from → to` overtakes the first and arrives.
    Reorder(Node, Node),
    /// A prefill worker takes its next job, or computes and sends its running job's next
    /// page (and ends the job after the last one).
    PrefillStep(WorkerId),
    /// The decode loop runs one step of a sequence: writes the KV of its last token, attends
    /// over every position, and finishes it once it has its tokens.
    DecodeStep(RequestId),
    /// The decode worker's clock passes the transfer timeout.
    DecodeTick,
    /// The gateways' clocks pass the request timeout.
    GatewayTick,
    /// A gateway dies (see [`crate::config::Faults::gateway_losses`]).
    LoseGateway(u8),
    /// A prefill worker crashes and a fresh one registers under a new id.
    CrashPrefill(WorkerId),
    /// The close of prefill `from`'s KV connection reaches the decode worker ahead of frames
    /// it sent before closing (UCX: the frames and the control connection whose end says
    /// the peer is gone travel apart). The frames it overtook are dropped with the reader,
    /// or, in [`Variant::OneSidedWrites`], still land afterwards.
    CloseOvertakes(Node),
    /// A prefill worker's clock passes its keepalive interval.
    PrefillTick(WorkerId),
}

/// What travels on a connection.
#[derive(Clone, Debug, Fingerprint)]
pub enum Envelope {
    /// A message.
    Msg(Message),
    /// The connection closed: nothing follows.
    Closed,
}

/// The properties, each named after the invariant it checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Fingerprint)]
pub enum Prop {
    /// I1, I2: every read is of a slot leased to the reader at its generation, below the
    /// watermark, and holds the reader's own KV.
    ReadIsolation,
    /// I2: decode starts a sequence only when its verified coverage equals its reservation.
    VerifiedCoverage,
    /// I1: no page is in two leases.
    SingleLease,
    /// I4: no page returns to the free list while a chunk for it may still arrive.
    NoLateWrites,
    /// I3: a rejected request never reaches Reserve, transfer or decode.
    RejectionTerminal,
    /// I3: no request has two terminal outcomes; over-capacity never finishes.
    OneOutcome,
    /// I3: an over-capacity request the workers refuse is answered with that refusal.
    OriginalError,
    /// I7: no cache lookup reaches a page of another tenant or salt (the pool's fence
    /// never has to refuse one).
    CacheFence,
}

/// How a request ended for its client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Fingerprint)]
pub enum Outcome {
    /// Finished (HTTP 200).
    Finished,
    /// Refused before running (HTTP 4xx).
    Rejected(RejectReason),
    /// Failed while running.
    Failed(FailReason),
    /// No worker available.
    Unavailable,
    /// Turned away for now (HTTP 429).
    Busy(BusyReason),
    /// Larger than its tenant's whole token budget (HTTP 400).
    OverBudget,
}

/// What the driver has seen of one request (ghost state for the properties).
#[derive(Clone, Debug, Default, PartialEq, Eq, Fingerprint)]
pub struct Ghost {
    /// Submitted by its client.
    pub submitted: bool,
    /// Its client went away.
    pub client_gone: bool,
    /// Terminal outcomes delivered to the client, in order.
    pub outcomes: Vec<Outcome>,
    /// Prompt tokens of the reservation the decode worker granted.
    pub reserved_prompt: Option<usize>,
    /// The attempt (worker-side id) of the latest reservation; `landed` counts its chunks.
    pub attempt: Option<RequestId>,
    /// Tokens the decode worker generated before it last retracted the request (they
    /// end the prompt of the attempt that resumes it).
    pub resumed: usize,
    /// Prompt tokens in chunks of `attempt` the decode verifier accepted.
    pub landed: usize,
    /// Leading prompt tokens of `attempt` the decode worker said it held in its cache.
    pub held: usize,
    /// The decode worker said it computes the rest of `attempt`'s prompt itself.
    pub local: bool,
    /// A role decided to reject it (the gateway told the client, or a worker refused it
    /// for context or capacity): from here it must not reach Reserve, transfer or decode.
    pub rejected: bool,
    /// The gateway driver retried it (the `RetryAfterReject` variant).
    pub retried: bool,
    /// A prefill step computed a chunk of it together with another job's chunk, in one
    /// pass (batched prefill).
    pub batched: bool,
}

/// A live handle on a decode page: a lease or a quarantine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Handle {
    page: u32,
    generation: u64,
    owner: RequestId,
    quarantined: bool,
}

/// A way a chunk for a decode page may still arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct WriteRef {
    page: u32,
    generation: u64,
    req: RequestId,
    via: &'static str,
}

/// The prefill driver's budget in the model: a page of each job and two pages in all per
/// step, so two jobs of one prefill worker can share a step (batched prefill).
const BATCHING: Batching = Batching { chunk_tokens: LAYOUT.page_size, step_tokens: 2 * LAYOUT.page_size };

struct PrefillWorker {
    id: WorkerId,
    driver: PrefillDriver<PrefillSabotage>,
    pool: KvPool,
    now: u64,
}

type Decode = DecodeDriver<MockDecode, DecodeSabotage>;

/// Remaining fault budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Fingerprint)]
struct Budget {
    client_aborts: u8,
    lose: u8,
    duplicate: u8,
    reorder: u8,
    prefill_crashes: u8,
    decode_ticks: u8,
    gateway_ticks: u8,
    prefill_ticks: u8,
    close_overtakes: u8,
    gateway_losses: u8,
}

type Net = BTreeMap<(Node, Node), VecDeque<Envelope>>;

/// The production roles and drivers and their pools, the network between them, and what
/// the driver saw.
pub struct World<'c> {
    cfg: &'c Config,
    /// The gateways, by index; a dead one keeps its last state and is never run again.
    gws: Vec<GatewayRole>,
    dead: BTreeSet<u8>,
    gw_now: u64,
    prefills: Vec<PrefillWorker>,
    next_worker: u32,
    dec: Decode,
    dec_now: u64,
    net: Net,
    ghosts: BTreeMap<RequestId, Ghost>,
    budget: Budget,
    violations: BTreeMap<Prop, String>,
    /// The mock model's values, of the configuration's requests.
    values: Values,
}

fn pool(pages: usize) -> KvPool {
    KvPool::new(PoolConfig { layout: LAYOUT, pages, checks: KvChecks::all() }).expect("model pool")
}

/// The mock model's KV values, per request of a configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Values(Vec<(u32, Option<u8>)>);

impl Values {
    /// The values of `cfg`'s requests.
    pub fn new(cfg: &Config) -> Self {
        Values(cfg.requests.iter().map(|r| (r.prompt, r.tenant)).collect())
    }

    /// The K and V value every layer holds for attempt `req` at `pos`. Distinct for every
    /// (request, attempt, position) of the model and exact in f16 (below 2048), so a read
    /// of another attempt's KV is caught too; except the prompt positions of a request
    /// that uses the prefix cache, which hold its tenant's value (its tenant's requests
    /// share one prompt, as a cached page shares them), so a read of another tenant's
    /// cached page is caught.
    pub fn of(&self, req: RequestId, pos: usize) -> f32 {
        let client = request_number(req);
        let scoped = usize::try_from(client).ok().and_then(|c| self.0.get(c.checked_sub(1)?));
        if let Some(&(prompt, Some(tenant))) = scoped
            && pos < prompt as usize
        {
            return 1_024.0 + f32::from(tenant) * 16.0 + pos as f32;
        }
        let attempt = req.0 / bulkhead_protocol::gateway::CLIENT_ID_LIMIT;
        ((client * 8 + attempt) * 16 + pos as u64) as f32
    }
}

/// Request ids of a configuration: request `index` is number `index + 1` of gateway
/// `index % gateways` (1, 2, ... with one gateway).
pub fn request_id(cfg: &Config, index: usize) -> RequestId {
    bulkhead_protocol::gateway::request_id(GatewayId((index % cfg.gateways.max(1)) as u8), index as u64 + 1)
}

/// Puts `m` on the connection `from → to`, unless `to` is a prefill worker that is gone (a
/// write to a closed socket).
fn put(net: &mut Net, alive: &Reach, from: Node, to: Node, m: Message) {
    match to {
        Node::Prefill(id) if !alive.prefills.contains(&id) => return,
        Node::Gateway(g) if !alive.gateways.contains(&g) => return,
        _ => {}
    }
    net.entry((from, to)).or_default().push_back(Envelope::Msg(m));
}

/// The processes a message can still be written to: live prefill workers and gateways.
struct Reach {
    prefills: BTreeSet<WorkerId>,
    gateways: BTreeSet<u8>,
}

impl Reach {
    /// Where a worker's message to "the gateway" goes: the live gateways that
    /// [`gateways_for`] picks, as the production worker's gateway links do.
    fn gateways_for<'r>(&'r self, msg: &Message) -> impl Iterator<Item = Node> + use<'r> {
        gateways_for(msg, self.gateways.iter().map(|&g| (GatewayId(g), Node::Gateway(g))))
    }
}

/// A prefill worker's transport: onto the network, watching for chunks of requests that
/// were rejected (I3). Its KV connection to the decode worker is open from its start.
struct PrefillWire<'a> {
    me: WorkerId,
    net: &'a mut Net,
    alive: &'a Reach,
    ghosts: &'a BTreeMap<RequestId, Ghost>,
    seen: Vec<(Prop, String)>,
}

impl PrefillLink for PrefillWire<'_> {
    fn to_gateway(&mut self, msg: Message) {
        for to in self.alive.gateways_for(&msg) {
            put(self.net, self.alive, Node::Prefill(self.me), to, msg.clone());
        }
    }

    fn to_decode(&mut self, to: WorkerId, msg: Message) -> Result<(), LinkDown> {
        if to != DECODE {
            return Err(LinkDown(to));
        }
        if let Message::KvChunk { req, .. } = &msg
            && self.ghosts.get(&client_of(*req)).is_some_and(|g| g.rejected)
        {
            self.seen.push((Prop::RejectionTerminal, format!("chunk for {req} sent after it was rejected")));
        }
        put(self.net, self.alive, Node::Prefill(self.me), Node::Decode, msg);
        Ok(())
    }

    /// Registration is atomic in the model: a worker's KV connection is open from its
    /// start, so no introduction ever arrives.
    fn connect(&mut self, _: WorkerId, _: &str) {}

    /// KV connections are never cut in the model, so no worker rejoins.
    fn rejoin(&mut self) {}
}

/// The decode worker's transport: onto the network, keeping the ghost state of
/// reservations and refusals.
struct DecodeWire<'a> {
    cfg: &'a Config,
    net: &'a mut Net,
    alive: &'a Reach,
    ghosts: &'a mut BTreeMap<RequestId, Ghost>,
    seen: Vec<(Prop, String)>,
}

impl DecodeLink for DecodeWire<'_> {
    fn to_gateway(&mut self, msg: Message) {
        match &msg {
            Message::Rejected { req, reason, .. } => worker_rejected(self.ghosts, client_of(*req), *reason),
            Message::Retracted { req, tokens } => self.ghosts.entry(client_of(*req)).or_default().resumed = tokens.len(),
            Message::Reserved { req, held, local, .. } => {
                let client = client_of(*req);
                let g = self.ghosts.entry(client).or_default();
                if g.rejected {
                    self.seen.push((Prop::RejectionTerminal, format!("decode reserved pages for {client} after it was rejected")));
                }
                g.reserved_prompt = request(self.cfg, client).map(|r| r.prompt as usize + g.resumed);
                if g.attempt != Some(*req) {
                    g.attempt = Some(*req);
                    g.landed = 0;
                }
                g.held = *held as usize;
                g.local = *local;
            }
            _ => {}
        }
        for to in self.alive.gateways_for(&msg) {
            put(self.net, self.alive, Node::Decode, to, msg.clone());
        }
    }

    fn to_prefill(&mut self, to: WorkerId, msg: Message) {
        put(self.net, self.alive, Node::Decode, Node::Prefill(to), msg);
    }

    /// Connections are open from a worker's start in the model, never refused.
    fn disconnect(&mut self, _: WorkerId) {}
}

/// A worker refused a request. Refusing it for its context decides the request's fate
/// (I3); a refusal for capacity means "not now" (the gateway queues it again), and one of
/// a duplicate message is about the message: those become the request's fate only if the
/// gateway passes them to the client.
fn worker_rejected(ghosts: &mut BTreeMap<RequestId, Ghost>, req: RequestId, reason: RejectReason) {
    if reason == RejectReason::ContextLength {
        ghosts.entry(req).or_default().rejected = true;
    }
}

/// Where the decode driver's actions go when it is told of a connection (none come).
struct Nowhere;

impl DecodeLink for Nowhere {
    fn to_gateway(&mut self, _: Message) {}
    fn to_prefill(&mut self, _: WorkerId, _: Message) {}
    fn disconnect(&mut self, _: WorkerId) {}
}

fn request(cfg: &Config, req: RequestId) -> Option<crate::config::Request> {
    cfg.requests.get((request_number(req) as usize).checked_sub(1)?).copied()
}

impl<'c> World<'c> {
    /// The initial world: every worker registered, every KV connection open, nothing
    /// submitted.
    pub fn new(cfg: &'c Config) -> Self {
        let gateway = GatewayConfig {
            model_context: cfg.gateway_max_context,
            model_digest: DIGEST,
            admission_check: cfg.gateway_admission,
            request_timeout_ms: TICK_MS,
            max_queued: cfg.requests.len(),
            queue_timeout_ms: TICK_MS,
            migration_limit: 3,
            prefill_window_tokens: cfg.prefill_window_tokens,
            tenants: Default::default(),
        };
        let mut gws: Vec<GatewayRole> =
            (0..cfg.gateways.max(1)).map(|g| GatewayRole::new(gateway.clone()).with_id(GatewayId(g as u8))).collect();
        let dpool = pool(cfg.decode_pool_pages);
        // Registration is atomic here: its welcomes and introductions are not modelled.
        for gw in &mut gws {
            let registered = gw.join(&Hello::for_pool(Role::Decode, DECODE, DIGEST, &dpool, cfg.decode_max_context, String::new()));
            assert!(registered.is_ok(), "the decode worker registers: {registered:?}");
        }
        let role = DecodeRole::new(DecodeConfig {
            max_context: cfg.decode_max_context,
            transfer_timeout_ms: TICK_MS,
            local_prefill_tokens: cfg.decode_local_prefill,
        });
        let role = if cfg.decode_cache { role.with_cache(PrefixCache::new(cfg.decode_pool_pages), DIGEST) } else { role };
        let mut dec = DecodeDriver::with_policy(role, MockDecode::new(dpool, cfg.variant, Values::new(cfg)), decode_policy(cfg.variant));
        let mut prefills = Vec::new();
        for i in 0..cfg.prefill_workers {
            let id = WorkerId(FIRST_PREFILL + i as u32);
            prefills.push(Self::start_prefill(cfg, &mut gws, &mut dec, id));
        }
        let f = cfg.faults;
        World {
            cfg,
            gws,
            dead: BTreeSet::new(),
            gw_now: 0,
            next_worker: FIRST_PREFILL + cfg.prefill_workers as u32,
            prefills,
            dec,
            dec_now: 0,
            net: BTreeMap::new(),
            ghosts: (0..cfg.requests.len()).map(|i| (request_id(cfg, i), Ghost::default())).collect(),
            budget: Budget {
                client_aborts: f.client_aborts,
                lose: f.lose,
                duplicate: f.duplicate,
                reorder: f.reorder,
                prefill_crashes: f.prefill_crashes,
                decode_ticks: f.decode_ticks,
                gateway_ticks: f.gateway_ticks,
                prefill_ticks: f.prefill_ticks,
                close_overtakes: f.close_overtakes,
                gateway_losses: f.gateway_losses,
            },
            violations: BTreeMap::new(),
            values: Values::new(cfg),
        }
    }

    /// A prefill worker that registered with every gateway in `gws` and opened its KV
    /// connection to the decode worker (atomically: nothing can happen in between in the
    /// model).
    fn start_prefill<'g>(
        cfg: &Config,
        gws: impl IntoIterator<Item = &'g mut GatewayRole>,
        dec: &mut Decode,
        id: WorkerId,
    ) -> PrefillWorker {
        let ppool = pool(cfg.prefill_pool_pages);
        for gw in gws {
            let registered = gw.join(&Hello::for_pool(Role::Prefill, id, DIGEST, &ppool, cfg.prefill_max_prompt, String::new()));
            assert!(registered.is_ok(), "a prefill worker registers: {registered:?}");
        }
        let mut role =
            PrefillRole::new(PrefillConfig { max_prompt: cfg.prefill_max_prompt, page_size: LAYOUT.page_size, keepalive_ms: TICK_MS });
        role.handle(PrefillEvent::DecodeConnected { decode: DECODE });
        dec.handle(DecodeEvent::PrefillConnected { from: id }, &mut Nowhere);
        let driver = PrefillDriver::with_policy(role, BATCHING, prefill_policy(cfg.variant));
        let driver = if cfg.prefix_cache { driver.with_cache(PrefixCache::new(cfg.prefill_pool_pages), DIGEST) } else { driver };
        PrefillWorker { id, driver, pool: ppool, now: 0 }
    }

    /// The world after `history`, replayed from the initial one.
    pub fn replay(cfg: &'c Config, history: &[Action]) -> Self {
        let mut w = World::new(cfg);
        for a in history {
            w.apply(a);
        }
        w
    }

    // ---------------------------------------------------------------- observation

    /// Violations recorded so far on the way to this world, by property (the first reason).
    pub fn violations(&self) -> &BTreeMap<Prop, String> {
        &self.violations
    }

    /// What the driver saw of each request.
    pub fn ghosts(&self) -> &BTreeMap<RequestId, Ghost> {
        &self.ghosts
    }

    fn violate(&mut self, p: Prop, why: String) {
        self.violations.entry(p).or_insert(why);
    }

    fn violate_all(&mut self, seen: Vec<(Prop, String)>) {
        for (p, why) in seen {
            self.violate(p, why);
        }
    }

    fn ghost(&mut self, req: RequestId) -> &mut Ghost {
        self.ghosts.entry(req).or_default()
    }

    fn alive(&self) -> Reach {
        let gateways = (0..self.gws.len() as u8).filter(|g| !self.dead.contains(g)).collect();
        Reach { prefills: self.prefills.iter().map(|p| p.id).collect(), gateways }
    }

    /// The index of the gateway `req` belongs to.
    fn gateway_index(req: RequestId) -> usize {
        usize::from(gateway_of(req).0)
    }

    fn send(&mut self, from: Node, to: Node, m: Message) {
        let alive = self.alive();
        put(&mut self.net, &alive, from, to, m);
    }

    // ---------------------------------------------------------------- enabled actions

    /// Every action the checker may take next, in a deterministic order.
    pub fn enabled(&self) -> Vec<Action> {
        if let Some(a) = self.ignorable() {
            return vec![a];
        }
        let mut out = Vec::new();
        if let Some((&req, _)) = self.ghosts.iter().find(|(_, g)| !g.submitted) {
            out.push(Action::Submit(req));
        }
        if self.budget.client_aborts > 0 {
            for (&req, g) in &self.ghosts {
                if g.submitted && !g.client_gone && g.outcomes.is_empty() {
                    out.push(Action::ClientGone(req));
                }
            }
        }
        for (&(from, to), q) in &self.net {
            let Some(head) = q.front() else { continue };
            out.push(Action::Deliver(from, to));
            let head_is_msg = matches!(head, Envelope::Msg(_));
            if head_is_msg && self.budget.duplicate > 0 {
                out.push(Action::Duplicate(from, to));
            }
            if head_is_msg && self.budget.lose > 0 {
                out.push(Action::Lose(from, to));
            }
            if head_is_msg && self.budget.reorder > 0 && matches!(q.get(1), Some(Envelope::Msg(_))) {
                out.push(Action::Reorder(from, to));
            }
        }
        for p in &self.prefills {
            if p.driver.has_work() {
                out.push(Action::PrefillStep(p.id));
            }
        }
        for &req in self.dec.engine().running.keys() {
            out.push(Action::DecodeStep(req));
        }
        // A tick with nothing waiting only moves the clock; leaving it out loses no
        // behaviour (a later useful tick is the same choice).
        if self.budget.decode_ticks > 0 && self.dec.role().pending() > 0 {
            out.push(Action::DecodeTick);
        }
        if self.budget.gateway_ticks > 0 && self.live_gateways().any(|g| g.in_flight() > 0) {
            out.push(Action::GatewayTick);
        }
        // A gateway dies while it has something in flight (dying idle only ends the
        // checker's world early), and never the last one.
        if self.budget.gateway_losses > 0 && self.dead.len() + 1 < self.gws.len() {
            for (g, gw) in self.gws.iter().enumerate() {
                if !self.dead.contains(&(g as u8)) && gw.in_flight() > 0 {
                    out.push(Action::LoseGateway(g as u8));
                }
            }
        }
        // A keepalive re-arms only reservations waiting for that prefill; one sent while
        // none waits changes nothing the properties see but the network.
        if self.budget.prefill_ticks > 0 {
            for p in &self.prefills {
                if self.dec.role().awaits(p.id) {
                    out.push(Action::PrefillTick(p.id));
                }
            }
        }
        if self.budget.close_overtakes > 0 {
            for (&(from, to), q) in &self.net {
                if matches!(from, Node::Prefill(_)) && to == Node::Decode && q.iter().skip(1).any(|e| matches!(e, Envelope::Closed)) {
                    out.push(Action::CloseOvertakes(from));
                }
            }
        }
        if self.budget.prefill_crashes > 0 {
            for p in &self.prefills {
                let involved = p.driver.has_work()
                    || p.driver.role().busy()
                    || self.net.keys().any(|(a, b)| *a == Node::Prefill(p.id) || *b == Node::Prefill(p.id));
                if involved {
                    out.push(Action::CrashPrefill(p.id));
                }
            }
        }
        out
    }

    /// Partial-order reduction. A message at the head of a connection that its receiver
    /// will ignore whenever it arrives changes nothing but that connection, which no other
    /// action reads before it is delivered; delivering it commutes with every other action
    /// and is invisible to every property, so from such a state exploring only that
    /// delivery loses no behaviour (an ample set of one action; the model is acyclic).
    /// Losing or duplicating such a message leads to the same world with less fault budget
    /// left, whose behaviours are a subset. A message is ignored for ever when:
    ///
    /// - to the gateway: the gateway no longer tracks its request (`on_worker` drops it),
    ///   and requests are never submitted twice;
    /// - to the decode worker from a prefill worker: a `Done`/`Fenced` for a request neither
    ///   pending nor fencing; with exactly-once delivery no `Reserve` for it can follow (its
    ///   `Prefill` was sent after `Reserved`). Chunks are never taken this way, even late
    ///   ones: a chunk on the wire is what the I4 and single-lease properties look at, so
    ///   delivering one is visible to them;
    /// - to the decode worker from the gateway: an `Abort`/`Cancel` for a request neither
    ///   pending, fencing nor decoding (its `Reserve` came before it on the same connection);
    /// - to the decode worker from the gateway: `PrefillUnreachable` for a prefill worker
    ///   that connected to it (see `DecodeRole`: such a prefill is fenced by its close);
    /// - to a prefill worker: an `Abort` for a request it has no job for, with no `Prefill`
    ///   for it on the wire to it and none to come (the gateway sends `Prefill` only from
    ///   `Reserving`).
    fn ignorable(&self) -> Option<Action> {
        use bulkhead_protocol::decode::RequestState;
        if self.cfg.variant == Variant::RetryAfterReject {
            return None;
        }
        let exactly_once = self.cfg.faults.duplicate == 0 && self.cfg.faults.reorder == 0;
        for (&(from, to), q) in &self.net {
            let Some(Envelope::Msg(m)) = q.front() else { continue };
            // A prefill that connected here is fenced by its connection's close, never by
            // the gateway's word: the decode role ignores the news for good.
            if let Message::PrefillUnreachable { worker } | Message::PeerLeft { worker } = m
                && to == Node::Decode
                && self.dec.role().has_connected(*worker)
            {
                return Some(Action::Deliver(from, to));
            }
            let Some(req) = m.req() else { continue };
            if !self.ghosts.get(&client_of(req)).is_some_and(|g| g.submitted) {
                continue;
            }
            let at_decode = self.dec.role().state_of(req);
            let pending_or_fencing = matches!(at_decode, Some(RequestState::Pending | RequestState::Fencing));
            let ignored = match (from, to, m) {
                (_, Node::Gateway(g), _) => self.dead.contains(&g) || self.gws[usize::from(g)].phase_of(req).is_none(),
                (Node::Prefill(_), Node::Decode, Message::Done { .. } | Message::Fenced { .. }) => exactly_once && !pending_or_fencing,
                (Node::Gateway(_), Node::Decode, Message::Abort { .. } | Message::Cancel { .. }) => at_decode.is_none(),
                // (A decode worker's abort of a job the prefill does not have is answered
                // with a fence, so it is not ignorable.)
                (Node::Gateway(g), Node::Prefill(w), Message::Abort { .. }) => {
                    let Some(p) = self.prefills.iter().find(|p| p.id == w) else { continue };
                    let has_job = p.driver.role().has_job(req) || p.driver.targets().any(|j| j.req == req);
                    let prefill_on_wire = self
                        .net
                        .get(&(Node::Gateway(g), Node::Prefill(w)))
                        .is_some_and(|q| q.iter().any(|e| matches!(e, Envelope::Msg(Message::Prefill { req: r, .. }) if *r == req)));
                    let prefill_to_come = self.gws[usize::from(g)].phase_of(req) == Some(Phase::Reserving);
                    !has_job && !prefill_on_wire && !prefill_to_come
                }
                _ => false,
            };
            if ignored {
                return Some(Action::Deliver(from, to));
            }
        }
        None
    }

    // ---------------------------------------------------------------- transitions

    /// Take one step. The action must be one of [`World::enabled`].
    pub fn apply(&mut self, a: &Action) {
        match *a {
            Action::Submit(req) => self.submit(req),
            Action::ClientGone(req) => {
                self.budget.client_aborts -= 1;
                self.ghost(req).client_gone = true;
                let g = Self::gateway_index(req);
                let acts = self.gws[g].handle(GatewayEvent::ClientGone { req });
                self.gateway_actions(g, acts);
            }
            Action::Deliver(from, to) => {
                if let Some(env) = self.pop(from, to, 0) {
                    self.deliver(from, to, env);
                }
            }
            Action::Duplicate(from, to) => {
                self.budget.duplicate -= 1;
                if let Some(env) = self.net.get(&(from, to)).and_then(|q| q.front()).cloned() {
                    self.deliver(from, to, env);
                }
            }
            Action::Lose(from, to) => {
                self.budget.lose -= 1;
                self.pop(from, to, 0);
            }
            Action::Reorder(from, to) => {
                self.budget.reorder -= 1;
                if let Some(env) = self.pop(from, to, 1) {
                    self.deliver(from, to, env);
                }
            }
            Action::PrefillStep(id) => self.prefill_step(id),
            Action::DecodeStep(req) => {
                self.dec.engine_mut().focus = Some(req);
                let alive = self.alive();
                let mut link = DecodeWire { cfg: self.cfg, net: &mut self.net, alive: &alive, ghosts: &mut self.ghosts, seen: Vec::new() };
                let stepped = self.dec.step(&mut link);
                let seen = link.seen;
                self.violate_all(seen);
                if let Err(e) = stepped {
                    self.violate(Prop::ReadIsolation, format!("decode step of {req} failed: {e}"));
                }
                self.drain_engine();
            }
            Action::DecodeTick => {
                self.budget.decode_ticks -= 1;
                self.dec_now += self.cfg.decode_tick_ms;
                self.decode_event(DecodeEvent::Tick { now_ms: self.dec_now });
            }
            Action::GatewayTick => {
                self.budget.gateway_ticks -= 1;
                self.gw_now += TICK_MS;
                for g in 0..self.gws.len() {
                    if !self.dead.contains(&(g as u8)) {
                        let acts = self.gws[g].handle(GatewayEvent::Tick { now_ms: self.gw_now });
                        self.gateway_actions(g, acts);
                    }
                }
            }
            Action::LoseGateway(g) => self.lose_gateway(g),
            Action::CrashPrefill(id) => self.crash_prefill(id),
            Action::CloseOvertakes(from) => {
                self.budget.close_overtakes -= 1;
                let Some(q) = self.net.get_mut(&(from, Node::Decode)) else { return };
                let Some(at) = q.iter().position(|e| matches!(e, Envelope::Closed)) else { return };
                // Two-sided: the frames it overtook go with the reader. One-sided: writes
                // already issued cannot be withdrawn, so they land after the close.
                let closed = if self.cfg.variant == Variant::OneSidedWrites { q.remove(at) } else { q.drain(..=at).next_back() };
                if q.is_empty() {
                    self.net.remove(&(from, Node::Decode));
                }
                if let Some(env) = closed {
                    self.deliver(from, Node::Decode, env);
                }
            }
            Action::PrefillTick(id) => {
                self.budget.prefill_ticks -= 1;
                let Some(p) = self.prefills.iter_mut().find(|p| p.id == id) else { return };
                p.now += TICK_MS;
                let now_ms = p.now;
                self.prefill_event(id, PrefillEvent::Tick { now_ms });
            }
        }
    }

    fn pop(&mut self, from: Node, to: Node, index: usize) -> Option<Envelope> {
        let q = self.net.get_mut(&(from, to))?;
        let env = q.remove(index);
        if q.is_empty() {
            self.net.remove(&(from, to));
        }
        env
    }

    fn submit(&mut self, req: RequestId) {
        let Some(r) = request(self.cfg, req) else { return };
        self.ghost(req).submitted = true;
        // A cache-scoped tenant's requests share one prompt, and so do the tenants.
        let tokens = match r.tenant {
            Some(_) => (0..r.prompt).map(|t| 100 + t).collect(),
            None => (0..r.prompt).map(|t| req.0 as u32 * 10 + t).collect(),
        };
        let secret = CacheSecret::from_random([7; 32]);
        let g = Self::gateway_index(req);
        let acts = self.gws[g].handle(GatewayEvent::Submit {
            req,
            submission: Submission {
                tokens,
                max_tokens: r.max_tokens,
                max_tokens_set: true,
                sampling: Sampling::default(),
                stop: vec![],
                trace: TraceContext::default(),
                tenant: TenantId(r.tenant.map_or(0, u32::from)),
                cache: r.tenant.map(|t| secret.scope(&format!("tenant-{t}"), None)),
                priority: 0,
            },
        });
        self.gateway_actions(g, acts);
    }

    fn deliver(&mut self, from: Node, to: Node, env: Envelope) {
        match (to, env) {
            (Node::Gateway(g), _) if self.dead.contains(&g) => {}
            (Node::Gateway(g), Envelope::Msg(msg)) => {
                let from = match from {
                    Node::Prefill(w) => w,
                    Node::Gateway(_) | Node::Decode => DECODE,
                };
                let acts = self.gws[usize::from(g)].handle(GatewayEvent::FromWorker { from, msg });
                self.gateway_actions(usize::from(g), acts);
            }
            (Node::Gateway(g), Envelope::Closed) => {
                if let Node::Prefill(id) = from {
                    let acts = self.gws[usize::from(g)].handle(GatewayEvent::WorkerLeft { id });
                    self.gateway_actions(usize::from(g), acts);
                }
            }
            (Node::Decode, env) => {
                let ev = match (from, env) {
                    (Node::Prefill(w), Envelope::Msg(msg)) => DecodeEvent::Prefill { from: w, msg },
                    (Node::Prefill(w), Envelope::Closed) => DecodeEvent::PrefillClosed { from: w },
                    (Node::Gateway(g), Envelope::Msg(msg)) => DecodeEvent::Gateway { from: GatewayId(g), msg },
                    (Node::Gateway(g), Envelope::Closed) => DecodeEvent::GatewayLost { gateway: GatewayId(g) },
                    (Node::Decode, Envelope::Msg(_)) => return,
                    (Node::Decode, Envelope::Closed) => return,
                };
                self.decode_event(ev);
            }
            (Node::Prefill(w), Envelope::Msg(msg)) => {
                let ev = match from {
                    Node::Gateway(g) => PrefillEvent::Gateway { from: GatewayId(g), msg },
                    Node::Decode | Node::Prefill(_) => PrefillEvent::Decode { from: DECODE, msg },
                };
                self.prefill_event(w, ev);
            }
            (Node::Prefill(w), Envelope::Closed) => {
                let ev = match from {
                    Node::Gateway(g) => PrefillEvent::GatewayLost { gateway: GatewayId(g) },
                    Node::Decode | Node::Prefill(_) => PrefillEvent::DecodeLost { decode: DECODE },
                };
                self.prefill_event(w, ev);
            }
        }
    }

    // ---------------------------------------------------------------- gateway driver

    fn gateway_actions(&mut self, g: usize, acts: Vec<GatewayAction>) {
        for a in acts {
            match a {
                GatewayAction::ToWorker { to, msg } => {
                    if let Message::Reserve { req, .. } = &msg
                        && self.ghosts.get(&client_of(*req)).is_some_and(|g| g.rejected)
                    {
                        self.violate(Prop::RejectionTerminal, format!("Reserve sent for {req} after it was rejected"));
                    }
                    let dest = if to == DECODE { Node::Decode } else { Node::Prefill(to) };
                    self.send(Node::Gateway(g as u8), dest, msg);
                }
                GatewayAction::ToClient { req, out } => self.client_output(req, out),
            }
        }
    }

    fn client_output(&mut self, req: RequestId, out: ClientOutput) {
        let outcome = match out {
            ClientOutput::Token { .. } => return,
            ClientOutput::Finished { .. } => Outcome::Finished,
            ClientOutput::Rejected { reason, .. } => Outcome::Rejected(reason),
            ClientOutput::Failed { reason, .. } => Outcome::Failed(reason),
            ClientOutput::Unavailable { .. } => Outcome::Unavailable,
            ClientOutput::Busy { reason, .. } => Outcome::Busy(reason),
            ClientOutput::OverBudget { .. } => Outcome::OverBudget,
        };
        let over = request(self.cfg, req).is_some_and(|r| self.cfg.over_capacity(r));
        let retry_variant = self.cfg.variant == Variant::RetryAfterReject;
        let g = self.ghost(req);
        g.outcomes.push(outcome);
        if matches!(outcome, Outcome::Rejected(_)) {
            g.rejected = true;
        }
        let outcomes = g.outcomes.clone();
        let retry = retry_variant && matches!(outcome, Outcome::Rejected(_)) && !g.retried;
        if retry {
            g.retried = true;
        }
        if outcomes.len() > 1 {
            self.violate(Prop::OneOutcome, format!("{req} has two terminal outcomes: {outcomes:?}"));
        }
        if over && outcome == Outcome::Finished {
            self.violate(Prop::OneOutcome, format!("{req} is over capacity and finished (HTTP 200)"));
        }
        if over && self.cfg.check_original_error && matches!(outcome, Outcome::Failed(r) if r != FailReason::Timeout) {
            self.violate(Prop::OriginalError, format!("{req} is over capacity and was answered {outcome:?}, not its refusal"));
        }
        if retry {
            // Broken: the driver retries under the same id after the client got the refusal.
            self.submit(req);
        }
    }

    // ---------------------------------------------------------------- prefill driver

    /// Feed one event to a prefill worker's driver; its actions go onto the network.
    fn prefill_event(&mut self, w: WorkerId, ev: PrefillEvent) {
        let alive = self.alive();
        let Some(p) = self.prefills.iter_mut().find(|p| p.id == w) else { return };
        let mut link = PrefillWire { me: w, net: &mut self.net, alive: &alive, ghosts: &self.ghosts, seen: Vec::new() };
        p.driver.handle(ev, &mut link);
        let seen = link.seen;
        self.violate_all(seen);
        self.note_refusals(w);
    }

    /// The requests a prefill role refused are rejected from then on (I3), whatever the
    /// driver's policy made of the refusal.
    fn note_refusals(&mut self, w: WorkerId) {
        let Some(p) = self.prefills.iter_mut().find(|p| p.id == w) else { return };
        let refused: Vec<RequestId> = p.driver.policy_mut().refused.drain(..).collect();
        for req in refused.into_iter().map(client_of) {
            if let Some(reason) = self.refusal_of(req) {
                worker_rejected(&mut self.ghosts, req, reason);
            }
        }
    }

    /// Why a prefill worker refuses `req`: over its prompt limit, or nothing (a duplicate).
    fn refusal_of(&self, req: RequestId) -> Option<RejectReason> {
        let r = request(self.cfg, req)?;
        (r.prompt as usize > self.cfg.prefill_max_prompt).then_some(RejectReason::ContextLength)
    }

    /// One step of prefill work, through the production driver: end stopped jobs, take
    /// queued ones while the budget has room, and compute and send the next page of each
    /// running job (up to two), ending those that finished (no message is handled between
    /// a job's last chunk and its `Done`, as in the server). Taking a job and computing its
    /// first page are one step: an abort that would arrive between them has the same
    /// effect on every other role as one arriving just before (`Fenced`, no chunk).
    fn prefill_step(&mut self, w: WorkerId) {
        let alive = self.alive();
        let Some(p) = self.prefills.iter_mut().find(|p| p.id == w) else { return };
        let mut link = PrefillWire { me: w, net: &mut self.net, alive: &alive, ghosts: &self.ghosts, seen: Vec::new() };
        let mut model = MockPrefill::new(&self.values);
        let steps = p.driver.step(&mut model, &mut p.pool, &mut link);
        let mut seen = link.seen;
        for req in model.batched {
            self.ghosts.entry(client_of(req)).or_default().batched = true;
        }
        for step in steps {
            if let Step::Computed { req, .. } | Step::Ended { req, .. } = step
                && self.ghosts.get(&client_of(req)).is_some_and(|g| g.rejected)
                && !matches!(step, Step::Ended { outcome: bulkhead_protocol::prefill::JobOutcome::Stopped, .. })
            {
                seen.push((Prop::RejectionTerminal, format!("prefill computes {req} after it was rejected")));
            }
            if let Step::Ended { req, unreleased: Some(e), .. } = &step {
                seen.push((Prop::SingleLease, format!("the prefill could not release the pages of {req}: {e}")));
            }
        }
        self.violate_all(seen);
    }

    fn crash_prefill(&mut self, id: WorkerId) {
        let Some(i) = self.prefills.iter().position(|p| p.id == id) else { return };
        self.budget.prefill_crashes -= 1;
        // Its process, pool, queue and job are gone; what it sent is still on the wire and
        // its connections close after it; what was on its way to it is lost. A fresh
        // worker registers under a new id.
        let fresh = WorkerId(self.next_worker);
        self.next_worker += 1;
        let dead = &self.dead;
        let live = self.gws.iter_mut().enumerate().filter(|(g, _)| !dead.contains(&(*g as u8))).map(|(_, gw)| gw);
        self.prefills[i] = Self::start_prefill(self.cfg, live, &mut self.dec, fresh);
        self.net.retain(|(_, to), _| *to != Node::Prefill(id));
        for to in self.alive().gateways.into_iter().map(Node::Gateway).chain([Node::Decode]) {
            self.net.entry((Node::Prefill(id), to)).or_default().push_back(Envelope::Closed);
        }
    }

    /// Gateway `g` dies: what was on its way to it is lost; what it sent still arrives,
    /// then each of its connections closes; its clients are gone with it.
    fn lose_gateway(&mut self, g: u8) {
        self.budget.gateway_losses -= 1;
        self.dead.insert(g);
        self.net.retain(|(_, to), _| *to != Node::Gateway(g));
        for to in self.prefills.iter().map(|p| Node::Prefill(p.id)).chain([Node::Decode]) {
            self.net.entry((Node::Gateway(g), to)).or_default().push_back(Envelope::Closed);
        }
        for (req, ghost) in &mut self.ghosts {
            if Self::gateway_index(*req) == usize::from(g) && ghost.outcomes.is_empty() {
                ghost.submitted = true;
                ghost.client_gone = true;
            }
        }
    }

    /// The gateways alive.
    fn live_gateways(&self) -> impl Iterator<Item = &GatewayRole> {
        self.gws.iter().enumerate().filter(|(g, _)| !self.dead.contains(&(*g as u8))).map(|(_, gw)| gw)
    }

    // ---------------------------------------------------------------- decode driver

    /// Feed one event to the decode driver and record what it did to the ghost state.
    fn decode_event(&mut self, ev: DecodeEvent) {
        let before = self.dec.role().stats();
        let (chunk, done) = match &ev {
            DecodeEvent::Prefill { msg: Message::KvChunk { req, header, .. }, .. } => (Some((*req, header.slot_count as usize)), None),
            DecodeEvent::Prefill { msg: Message::Done { req, .. }, .. } => (None, Some(*req)),
            _ => (None, None),
        };
        let alive = self.alive();
        let mut link = DecodeWire { cfg: self.cfg, net: &mut self.net, alive: &alive, ghosts: &mut self.ghosts, seen: Vec::new() };
        self.dec.handle(ev, &mut link);
        let seen = link.seen;
        self.violate_all(seen);
        let after = self.dec.role().stats();
        if let Some((attempt, slots)) = chunk
            && after.chunks_verified > before.chunks_verified
        {
            let req = client_of(attempt);
            let g = self.ghost(req);
            if g.attempt == Some(attempt) {
                g.landed += slots;
            }
            if g.rejected {
                self.violate(Prop::RejectionTerminal, format!("decode accepted a chunk for {req} after it was rejected"));
            }
        }
        if let Some(req) = done
            && after.coverage_failed > before.coverage_failed
            && self.cfg.variant == Variant::TrustDone
        {
            // Broken: "transfer complete" is trusted; the request is started on what is in
            // place (what it held and what landed).
            let (held, landed) = self.ghosts.get(&client_of(req)).map_or((0, 0), |g| (g.held, g.landed));
            self.check_start(req, held + landed, held, 0);
        }
        self.drain_engine();
    }

    /// What the mock decode loop saw: requests it started (checked against their
    /// reservations) and property violations of its reads.
    fn drain_engine(&mut self) {
        let started: Vec<Started> = self.dec.engine_mut().started.drain(..).collect();
        for Started { req: attempt, prompt, committed, shared, computed } in started {
            self.check_start(attempt, prompt, shared, computed);
            let req = client_of(attempt);
            if committed != self.ghosts.get(&req).and_then(|g| g.reserved_prompt).unwrap_or(usize::MAX) {
                self.violate(Prop::VerifiedCoverage, format!("{req} started with {committed} committed prompt tokens"));
            }
        }
        let seen: Vec<(Prop, String)> = self.dec.engine_mut().seen.drain(..).collect();
        self.violate_all(seen);
    }

    /// I2 at the moment decode starts attempt `attempt` with `coverage` prompt tokens in
    /// place, `shared` of them in shared (cached) pages and `computed` computed by the decode
    /// loop itself; I10: its shared leases cover what the decode worker said it held, and
    /// beyond that only pages that landed for it (its verified prompt, published at once
    /// for its siblings), and held, landed and computed tokens cover the prompt with no gap
    /// and no overlap (a rest is computed only when the worker said so, and then nothing
    /// lands); I3: a rejected request never reaches decode.
    fn check_start(&mut self, attempt: RequestId, coverage: usize, shared: usize, computed: usize) {
        let req = client_of(attempt);
        let g = self.ghosts.get(&req).cloned().unwrap_or_default();
        if g.attempt != Some(attempt)
            || g.reserved_prompt != Some(coverage)
            || shared < g.held
            || shared > g.held + g.landed
            || g.held + g.landed + computed != coverage
            || (computed > 0) != g.local
        {
            self.violate(
                Prop::VerifiedCoverage,
                format!(
                    "{req} started with {coverage} prompt tokens, {shared} shared, {computed} computed here; reserved {:?}, held {}, landed {}, local {}",
                    g.reserved_prompt, g.held, g.landed, g.local
                ),
            );
        }
        if g.rejected {
            self.violate(Prop::RejectionTerminal, format!("{req} started decoding after it was rejected"));
        }
    }

    // ---------------------------------------------------------------- state checks

    /// Checks on the state as it stands (I1 single lease, I4 no late writes), recorded
    /// as violations. Run after every step.
    pub fn check_state(&mut self) {
        let handles = self.handles();
        let refs = self.write_refs();
        let stats = self.dec.engine().pool.stats();
        let mut problems: Vec<(Prop, String)> = Vec::new();
        for p in &self.prefills {
            let refused = p.pool.stats().fence_failures;
            if refused > 0 {
                problems.push((Prop::CacheFence, format!("prefill {} looked up {refused} cached page(s) of another tenant", p.id)));
            }
        }
        if stats.fence_failures > 0 {
            problems.push((Prop::CacheFence, format!("decode looked up {} cached page(s) of another tenant", stats.fence_failures)));
        }
        // I10: every shared page a holder counts is one of the pool's live shared leases.
        let shared = self.shared_handles();
        if shared != stats.shared_leases {
            problems.push((Prop::SingleLease, format!("holders count {shared} shared decode pages, the pool {}", stats.shared_leases)));
        }
        let mut by_page: BTreeMap<u32, &Handle> = BTreeMap::new();
        for h in &handles {
            if let Some(other) = by_page.insert(h.page, h) {
                problems.push((Prop::SingleLease, format!("page {} held twice: {other:?} and {h:?}", h.page)));
            }
        }
        let leased = handles.iter().filter(|h| !h.quarantined).count();
        let quarantined = handles.len() - leased;
        if (stats.leased_pages, stats.quarantined_pages) != (leased, quarantined) {
            problems.push((
                Prop::SingleLease,
                format!(
                    "pool has {} leased / {} quarantined pages, holders have {leased} / {quarantined}",
                    stats.leased_pages, stats.quarantined_pages
                ),
            ));
        }
        for r in &refs {
            match by_page.get(&r.page) {
                Some(h) if h.owner != r.req => problems.push((
                    Prop::SingleLease,
                    format!("page {} is leased to {} while {} may still write it ({})", r.page, h.owner, r.req, r.via),
                )),
                Some(h) if h.generation == r.generation => {}
                _ => problems.push((
                    Prop::NoLateWrites,
                    format!("page {} generation {} left its lease while {} may still write it ({})", r.page, r.generation, r.req, r.via),
                )),
            }
        }
        for (p, why) in problems {
            self.violate(p, why);
        }
    }

    /// Every live handle on a decode page: the decode role's reservations and quarantines,
    /// and the decode loop's sequences.
    fn handles(&self) -> Vec<Handle> {
        let role = self.dec.role().held_pages().into_iter().map(|h| (h.tag, h.quarantined));
        let running = self.dec.engine().running.values().flat_map(|r| r.seq.pages()).filter(|p| !p.is_shared()).map(|l| (**l, false));
        role.chain(running)
            .map(|(tag, quarantined)| Handle { page: tag.page().0, generation: tag.generation().0, owner: tag.owner(), quarantined })
            .collect()
    }

    /// Shared (cached, read-only) decode pages the role's reservations and the decode
    /// loop's sequences hold.
    fn shared_handles(&self) -> usize {
        let role = self.dec.role().shared_pages();
        let running: usize = self.dec.engine().running.values().map(|r| r.seq.pages().iter().filter(|p| p.is_shared()).count()).sum();
        role + running
    }

    /// Every way a chunk for a decode page may still arrive: a `Prefill` on its way to a
    /// live prefill worker that has not fenced it yet, a job in a prefill queue or
    /// running, a chunk on the wire.
    fn write_refs(&self) -> Vec<WriteRef> {
        let mut out = Vec::new();
        for (&(from, to), q) in &self.net {
            for env in q {
                let Envelope::Msg(m) = env else { continue };
                match (m, from, to) {
                    // A job its prefill worker already fenced (a decode worker gave it up
                    // first) is refused when it arrives.
                    (Message::Prefill { req, .. }, _, Node::Prefill(w))
                        if self.prefills.iter().any(|p| p.id == w && p.driver.role().tombstoned(*req)) => {}
                    (Message::Prefill { req, pages, .. }, _, Node::Prefill(_)) => {
                        for p in pages {
                            out.push(WriteRef { page: p.page.0, generation: p.generation.0, req: *req, via: "Prefill on the wire" });
                        }
                    }
                    (Message::KvChunk { req, header, .. }, _, Node::Decode) => {
                        out.push(WriteRef { page: header.page.0, generation: header.generation.0, req: *req, via: "chunk on the wire" });
                    }
                    _ => {}
                }
            }
        }
        for p in &self.prefills {
            for j in p.driver.targets() {
                for r in &j.pages {
                    out.push(WriteRef { page: r.page.0, generation: r.generation.0, req: j.req, via: "prefill job" });
                }
            }
        }
        out
    }

    /// Whether the world is at its clean end: every request submitted and ended for its
    /// client (one terminal outcome, or the client left), nothing on the wire, every role
    /// idle, every pool full.
    pub fn is_clean(&self) -> bool {
        self.requests_ended()
            && self.net.is_empty()
            && self.live_gateways().all(|g| g.in_flight() == 0)
            && self.dec.is_idle()
            && self.prefills.iter().all(|p| p.driver.is_idle())
            && full(&self.dec.engine().pool)
            && self.prefills.iter().all(|p| full(&p.pool))
    }

    /// Every request submitted and ended for its client.
    pub fn requests_ended(&self) -> bool {
        self.ghosts.values().all(|g| g.submitted && (g.client_gone || !g.outcomes.is_empty()))
    }

    /// Whether some prefill worker's cache shared a page and some evicted one.
    pub fn cache_hit_and_eviction(&self) -> bool {
        let decode = self.dec.role().cache_stats();
        let stats = || self.prefills.iter().filter_map(|p| p.driver.cache()).map(|c| c.stats()).chain(decode);
        stats().any(|s| s.hit_tokens > 0) && stats().any(|s| s.evicted_pages > 0)
    }

    /// Requests whose rest the decode worker computed itself so far.
    pub fn local_prefills(&self) -> u64 {
        self.dec.role().stats().local_prefills
    }

    /// Whether some prefill step interleaved the chunks of two jobs.
    pub fn batched(&self) -> bool {
        self.ghosts.values().any(|g| g.batched)
    }

    /// Sequences the decode loop retracted so far.
    pub fn retractions(&self) -> u64 {
        self.dec.engine().retractions
    }

    /// Capacity refusals by the decode worker so far.
    pub fn capacity_refusals(&self) -> u64 {
        self.dec.role().stats().rejected_capacity
    }

    /// Whether a gateway died and the world still ended clean with every request of the
    /// gateways alive finished.
    pub fn survived_gateway_loss(&self) -> bool {
        !self.dead.is_empty()
            && self.is_clean()
            && self
                .ghosts
                .iter()
                .filter(|(req, _)| !self.dead.contains(&gateway_of(**req).0))
                .all(|(_, g)| g.outcomes == [Outcome::Finished])
    }

    /// Every request that fits finished, every one that does not was rejected.
    pub fn all_served(&self) -> bool {
        self.ghosts.iter().all(|(req, g)| {
            let over = request(self.cfg, *req).is_some_and(|r| self.cfg.over_capacity(r));
            g.outcomes == [if over { Outcome::Rejected(RejectReason::ContextLength) } else { Outcome::Finished }]
        })
    }

    // ---------------------------------------------------------------- fingerprint

    /// Writes the state the checker deduplicates on (see [`bulkhead_fingerprint`]): every
    /// role, driver and running sequence, the pools' page counts, the network, the budgets
    /// and the ghost state.
    pub fn fingerprint(&self, h: &mut Fingerprinter) {
        // Clocks and deadlines are read only by the next tick; once a role can tick no more,
        // they are dead state and two worlds that differ only there behave alike. The
        // round-robin position matters only to requests not yet submitted.
        let all_submitted = self.ghosts.values().all(|g| g.submitted) && self.cfg.variant != Variant::RetryAfterReject;
        h.clocks_dead(self.budget.gateway_ticks == 0).turns_dead(all_submitted);
        for gw in self.live_gateways() {
            h.write(gw);
        }
        h.turns_dead(false).write(&self.dead);
        for p in &self.prefills {
            h.clocks_dead(self.budget.prefill_ticks == 0).write(&p.id).write(&p.driver).write(&p.pool.stats().free_pages);
        }
        let d = self.dec.engine().pool.stats();
        h.clocks_dead(self.budget.decode_ticks == 0).write(self.dec.role()).clocks_dead(false);
        h.write(&(d.free_pages, d.leased_pages, d.quarantined_pages)).write(&self.dec.engine().running);
        h.write(&self.net).write(&self.ghosts).write(&self.budget).write(&self.next_worker);
    }

    /// A readable dump of the world, for counterexamples and the explorer.
    pub fn dump(&self) -> String {
        let mut s = String::new();
        for (g, gw) in self.gws.iter().enumerate() {
            let dead = if self.dead.contains(&(g as u8)) { " (dead)" } else { "" };
            let _ = writeln!(s, "gateway {g}{dead}: {gw:?}");
        }
        for p in &self.prefills {
            let _ = writeln!(s, "prefill {}: {:?}", p.id, p.driver);
            let _ = writeln!(s, "  pool {:?}", p.pool.stats());
        }
        let _ = writeln!(s, "decode: {:?}", self.dec.role());
        let _ = writeln!(s, "  pool {:?}", self.dec.engine().pool.stats());
        for (req, r) in &self.dec.engine().running {
            let _ = writeln!(s, "  running {req}: {} tokens", r.seq.len());
        }
        for ((from, to), q) in &self.net {
            let _ = writeln!(s, "wire {from:?} -> {to:?}:");
            for e in q {
                let _ = writeln!(s, "    {e:?}");
            }
        }
        for (req, g) in &self.ghosts {
            let _ = writeln!(s, "request {req}: {g:?}");
        }
        let _ = writeln!(s, "budget: {:?}", self.budget);
        for (p, why) in &self.violations {
            let _ = writeln!(s, "VIOLATION {p:?}: {why}");
        }
        s
    }
}

/// Nothing leased, quarantined or read: every page free, or cached with no reader.
fn full(pool: &KvPool) -> bool {
    let s = pool.stats();
    s.free_pages + s.cached_pages == s.total_pages && s.shared_leases == 0
}
