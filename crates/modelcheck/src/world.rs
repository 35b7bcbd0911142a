//! The world the checker explores: the production gateway role and the production
//! prefill and decode drivers ([`bulkhead_protocol::driver`]) over real KV pools, with a
//! network between them and per-request bookkeeping that the properties read.
//!
//! Nothing here decides anything the production code decides. The transports (`wire`) move
//! messages onto the network; the mock model ([`crate::drivers`]) computes KV values that
//! are a function of request and position, reads KV back through `KvPool::read` and
//! records what it saw. The broken [`Variant`]s are driver policies ([`crate::drivers`])
//! or changes to the gateway's driver here; the roles and the driver core are the
//! production ones in every variant.
//!
//! Here: the world's state, its start and replay, and its fingerprint. `wire`: the
//! workers' transports onto the network; `actions`: the actions the checker may take and
//! their transitions; `steps`: running each process's driver within a transition;
//! `properties`: the checks on every state and the end-state predicates.

use bulkhead_fingerprint::{Fingerprint, Fingerprinter};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;

use bulkhead_kv::{KvChecks, KvPool, PoolConfig, PrefixCache, RequestId};
use bulkhead_protocol::decode::{DecodeConfig, DecodeEvent, DecodeRole};
use bulkhead_protocol::driver::decode::DecodeDriver;
use bulkhead_protocol::driver::prefill::{Batching, PrefillDriver};
use bulkhead_protocol::gateway::{BusyReason, GatewayConfig, GatewayRole, GatewaySettings, gateway_of, request_number};
use bulkhead_protocol::prefill::{PrefillConfig, PrefillEvent, PrefillRole};
use bulkhead_protocol::{FailReason, GatewayId, Hello, Message, RejectReason, Role, WorkerId};

use crate::config::{Config, LAYOUT, TICK_MS, Variant};
use crate::drivers::{MockDecode, decode_policy, prefill_policy};
use bulkhead_protocol::driver::sabotage::{DecodeSabotage, PrefillSabotage};

mod actions;
mod properties;
mod steps;
mod wire;

use wire::{Nowhere, Reach, put};

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
            tenants: Default::default(),
            settings: GatewaySettings {
                admission_check: cfg.gateway_admission,
                request_timeout_ms: TICK_MS,
                max_queued: cfg.requests.len(),
                queue_timeout_ms: TICK_MS,
                migration_limit: 3,
                prefill_window_tokens: cfg.prefill_window_tokens,
            },
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
        let mut dec = DecodeDriver::with_policy(
            role,
            MockDecode::new(dpool, cfg.variant, cfg.speculative_tokens, Values::new(cfg)),
            decode_policy(cfg.variant),
        );
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

    /// The gateways alive.
    fn live_gateways(&self) -> impl Iterator<Item = &GatewayRole> {
        self.gws.iter().enumerate().filter(|(g, _)| !self.dead.contains(&(*g as u8))).map(|(_, gw)| gw)
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
