//! One schedule: the production roles and the production driver core
//! ([`bulkhead_protocol::driver`]) over real pools, the transport of [`crate::net`], and a
//! virtual clock. The transports here only move frames; the prefill job loop and the
//! decode action dispatch are the server's own code.
//!
//! The loop: among everything due at the current virtual time (a delivery on some
//! connection, a planned event, a prefill chunk or a decode step of a worker that is not
//! busy, a role's tick), the dice pick one; when nothing is due the clock jumps to the
//! next due time. A schedule ends when it is quiet (nothing planned, nothing in flight,
//! every role idle) or at its deadline, which is itself a failure: something waits for
//! ever. Then [`Sim::verdict`] checks the outcome of every request, every pool and every
//! role.
//!
//! Here: the world and its loop (due steps, planned events and faults, deliveries, the
//! drivers' steps). `wire`: the workers' transports over [`crate::net`] and how the log
//! names what crosses it; `verdict`: the checks of a finished schedule and its [`Tally`].

use std::collections::{BTreeMap, BTreeSet};

use bulkhead_kv::{CacheStats, Generation, KvChecks, KvPool, PageId, PoolConfig, PoolStats, PrefixCache, RequestId};
use bulkhead_protocol::cache::CacheSecret;
use bulkhead_protocol::decode::{DecodeConfig, DecodeEvent, DecodeRole, DecodeStats};
use bulkhead_protocol::driver::decode::{DecodeDriver, DecodeEngine};
use bulkhead_protocol::driver::prefill::{Batching, PrefillDriver, Step};
use bulkhead_protocol::driver::sabotage::DecodeSabotage;
use bulkhead_protocol::gateway::{
    ClientOutput, GatewayAction, GatewayConfig, GatewayEvent, GatewayRole, GatewaySettings, Submission, TenantId, client_of, gateway_of,
};
use bulkhead_protocol::prefill::{PrefillConfig, PrefillEvent, PrefillRole};
use bulkhead_protocol::{GatewayId, Hello, Message, Role, TraceContext, WorkerId};

use crate::dice::Dice;
use crate::model::{DecodeModel, Models, PrefillModel};
use crate::net::{Arrival, ConnId, Delivery, End, Net};
use crate::plan::{Fault, Plan, Planned, Sabotage, WorkerPlan};

mod verdict;
mod wire;

pub use verdict::Tally;
use wire::{Aftermath, DecodeWire, Port, PrefillWire, brief, client_brief};

/// The gateway ticks every 100 ms, workers every 50 ms, as in production.
const GATEWAY_TICK_MS: u64 = 100;
const WORKER_TICK_MS: u64 = 50;

/// The model digest every worker announces.
const DIGEST: u64 = 1;

/// How long after its role asks to rejoin a prefill worker registers again.
const REJOIN_DELAY_MS: u64 = 10;

/// A schedule that takes more steps than this has a livelock.
const MAX_STEPS: u64 = 200_000;

struct Gateway {
    role: GatewayRole,
    /// Registered workers' connections (the role keeps who they are).
    workers: BTreeMap<WorkerId, ConnId>,
    next_tick: u64,
    /// Killed ([`Fault::LoseGateway`]): it does nothing more.
    dead: bool,
}

struct PrefillWorker<P> {
    driver: PrefillDriver,
    model: P,
    pool: KvPool,
    /// Its connection to each gateway it is registered with, by gateway.
    gws: BTreeMap<u8, ConnId>,
    /// Its KV connection to each decode worker.
    kv: BTreeMap<WorkerId, ConnId>,
    busy_until: u64,
    next_tick: u64,
}

struct DecodeWorker<D> {
    driver: DecodeDriver<D, DecodeSabotage>,
    /// Its connection to each gateway it is registered with, by gateway.
    gws: BTreeMap<u8, ConnId>,
    /// Accepted KV connections and the prefill worker each announced (None before KvHello).
    kv: BTreeMap<ConnId, Option<WorkerId>>,
    /// Every prefill worker that ever announced itself here.
    identified: BTreeSet<WorkerId>,
    /// The prefill worker each reservation request named.
    reserved_via: BTreeMap<RequestId, WorkerId>,
    /// The latest generation each page was handed to a writer at (from `Reserved`).
    handed_out: BTreeMap<PageId, Generation>,
    busy_until: u64,
    next_tick: u64,
}

/// What a worker left behind when it died: the counters the verdict still checks.
struct Remains {
    id: WorkerId,
    pool: PoolStats,
    read_faults: u64,
    decode: Option<DecodeStats>,
    keepalives: u64,
    retractions: u64,
    cache: CacheStats,
}

#[derive(Default)]
struct Client {
    outputs: Vec<ClientOutput>,
    /// Outputs received when the client left (None: it never left).
    gone_at: Option<usize>,
    /// The `DropFirstToken` sabotage already dropped this request's first token.
    dropped_first: bool,
    /// Attempts whose prompt was computed: `Prefill` messages the gateway sent for it, and
    /// reservations a decode worker computed itself (`Reserved.local`).
    prefills: u32,
}

#[derive(Clone, Copy, Debug)]
enum Due {
    Deliver(ConnId, usize),
    Planned(u64, u32),
    PrefillWork(WorkerId),
    DecodeWork(WorkerId),
    GatewayTick(u8),
    DecodeTick(WorkerId),
    PrefillTick(WorkerId),
}

/// The decode driver's policy in a schedule: the production one, or one of the driver
/// core's sabotages ([`DecodeSabotage`]) that show the checks bite; the model checker
/// plants the same ones.
fn decode_policy(s: Sabotage) -> DecodeSabotage {
    match s {
        Sabotage::DropFences => DecodeSabotage::DropFences,
        Sabotage::ReleaseOnTimeout => DecodeSabotage::FenceOnTimeout,
        Sabotage::None | Sabotage::DropFirstToken | Sabotage::KeepRejectedDrafts => DecodeSabotage::None,
    }
}

/// What one schedule did and found.
#[derive(Debug)]
pub struct Outcome {
    /// The seed.
    pub seed: u64,
    /// Every step, in order, with its virtual time.
    pub log: Vec<String>,
    /// Every broken expectation (empty: the schedule passed).
    pub violations: Vec<String>,
    /// Counts.
    pub tally: Tally,
}

/// One schedule in progress.
pub struct Sim<'m, M: Models> {
    models: &'m M,
    plan: Plan,
    dice: Dice,
    now: u64,
    deadline: u64,
    steps: u64,
    net: Net,
    /// The gateways, by index; a dead one stays (its counters) and does nothing.
    gws: Vec<Gateway>,
    prefills: BTreeMap<WorkerId, PrefillWorker<M::Prefill>>,
    decodes: BTreeMap<WorkerId, DecodeWorker<M::Decode>>,
    dead: Vec<Remains>,
    clients: BTreeMap<RequestId, Client>,
    timeline: BTreeMap<(u64, u32), Planned>,
    planned_seq: u32,
    next_worker: u32,
    /// KV chunks sent so far (for the mid-transfer fault).
    chunks_sent: u64,
    log: Vec<String>,
    violations: Vec<String>,
    /// The state at the deadline, if the schedule never went quiet.
    wedged: Option<String>,
    tally: Tally,
}

/// Runs the schedule of `seed` on `models` and checks it.
pub fn run<M: Models>(models: &M, seed: u64, options: crate::plan::Options) -> Outcome {
    let mut dice = Dice::new(seed);
    let plan = Plan::draw(seed, &mut dice, &models.shape(), options);
    let mut sim = Sim::new(models, plan, dice);
    let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        sim.run();
        sim.verdict();
    }));
    if let Err(p) = checked {
        let what = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
        sim.violations.push(format!("panic at t={}: {what}", sim.now));
    }
    Outcome { seed, log: sim.log, violations: sim.violations, tally: sim.tally }
}

impl<'m, M: Models> Sim<'m, M> {
    fn new(models: &'m M, plan: Plan, dice: Dice) -> Self {
        let config = GatewayConfig {
            model_context: plan.model_context,
            model_digest: DIGEST,
            tenants: Default::default(),
            settings: GatewaySettings {
                admission_check: plan.gateway_check,
                request_timeout_ms: plan.request_timeout_ms,
                max_queued: plan.requests.len(),
                queue_timeout_ms: plan.request_timeout_ms,
                migration_limit: 3,
                prefill_window_tokens: 0,
            },
        };
        let gws = (0..plan.gateways.max(1))
            .map(|g| Gateway {
                role: GatewayRole::new(config.clone()).with_id(GatewayId(g)),
                workers: BTreeMap::new(),
                next_tick: GATEWAY_TICK_MS,
                dead: false,
            })
            .collect();
        let mut timeline = BTreeMap::new();
        for (i, (at, p)) in plan.events.iter().enumerate() {
            timeline.insert((*at, i as u32), p.clone());
        }
        let last = plan.events.last().map_or(0, |(at, _)| *at);
        let deadline = last + 400 + 2 * (plan.request_timeout_ms + plan.transfer_timeout_ms) + 4 * GATEWAY_TICK_MS;
        let clients = plan.requests.iter().map(|r| (r.req, Client::default())).collect();
        let tally = Tally { requests: plan.requests.len() as u64, ..Tally::default() };
        let net = Net::new(plan.slow_links, plan.options.raw_duplicates);
        let planned_seq = plan.events.len() as u32;
        let mut sim = Sim {
            models,
            plan,
            dice,
            now: 0,
            deadline,
            steps: 0,
            net,
            gws,
            prefills: BTreeMap::new(),
            decodes: BTreeMap::new(),
            dead: Vec::new(),
            clients,
            timeline,
            planned_seq,
            next_worker: 1,
            chunks_sent: 0,
            log: Vec::new(),
            violations: Vec::new(),
            wedged: None,
            tally,
        };
        let p = &sim.plan;
        let head = format!(
            "seed {} layout {:?} prefill {:?} decode {:?} gateway check {} timeouts {}/{} ms chunk {} pages, {} per step",
            p.seed,
            p.layout,
            p.prefill,
            p.decode,
            p.gateway_check,
            p.request_timeout_ms,
            p.transfer_timeout_ms,
            p.chunk_pages,
            p.step_chunks
        );
        sim.log(head);
        for r in sim.plan.requests.clone() {
            sim.log(format!("request r{} {:?}: prompt {} max_tokens {}", r.req, r.kind, r.tokens.len(), r.max_tokens));
        }
        sim
    }

    fn log(&mut self, line: impl AsRef<str>) {
        self.log.push(format!("{:>6} {}", self.now, line.as_ref()));
    }

    fn violate(&mut self, why: String) {
        self.log(format!("VIOLATION {why}"));
        self.violations.push(why);
    }

    // ------------------------------------------------------------------ the loop

    fn run(&mut self) {
        loop {
            if self.quiet() {
                return;
            }
            if self.steps >= MAX_STEPS {
                return self.violate(format!("no quiet state after {MAX_STEPS} steps (livelock)"));
            }
            let due = self.due();
            let Some(&next) = self.dice.pick(&due) else {
                let Some(at) = self.next_time() else { return };
                if at > self.deadline {
                    // The verdict decides whether a known finding explains it.
                    self.log("deadline: not quiet");
                    self.wedged = Some(self.dump());
                    return;
                }
                self.now = at;
                continue;
            };
            self.steps += 1;
            self.perform(next);
        }
    }

    fn due(&self) -> Vec<Due> {
        let now = self.now;
        let mut out: Vec<Due> = self.net.due(now).into_iter().map(|(c, d)| Due::Deliver(c, d)).collect();
        // Planned events happen in their planned order (a client leaves after submitting).
        out.extend(self.timeline.keys().next().filter(|k| k.0 <= now).map(|k| Due::Planned(k.0, k.1)));
        for (id, p) in &self.prefills {
            if p.driver.has_work() && p.busy_until <= now {
                out.push(Due::PrefillWork(*id));
            }
            if p.next_tick <= now && (self.awaited(*id) || p.driver.role().rejoin_pending()) {
                out.push(Due::PrefillTick(*id));
            }
        }
        for (id, d) in &self.decodes {
            if d.driver.engine().active() > 0 && d.busy_until <= now {
                out.push(Due::DecodeWork(*id));
            }
            if d.next_tick <= now {
                out.push(Due::DecodeTick(*id));
            }
        }
        for (g, gw) in self.live_gateways() {
            if gw.next_tick <= now {
                out.push(Due::GatewayTick(g));
            }
        }
        out
    }

    fn next_time(&self) -> Option<u64> {
        let work = self.prefills.values().filter(|p| p.driver.has_work()).map(|p| p.busy_until);
        let steps = self.decodes.values().filter(|d| d.driver.engine().active() > 0).map(|d| d.busy_until);
        let prefill_ticks =
            self.prefills.iter().filter(|(id, p)| self.awaited(**id) || p.driver.role().rejoin_pending()).map(|(_, p)| p.next_tick);
        let gateway_ticks = self.live_gateways().map(|(_, g)| g.next_tick);
        let ticks = self.decodes.values().map(|d| d.next_tick).chain(prefill_ticks).chain(gateway_ticks);
        let planned = self.timeline.keys().next().map(|k| k.0);
        work.chain(steps).chain(ticks).chain(planned).chain(self.net.next_due()).filter(|t| *t > self.now).min()
    }

    /// Whether a decode worker awaits a transfer from prefill `w`. Its ticks (and so its
    /// keepalives) run only then, or while it has a lost KV connection to open again: a
    /// keepalive re-arms only such reservations, and a schedule must be able to go quiet.
    fn awaited(&self, w: WorkerId) -> bool {
        self.decodes.values().any(|d| d.driver.role().awaits(w))
    }

    /// Nothing planned, nothing in flight, every role and loop idle.
    fn quiet(&self) -> bool {
        self.timeline.is_empty()
            && self.net.idle()
            && self.live_gateways().all(|(_, g)| g.role.in_flight() == 0)
            && self.prefills.values().all(|p| p.driver.is_idle())
            && self.decodes.values().all(|d| d.driver.is_idle())
    }

    /// The gateways alive, with their indices.
    fn live_gateways(&self) -> impl Iterator<Item = (u8, &Gateway)> {
        self.gws.iter().enumerate().filter(|(_, g)| !g.dead).map(|(i, g)| (i as u8, g))
    }

    fn perform(&mut self, due: Due) {
        match due {
            Due::Deliver(conn, d) => {
                if let Some(del) = self.net.deliver(conn, d) {
                    self.on_delivery(del);
                }
            }
            Due::Planned(at, seq) => {
                if let Some(p) = self.timeline.remove(&(at, seq)) {
                    self.planned(p);
                }
            }
            Due::PrefillWork(w) => self.prefill_work(w),
            Due::DecodeWork(w) => self.decode_work(w),
            Due::GatewayTick(g) => {
                let gw = &mut self.gws[usize::from(g)];
                gw.next_tick += GATEWAY_TICK_MS;
                let acts = gw.role.handle(GatewayEvent::Tick { now_ms: self.now });
                if !acts.is_empty() {
                    self.log(format!("{} tick", End::Gateway(g)));
                }
                self.gateway_actions(g, acts);
            }
            Due::DecodeTick(w) => self.decode_tick(w),
            Due::PrefillTick(w) => {
                let now_ms = self.now;
                let Some(p) = self.prefills.get_mut(&w) else { return };
                // Ticks skipped while nothing awaited this worker are not caught up.
                p.next_tick = p.next_tick.max(now_ms.saturating_sub(WORKER_TICK_MS)) + WORKER_TICK_MS;
                self.prefill_event(w, PrefillEvent::Tick { now_ms });
            }
        }
    }

    fn schedule(&mut self, at: u64, p: Planned) {
        self.timeline.insert((at, self.planned_seq), p);
        self.planned_seq += 1;
    }

    fn send(&mut self, conn: ConnId, from: End, m: Message) {
        self.net.send(conn, from, &m, self.now, &mut self.dice);
    }

    // ------------------------------------------------------------------ planned events

    fn planned(&mut self, p: Planned) {
        match p {
            Planned::Start(wp) => self.start_worker(wp),
            Planned::Submit(req) => {
                let Some(r) = self.plan.request(req).cloned() else { return };
                let g = gateway_of(req).0;
                if self.gws[usize::from(g)].dead {
                    self.log(format!("client r{req} cannot reach its gateway, which is gone"));
                    if let Some(c) = self.clients.get_mut(&req) {
                        c.gone_at = Some(0);
                    }
                    return;
                }
                self.log(format!("client r{req} submits"));
                let ev = GatewayEvent::Submit {
                    req,
                    submission: Submission {
                        tokens: r.tokens,
                        max_tokens: r.max_tokens,
                        max_tokens_set: true,
                        sampling: r.sampling.clone(),
                        stop: Vec::new(),
                        trace: TraceContext::default(),
                        tenant: TenantId(r.tenant),
                        cache: self
                            .plan
                            .prefix_cache
                            .then(|| CacheSecret::from_random([5; 32]).scope(&format!("tenant-{}", r.tenant), None)),
                        priority: 0,
                    },
                };
                let acts = self.gws[usize::from(g)].role.handle(ev);
                self.gateway_actions(g, acts);
            }
            Planned::ClientGone(req) => {
                self.log(format!("client r{req} goes away"));
                if let Some(c) = self.clients.get_mut(&req) {
                    c.gone_at.get_or_insert(c.outputs.len());
                }
                let g = gateway_of(req).0;
                if !self.gws[usize::from(g)].dead {
                    let acts = self.gws[usize::from(g)].role.handle(GatewayEvent::ClientGone { req });
                    self.gateway_actions(g, acts);
                }
            }
            Planned::Fault(f) => self.fault(f),
        }
    }

    fn start_worker(&mut self, wp: WorkerPlan) {
        let id = WorkerId(self.next_worker);
        self.next_worker += 1;
        let pool = match KvPool::new(PoolConfig { layout: self.plan.layout, pages: wp.pool_pages, checks: KvChecks::all() }) {
            Ok(p) => p,
            Err(e) => return self.violate(format!("cannot make a pool for {wp:?}: {e}")),
        };
        self.log(format!("start w{} {:?} pool {} pages context {}", id.0, wp.role, wp.pool_pages, wp.context));
        let l = self.plan.layout;
        let kv_addr = if wp.role == Role::Decode { format!("w{}", id.0) } else { String::new() };
        let hello = Hello::for_pool(wp.role, id, DIGEST, &pool, wp.context, kv_addr);
        let live: Vec<u8> = self.live_gateways().map(|(g, _)| g).collect();
        let mut gws = BTreeMap::new();
        for g in live {
            let conn = self.net.connect(End::Worker(id), End::Gateway(g), &mut self.dice);
            self.send(conn, End::Worker(id), Message::Hello(hello.clone()));
            gws.insert(g, conn);
        }
        let next_tick = self.now + WORKER_TICK_MS;
        match wp.role {
            Role::Prefill => {
                let keepalive_ms = PrefillConfig::keepalive_for(self.plan.transfer_timeout_ms);
                let role = PrefillRole::new(PrefillConfig { max_prompt: wp.context, page_size: l.page_size, keepalive_ms });
                let chunk_tokens = self.plan.chunk_pages * l.page_size;
                let driver = PrefillDriver::new(role, Batching { chunk_tokens, step_tokens: self.plan.step_chunks * chunk_tokens });
                let driver = if self.plan.prefix_cache { driver.with_cache(PrefixCache::new(wp.pool_pages), DIGEST) } else { driver };
                let model = self.models.prefill();
                self.prefills.insert(id, PrefillWorker { driver, model, pool, gws, kv: BTreeMap::new(), busy_until: 0, next_tick });
            }
            Role::Decode => {
                let role = DecodeRole::new(DecodeConfig {
                    max_context: wp.context,
                    transfer_timeout_ms: self.plan.transfer_timeout_ms,
                    local_prefill_tokens: self.plan.local_prefill,
                });
                // The decode side keeps ended requests' full pages wherever the prefill side
                // caches: later requests of a scope then share them and receive only the rest.
                let role = if self.plan.prefix_cache { role.with_cache(PrefixCache::new(wp.pool_pages), DIGEST) } else { role };
                let mut model = self.models.decode(pool, wp.context);
                if self.plan.options.sabotage == Sabotage::KeepRejectedDrafts {
                    model.keep_rejected_drafts();
                }
                let driver = DecodeDriver::with_policy(role, model, decode_policy(self.plan.options.sabotage));
                let (kv, identified, reserved_via, handed_out) = (BTreeMap::new(), BTreeSet::new(), BTreeMap::new(), BTreeMap::new());
                let d = DecodeWorker { driver, gws, kv, identified, reserved_via, handed_out, busy_until: 0, next_tick };
                self.decodes.insert(id, d);
            }
        }
    }

    fn fault(&mut self, f: Fault) {
        match f {
            Fault::CutKv => {
                let kv: Vec<(WorkerId, WorkerId, ConnId)> = self
                    .prefills
                    .iter()
                    .flat_map(|(p, w)| w.kv.iter().map(move |(d, c)| (*p, *d, *c)))
                    .filter(|(_, _, c)| self.net.is_open(*c))
                    .collect();
                let Some(&(p, d, c)) = self.dice.pick(&kv) else { return self.log("fault: no KV connection to cut") };
                self.tally.faults += 1;
                self.log(format!("fault: cut KV connection {c} w{}-w{}", p.0, d.0));
                self.net.cut(c, self.now, &mut self.dice);
            }
            Fault::CutGateway { restart_after_ms } => {
                let conns = self.gateway_conns();
                let Some(&(w, role, _, c)) = self.dice.pick(&conns) else { return self.log("fault: no gateway connection to cut") };
                self.tally.faults += 1;
                self.log(format!("fault: cut gateway connection {c} of w{}", w.0));
                self.net.cut(c, self.now, &mut self.dice);
                // A worker exits when its last gateway connection closes; serve restarts it.
                if conns.iter().filter(|(x, ..)| *x == w).count() == 1 {
                    self.restart(role, restart_after_ms);
                }
            }
            Fault::Garble => {
                let mut conns: Vec<(ConnId, End)> = Vec::new();
                for (w, _, g, c) in self.gateway_conns() {
                    conns.push((c, End::Gateway(g)));
                    conns.push((c, End::Worker(w)));
                }
                for (w, p) in &self.prefills {
                    for (d, c) in &p.kv {
                        conns.push((*c, End::Worker(*w)));
                        conns.push((*c, End::Worker(*d)));
                    }
                }
                conns.retain(|(c, _)| self.net.is_open(*c));
                let Some(&(c, from)) = self.dice.pick(&conns) else { return self.log("fault: no connection to garble") };
                self.tally.faults += 1;
                self.log(format!("fault: bad bytes from {from} on {c}"));
                self.net.garble(c, from, self.now, &mut self.dice);
            }
            Fault::Crash { role, restart_after_ms } => {
                let workers: Vec<WorkerId> = match role {
                    Role::Prefill => self.prefills.keys().copied().collect(),
                    Role::Decode => self.decodes.keys().copied().collect(),
                };
                let Some(&w) = self.dice.pick(&workers) else { return self.log(format!("fault: no {role:?} worker to crash")) };
                self.tally.faults += 1;
                self.crash(w, "crashes");
                self.restart(role, restart_after_ms);
            }
            Fault::LoseGateway => {
                let live: Vec<u8> = self.live_gateways().map(|(g, _)| g).collect();
                // Never the last: with none left every worker exits and nothing is served.
                let Some(&g) = self.dice.pick(&live).filter(|_| live.len() > 1) else { return self.log("fault: no gateway to lose") };
                self.tally.faults += 1;
                self.tally.gateways_lost += 1;
                self.log(format!("fault: {} dies", End::Gateway(g)));
                self.gws[usize::from(g)].dead = true;
                self.net.crash(End::Gateway(g), self.now, &mut self.dice);
                // Its clients' connections close with it.
                for (req, c) in &mut self.clients {
                    if gateway_of(*req).0 == g {
                        c.gone_at.get_or_insert(c.outputs.len());
                    }
                }
            }
        }
    }

    /// Every live worker's gateway connection: (worker, role, gateway, connection).
    fn gateway_conns(&self) -> Vec<(WorkerId, Role, u8, ConnId)> {
        let p = self.prefills.iter().flat_map(|(w, p)| p.gws.iter().map(move |(g, c)| (*w, Role::Prefill, *g, *c)));
        let d = self.decodes.iter().flat_map(|(w, d)| d.gws.iter().map(move |(g, c)| (*w, Role::Decode, *g, *c)));
        p.chain(d).collect()
    }

    fn restart(&mut self, role: Role, after_ms: Option<u64>) {
        if let Some(after) = after_ms {
            let wp = if role == Role::Prefill { self.plan.prefill } else { self.plan.decode };
            self.schedule(self.now + after, Planned::Start(wp));
        }
    }

    /// A worker process ends: its state and pool are gone, its connections close.
    fn crash(&mut self, w: WorkerId, why: &str) {
        self.log(format!("w{} {why}: role state and pool lost", w.0));
        if let Some(p) = self.prefills.remove(&w) {
            let pool = p.pool.stats();
            let keepalives = p.driver.role().stats().keepalives;
            let cache = p.driver.cache().map(PrefixCache::stats).unwrap_or_default();
            self.dead.push(Remains { id: w, pool, read_faults: p.model.read_faults(), decode: None, keepalives, retractions: 0, cache });
        } else if let Some(d) = self.decodes.remove(&w) {
            let pool = d.driver.engine().pool().stats();
            let (read_faults, retractions) = (d.driver.engine().read_faults(), d.driver.engine().retractions());
            self.dead.push(Remains {
                id: w,
                pool,
                read_faults,
                decode: Some(d.driver.role().stats()),
                keepalives: 0,
                retractions,
                cache: CacheStats::default(),
            });
        }
        self.net.crash(End::Worker(w), self.now, &mut self.dice);
    }

    // ------------------------------------------------------------------ deliveries

    fn on_delivery(&mut self, del: Delivery) {
        let what = match &del.arrival {
            Arrival::Message(m) => brief(m),
            Arrival::Partial => return,
            Arrival::Closed => "closed".into(),
            Arrival::Garbled(e) => format!("bad bytes ({e}): closing"),
        };
        self.log(format!("{}->{} {}: {what}", del.from, del.to, del.conn));
        match del.to {
            End::Gateway(g) => self.gateway_delivery(g, del),
            End::Worker(w) if self.prefills.contains_key(&w) => self.prefill_delivery(w, del),
            End::Worker(w) if self.decodes.contains_key(&w) => self.decode_delivery(w, del),
            End::Worker(w) => self.violate(format!("delivery to w{}, which is gone", w.0)),
        }
    }

    fn gateway_delivery(&mut self, g: u8, del: Delivery) {
        let End::Worker(w) = del.from else { return };
        if self.gws[usize::from(g)].dead {
            return;
        }
        match del.arrival {
            Arrival::Message(Message::Hello(h)) => self.register(g, w, del.conn, h),
            Arrival::Message(msg) => {
                if let Message::Reserved { req, local: true, .. } = &msg
                    && let Some(c) = self.clients.get_mut(&client_of(*req))
                {
                    c.prefills += 1;
                }
                let acts = self.gws[usize::from(g)].role.handle(GatewayEvent::FromWorker { from: w, msg });
                self.gateway_actions(g, acts);
            }
            Arrival::Closed => self.worker_left(g, w),
            Arrival::Garbled(_) => {
                self.net.close_by(del.conn, End::Gateway(g), self.now, &mut self.dice);
                self.worker_left(g, w);
            }
            Arrival::Partial => {}
        }
    }

    /// What the production gateway's actor does on `Hello`: the role decides (welcome and
    /// introductions, or a refusal), the connection is remembered.
    fn register(&mut self, g: u8, w: WorkerId, conn: ConnId, h: Hello) {
        if h.worker != w {
            return self.violate(format!("w{} introduced itself as w{}", w.0, h.worker.0));
        }
        let gw = &mut self.gws[usize::from(g)];
        match gw.role.join(&h) {
            Ok(acts) => {
                gw.workers.insert(w, conn);
                self.gateway_actions(g, acts);
            }
            Err(e) => {
                self.violate(format!("w{} refused at registration: {e}", w.0));
                self.send(conn, End::Gateway(g), Message::Refuse { reason: e.to_string() });
            }
        }
    }

    fn worker_left(&mut self, g: u8, w: WorkerId) {
        let gw = &mut self.gws[usize::from(g)];
        if gw.workers.remove(&w).is_some() {
            let acts = gw.role.handle(GatewayEvent::WorkerLeft { id: w });
            self.gateway_actions(g, acts);
        }
    }

    fn gateway_actions(&mut self, g: u8, acts: Vec<GatewayAction>) {
        for a in acts {
            match a {
                GatewayAction::ToWorker { to, msg } => {
                    if let Message::Prefill { req, .. } = &msg
                        && let Some(c) = self.clients.get_mut(&client_of(*req))
                    {
                        c.prefills += 1;
                    }
                    if let Some(&conn) = self.gws[usize::from(g)].workers.get(&to) {
                        self.send(conn, End::Gateway(g), msg);
                    }
                }
                GatewayAction::ToClient { req, out } => {
                    let Some(c) = self.clients.get_mut(&req) else {
                        self.violate(format!("output for r{req}, which no client sent"));
                        continue;
                    };
                    if self.plan.options.sabotage == Sabotage::DropFirstToken
                        && matches!(out, ClientOutput::Token { .. })
                        && !c.dropped_first
                    {
                        c.dropped_first = true;
                        continue;
                    }
                    c.outputs.push(out);
                    let line = format!("client r{req} <- {}", c.outputs.last().map(client_brief).unwrap_or_default());
                    self.log(line);
                }
            }
        }
    }

    // ------------------------------------------------------------------ prefill driver

    fn prefill_delivery(&mut self, w: WorkerId, del: Delivery) {
        let Some(p) = self.prefills.get(&w) else { return };
        if let Some(g) = p.gws.iter().find(|(_, c)| **c == del.conn).map(|(g, _)| *g) {
            match del.arrival {
                Arrival::Message(msg) => self.prefill_event(w, PrefillEvent::Gateway { from: GatewayId(g), msg }),
                Arrival::Closed => self.gateway_lost(w, g, del.conn, false),
                Arrival::Garbled(_) => self.gateway_lost(w, g, del.conn, true),
                Arrival::Partial => {}
            }
            return;
        }
        let Some(decode) = p.kv.iter().find(|(_, c)| **c == del.conn).map(|(d, _)| *d) else { return };
        match del.arrival {
            Arrival::Message(msg) => self.prefill_event(w, PrefillEvent::Decode { from: decode, msg }),
            Arrival::Partial => {}
            Arrival::Closed | Arrival::Garbled(_) => {
                if matches!(del.arrival, Arrival::Garbled(_)) {
                    self.net.close_by(del.conn, End::Worker(w), self.now, &mut self.dice);
                }
                if let Some(p) = self.prefills.get_mut(&w) {
                    p.kv.remove(&decode);
                }
                self.prefill_event(w, PrefillEvent::DecodeLost { decode });
            }
        }
    }

    /// A worker's connection to gateway `g` ended (or carried bad bytes, which closes it):
    /// what the production worker does. It exits when that was its last gateway; else its
    /// role hears that the gateway is lost and ends that gateway's requests. (The
    /// production worker also dials it again; a gateway here is never restarted.)
    fn gateway_lost(&mut self, w: WorkerId, g: u8, conn: ConnId, garbled: bool) {
        if garbled {
            self.net.close_by(conn, End::Worker(w), self.now, &mut self.dice);
        }
        let left = match (self.prefills.get_mut(&w), self.decodes.get_mut(&w)) {
            (Some(p), _) => {
                p.gws.remove(&g);
                p.gws.len()
            }
            (None, Some(d)) => {
                d.gws.remove(&g);
                d.gws.len()
            }
            (None, None) => return,
        };
        if left == 0 {
            let why = if garbled { "exits: bad bytes on its last gateway connection" } else { "exits: its last gateway connection closed" };
            return self.crash(w, why);
        }
        self.log(format!("w{} lost {}: ends its requests", w.0, End::Gateway(g)));
        let gateway = GatewayId(g);
        if self.prefills.contains_key(&w) {
            self.prefill_event(w, PrefillEvent::GatewayLost { gateway });
        } else {
            self.decode_event(w, DecodeEvent::GatewayLost { gateway });
        }
    }

    /// Runs `f` on prefill worker `w`'s driver, model and pool, with its transport over
    /// this schedule's network; what the transport set off comes back with `f`'s result.
    fn with_prefill<R>(
        &mut self,
        w: WorkerId,
        f: impl FnOnce(&mut PrefillDriver, &mut M::Prefill, &mut KvPool, &mut PrefillWire<'_, '_>) -> R,
    ) -> Option<(R, Option<Aftermath>)> {
        let decodes: BTreeSet<WorkerId> = self.decodes.keys().copied().collect();
        let PrefillWorker { driver, model, pool, gws, kv, .. } = self.prefills.get_mut(&w)?;
        let mut wire = PrefillWire {
            port: Port { me: w, now: self.now, net: &mut self.net, dice: &mut self.dice, gws },
            kv,
            decodes: &decodes,
            log: &mut self.log,
            chunks_sent: &mut self.chunks_sent,
            mid_transfer: self.plan.mid_transfer,
            faults: &mut self.tally.faults,
            events: Vec::new(),
            dead: false,
            aftermath: None,
        };
        let r = f(driver, model, pool, &mut wire);
        Some((r, wire.aftermath))
    }

    /// Feed one event to prefill worker `w`'s driver, then the events its transport caused.
    fn prefill_event(&mut self, w: WorkerId, ev: PrefillEvent) {
        let done = self.with_prefill(w, |driver, _, _, wire| {
            let mut pending = vec![ev];
            while !pending.is_empty() {
                for ev in std::mem::take(&mut pending) {
                    driver.handle(ev, wire);
                }
                pending = std::mem::take(&mut wire.events);
            }
        });
        if let Some(((), Some(Aftermath::Rejoin))) = done {
            self.rejoin(w);
        }
    }

    /// What the prefill worker (`bulkhead_worker::prefill`) does when its role asks to
    /// rejoin: close every connection (cleanly: what it sent still arrives) and register
    /// again, under a new id.
    fn rejoin(&mut self, w: WorkerId) {
        let Some(p) = self.prefills.remove(&w) else { return };
        self.log(format!("w{} lost a KV connection: rejoins under a new id", w.0));
        for conn in p.gws.values().chain(p.kv.values()).copied() {
            self.net.close_by(conn, End::Worker(w), self.now, &mut self.dice);
        }
        let keepalives = p.driver.role().stats().keepalives;
        let mut pool = p.pool;
        let cache = p.driver.abandon(&mut pool).unwrap_or_default();
        self.dead.push(Remains {
            id: w,
            pool: pool.stats(),
            read_faults: p.model.read_faults(),
            decode: None,
            keepalives,
            retractions: 0,
            cache,
        });
        self.tally.rejoins += 1;
        self.schedule(self.now + REJOIN_DELAY_MS, Planned::Start(self.plan.prefill));
    }

    /// One step of the prefill worker's loop (`bulkhead_worker::prefill`), through the
    /// production driver: end stopped jobs, take queued ones within the step's budget,
    /// compute and send the next chunk of each, end the finished ones.
    fn prefill_work(&mut self, w: WorkerId) {
        let cost = self.dice.range(self.plan.prefill_cost_ms.0, self.plan.prefill_cost_ms.1);
        let busy_until = self.now + cost;
        let Some((steps, aftermath)) = self.with_prefill(w, |driver, model, pool, wire| driver.step(model, pool, wire)) else { return };
        if let Some(p) = self.prefills.get_mut(&w) {
            p.busy_until = busy_until;
        }
        for step in &steps {
            match step {
                Step::Computed { req, from, to, chunks } => {
                    self.log(format!("w{} r{req}: positions {from}..{to} computed, {chunks} chunks sent", w.0))
                }
                Step::Ended { req, outcome, unreleased, .. } => {
                    self.log(format!("w{} r{req} ends: {outcome:?}", w.0));
                    if let Some(e) = unreleased {
                        self.violate(format!("w{} cannot release the pages of r{req}: {e}", w.0));
                    }
                }
            }
        }
        match aftermath {
            None => {}
            Some(Aftermath::CrashPrefill(restart)) => {
                self.crash(w, "crashes mid-transfer");
                self.restart(Role::Prefill, restart);
            }
            Some(Aftermath::CrashDecode(decode, restart)) if self.decodes.contains_key(&decode) => {
                self.crash(decode, "crashes mid-transfer");
                self.restart(Role::Decode, restart);
            }
            Some(Aftermath::CrashDecode(decode, _)) => self.log(format!("fault: w{} is already gone", decode.0)),
            Some(Aftermath::Rejoin) => self.rejoin(w),
        }
    }

    // ------------------------------------------------------------------ decode driver

    fn decode_delivery(&mut self, w: WorkerId, del: Delivery) {
        let Some(d) = self.decodes.get_mut(&w) else { return };
        if let Some(g) = d.gws.iter().find(|(_, c)| **c == del.conn).map(|(g, _)| *g) {
            match del.arrival {
                Arrival::Message(Message::Welcome { .. }) => {}
                Arrival::Message(m) => {
                    if let Message::Reserve { req, prefill, .. } = &m {
                        d.reserved_via.insert(*req, *prefill);
                    }
                    self.decode_event(w, DecodeEvent::Gateway { from: GatewayId(g), msg: m });
                }
                Arrival::Closed => self.gateway_lost(w, g, del.conn, false),
                Arrival::Garbled(_) => self.gateway_lost(w, g, del.conn, true),
                Arrival::Partial => {}
            }
            return;
        }
        let from = *d.kv.entry(del.conn).or_insert(None);
        match (del.arrival, from) {
            (Arrival::Message(Message::KvHello { prefill }), None) => {
                d.kv.insert(del.conn, Some(prefill));
                d.identified.insert(prefill);
                self.decode_event(w, DecodeEvent::PrefillConnected { from: prefill });
            }
            (Arrival::Message(_), None) => {
                // A KV connection must start with KvHello; anything else closes it.
                d.kv.remove(&del.conn);
                self.log(format!("w{} closes {}: no KvHello first", w.0, del.conn));
                self.net.close_by(del.conn, End::Worker(w), self.now, &mut self.dice);
            }
            (Arrival::Message(msg), Some(from)) => {
                // I4, observed: a chunk for a page the decode worker has since handed to
                // another reservation means it released the page before the chunk's writer
                // was fenced. Over TCP the role drops such a chunk unread; over a transport
                // whose writes land by themselves (RDMA) it would overwrite another request.
                if let Message::KvChunk { req, header, .. } = &msg
                    && let Some(&later) = d.handed_out.get(&header.page).filter(|g| **g > header.generation)
                {
                    let (page, generation) = (header.page, header.generation);
                    self.violate(format!(
                        "I4: w{} got a chunk of r{req} for page {page}@{generation} after handing the page out again at generation {later}: released before its writer w{} was fenced",
                        w.0, from.0
                    ));
                }
                self.decode_event(w, DecodeEvent::Prefill { from, msg });
            }
            (arrival @ (Arrival::Closed | Arrival::Garbled(_)), from) => {
                d.kv.remove(&del.conn);
                if matches!(arrival, Arrival::Garbled(_)) {
                    self.net.close_by(del.conn, End::Worker(w), self.now, &mut self.dice);
                }
                if let Some(from) = from {
                    self.decode_event(w, DecodeEvent::PrefillClosed { from });
                }
            }
            (Arrival::Partial, _) => {}
        }
    }

    /// Feed one event to decode worker `w`'s driver.
    fn decode_event(&mut self, w: WorkerId, ev: DecodeEvent) {
        let Some(d) = self.decodes.get_mut(&w) else { return };
        let DecodeWorker { driver, gws, kv, handed_out, .. } = d;
        let mut wire = DecodeWire { port: Port { me: w, now: self.now, net: &mut self.net, dice: &mut self.dice, gws }, kv, handed_out };
        driver.handle(ev, &mut wire);
    }

    fn decode_tick(&mut self, w: WorkerId) {
        let now = self.now;
        let Some(d) = self.decodes.get_mut(&w) else { return };
        d.next_tick += WORKER_TICK_MS;
        let timeouts = d.driver.role().stats().timeouts;
        self.decode_event(w, DecodeEvent::Tick { now_ms: now });
        if self.decodes.get(&w).is_some_and(|d| d.driver.role().stats().timeouts > timeouts) {
            self.log(format!("w{} tick: transfers timed out", w.0));
        }
    }

    fn decode_work(&mut self, w: WorkerId) {
        let cost = self.dice.range(self.plan.decode_cost_ms.0, self.plan.decode_cost_ms.1);
        let now = self.now;
        let Some(d) = self.decodes.get_mut(&w) else { return };
        d.busy_until = now + cost;
        let DecodeWorker { driver, gws, kv, handed_out, .. } = d;
        let mut wire = DecodeWire { port: Port { me: w, now, net: &mut self.net, dice: &mut self.dice, gws }, kv, handed_out };
        match driver.step(&mut wire) {
            Ok(()) => self.log(format!("w{} decode step", w.0)),
            Err(e) => {
                // The production worker exits on a failed step.
                self.violate(format!("w{} decode step failed: {e}", w.0));
                self.crash(w, "exits: decode step failed");
            }
        }
    }
}
