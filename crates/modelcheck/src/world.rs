//! The world the checker explores: the production gateway, prefill and decode roles and
//! their real KV pools, wired by a driver that moves messages between them the way the
//! server's drivers do, plus per-request bookkeeping that the properties read.
//!
//! Nothing here decides anything the production code decides. The driver moves messages,
//! runs the mock model (KV values are a function of request and position), reads KV back
//! through `KvPool::read` and records what it saw. The broken [`Variant`]s change only the
//! driver.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;

use bulkhead_kv::transfer::{export_chunks, Manifest};
use bulkhead_kv::{KvPool, KvChecks, PoolConfig, RequestId, SequenceKv};
use bulkhead_protocol::decode::{DecodeAction, DecodeConfig, DecodeEvent, DecodeRole};
use bulkhead_protocol::gateway::{ClientOutput, GatewayAction, GatewayConfig, GatewayEvent, GatewayRole};
use bulkhead_protocol::prefill::{JobOutcome, PrefillAction, PrefillConfig, PrefillJob, PrefillRole};
use bulkhead_protocol::{FailReason, Message, RejectReason, Role, Sampling, TraceContext, WorkerId};

use crate::config::{Config, Variant, LAYOUT, TICK_MS};
use crate::observe;

/// The decode worker's id.
pub const DECODE: WorkerId = WorkerId(1);
/// First prefill worker id; the others and restarted workers follow.
const FIRST_PREFILL: u32 = 2;
/// The first token the mock prefill samples.
const FIRST_TOKEN: u32 = 7;

/// An end of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Node {
    /// The gateway.
    Gateway,
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
    /// The gateway's clock passes the request timeout.
    GatewayTick,
    /// A prefill worker crashes and a fresh one registers under a new id.
    CrashPrefill(WorkerId),
}

/// What travels on a connection.
#[derive(Clone, Debug)]
pub enum Envelope {
    /// A message.
    Msg(Message),
    /// The connection closed: nothing follows.
    Closed,
}

/// The properties, each named after the invariant it checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
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
}

/// How a request ended for its client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Finished (HTTP 200).
    Finished,
    /// Refused before running (HTTP 4xx).
    Rejected(RejectReason),
    /// Failed while running.
    Failed(FailReason),
    /// No worker available.
    Unavailable,
}

/// What the driver has seen of one request (ghost state for the properties).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ghost {
    /// Submitted by its client.
    pub submitted: bool,
    /// Its client went away.
    pub client_gone: bool,
    /// Terminal outcomes delivered to the client, in order.
    pub outcomes: Vec<Outcome>,
    /// Prompt tokens of the reservation the decode worker granted.
    pub reserved_prompt: Option<usize>,
    /// Prompt tokens in chunks the decode verifier accepted.
    pub landed: usize,
    /// A role decided to reject it (the gateway told the client, or a worker refused it
    /// for context or capacity): from here it must not reach Reserve, transfer or decode.
    pub rejected: bool,
    /// The gateway driver retried it (the `RetryAfterReject` variant).
    pub retried: bool,
}

struct Job {
    job: PrefillJob,
    seq: SequenceKv,
    done: usize,
    manifest: Manifest,
    /// Run by the broken `KeepRejectedJob` driver behind the role's back.
    zombie: bool,
}

struct PrefillWorker {
    id: WorkerId,
    role: PrefillRole,
    pool: KvPool,
    job: Option<Job>,
    /// Jobs the role rejected that the `KeepRejectedJob` driver keeps anyway.
    zombies: VecDeque<PrefillJob>,
}

struct Running {
    seq: SequenceKv,
    max_tokens: u32,
    generated: u32,
}

struct DecodeWorker {
    role: DecodeRole,
    pool: KvPool,
    running: BTreeMap<RequestId, Running>,
}

/// Remaining fault budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Budget {
    client_aborts: u8,
    lose: u8,
    duplicate: u8,
    reorder: u8,
    prefill_crashes: u8,
    decode_ticks: u8,
    gateway_ticks: u8,
}

/// The production roles and pools, the network between them, and what the driver saw.
pub struct World<'c> {
    cfg: &'c Config,
    gw: GatewayRole,
    gw_now: u64,
    prefills: Vec<PrefillWorker>,
    next_worker: u32,
    dec: DecodeWorker,
    dec_now: u64,
    net: BTreeMap<(Node, Node), VecDeque<Envelope>>,
    ghosts: BTreeMap<RequestId, Ghost>,
    budget: Budget,
    violations: BTreeMap<Prop, String>,
}

fn sampling() -> Sampling {
    Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, seed: None, ignore_eos: false }
}

fn pool(pages: usize) -> KvPool {
    KvPool::new(PoolConfig { layout: LAYOUT, pages, checks: KvChecks::all() }).expect("model pool")
}

/// The mock model: the K and V value every layer holds for `req` at `pos`. Distinct for
/// every (request, position) of the model and exact in f16.
pub fn kv_value(req: RequestId, pos: usize) -> f32 {
    (req.0 * 16 + pos as u64) as f32
}

/// Request ids of a configuration: 1, 2, ...
pub fn request_id(index: usize) -> RequestId {
    RequestId(index as u64 + 1)
}

impl<'c> World<'c> {
    /// The initial world: every worker registered, nothing submitted.
    pub fn new(cfg: &'c Config) -> Self {
        let mut gw = GatewayRole::new(GatewayConfig {
            max_context: cfg.gateway_max_context,
            admission_check: cfg.gateway_admission,
            request_timeout_ms: TICK_MS,
        });
        let mut prefills = Vec::new();
        for i in 0..cfg.prefill_workers {
            let id = WorkerId(FIRST_PREFILL + i as u32);
            prefills.push(Self::prefill_worker(cfg, id));
            gw.handle(GatewayEvent::WorkerJoined { id, role: Role::Prefill });
        }
        gw.handle(GatewayEvent::WorkerJoined { id: DECODE, role: Role::Decode });
        let f = cfg.faults;
        World {
            cfg,
            gw,
            gw_now: 0,
            next_worker: FIRST_PREFILL + cfg.prefill_workers as u32,
            prefills,
            dec: DecodeWorker {
                role: DecodeRole::new(DecodeConfig { max_context: cfg.decode_max_context, transfer_timeout_ms: TICK_MS }),
                pool: pool(cfg.decode_pool_pages),
                running: BTreeMap::new(),
            },
            dec_now: 0,
            net: BTreeMap::new(),
            ghosts: (0..cfg.requests.len()).map(|i| (request_id(i), Ghost::default())).collect(),
            budget: Budget {
                client_aborts: f.client_aborts,
                lose: f.lose,
                duplicate: f.duplicate,
                reorder: f.reorder,
                prefill_crashes: f.prefill_crashes,
                decode_ticks: f.decode_ticks,
                gateway_ticks: f.gateway_ticks,
            },
            violations: BTreeMap::new(),
        }
    }

    fn prefill_worker(cfg: &Config, id: WorkerId) -> PrefillWorker {
        PrefillWorker {
            id,
            role: PrefillRole::new(PrefillConfig { max_prompt: cfg.prefill_max_prompt, page_size: LAYOUT.page_size }),
            pool: pool(cfg.prefill_pool_pages),
            job: None,
            zombies: VecDeque::new(),
        }
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

    fn ghost(&mut self, req: RequestId) -> &mut Ghost {
        self.ghosts.entry(req).or_default()
    }

    fn request(&self, req: RequestId) -> Option<crate::config::Request> {
        self.cfg.requests.get((req.0 as usize).checked_sub(1)?).copied()
    }

    fn prefill_alive(&self, id: WorkerId) -> bool {
        self.prefills.iter().any(|p| p.id == id)
    }

    fn send(&mut self, from: Node, to: Node, m: Message) {
        let alive = match to {
            Node::Prefill(id) => self.prefill_alive(id),
            Node::Gateway | Node::Decode => true,
        };
        // A message to a worker that is gone is dropped, as a write to a closed socket is.
        if alive {
            self.net.entry((from, to)).or_default().push_back(Envelope::Msg(m));
        }
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
            if p.job.is_some() || p.role.queued() > 0 || !p.zombies.is_empty() {
                out.push(Action::PrefillStep(p.id));
            }
        }
        for &req in self.dec.running.keys() {
            out.push(Action::DecodeStep(req));
        }
        // A tick with nothing waiting only moves the clock; leaving it out loses no
        // behaviour (a later useful tick is the same choice).
        if self.budget.decode_ticks > 0 && self.dec.role.pending() > 0 {
            out.push(Action::DecodeTick);
        }
        if self.budget.gateway_ticks > 0 && self.gw.in_flight() > 0 {
            out.push(Action::GatewayTick);
        }
        if self.budget.prefill_crashes > 0 {
            for p in &self.prefills {
                let involved = p.job.is_some()
                    || p.role.queued() > 0
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
    /// - to a prefill worker: an `Abort` for a request it has no job for, with no `Prefill`
    ///   for it on the wire to it and none to come (the gateway sends `Prefill` only from
    ///   `Reserving`).
    ///
    /// The receivers' state is read from their `Debug` output.
    fn ignorable(&self) -> Option<Action> {
        if self.cfg.variant == Variant::RetryAfterReject {
            return None;
        }
        let exactly_once = self.cfg.faults.duplicate == 0 && self.cfg.faults.reorder == 0;
        let gw = format!("{:?}", self.gw);
        let dec = format!("{:?}", self.dec.role);
        let decoding = dec.find("decoding: {").map_or("", |i| &dec[i..i + dec[i..].find('}').unwrap_or(0)]);
        for (&(from, to), q) in &self.net {
            let Some(Envelope::Msg(m)) = q.front() else { continue };
            let Some(req) = m.req() else { continue };
            if !self.ghosts.get(&req).is_some_and(|g| g.submitted) {
                continue;
            }
            let pending = dec.contains(&format!("{req:?}: Pending"));
            let fencing = dec.contains(&format!("{req:?}: Fencing"));
            let ignored = match (from, to, m) {
                (_, Node::Gateway, _) => !gw.contains(&format!("{req:?}: InFlight")),
                (Node::Prefill(_), Node::Decode, Message::Done { .. } | Message::Fenced { .. }) => exactly_once && !pending && !fencing,
                (Node::Gateway, Node::Decode, Message::Abort { .. } | Message::Cancel { .. }) => {
                    !pending && !fencing && !decoding.contains(&format!("{req:?}"))
                }
                (_, Node::Prefill(w), Message::Abort { .. }) => {
                    let Some(p) = self.prefills.iter().find(|p| p.id == w) else { continue };
                    let role = format!("{:?}", p.role);
                    let has_job = role.contains(&format!("PrefillJob {{ req: {req:?}"))
                        || role.contains(&format!("running: Some(({req:?}"))
                        || p.job.as_ref().is_some_and(|j| j.job.req == req)
                        || p.zombies.iter().any(|j| j.req == req);
                    let prefill_on_wire = self
                        .net
                        .get(&(Node::Gateway, Node::Prefill(w)))
                        .is_some_and(|q| q.iter().any(|e| matches!(e, Envelope::Msg(Message::Prefill { req: r, .. }) if *r == req)));
                    let prefill_to_come = gw.contains(&format!("{req:?}: InFlight {{ phase: Reserving"));
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
                let acts = self.gw.handle(GatewayEvent::ClientGone { req });
                self.gateway_actions(acts);
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
            Action::DecodeStep(req) => self.decode_step(req),
            Action::DecodeTick => {
                self.budget.decode_ticks -= 1;
                self.dec_now += TICK_MS;
                let acts = self.dec.role.handle(&mut self.dec.pool, DecodeEvent::Tick { now_ms: self.dec_now });
                if self.cfg.variant == Variant::ReleaseQuarantineOnTick {
                    // Broken: a timeout is taken for a fence, so the quarantined pages of
                    // every timed-out transfer are released while its prefill may still write.
                    let timed_out: Vec<(WorkerId, RequestId)> = acts.iter().filter_map(DecodeAction::timeout_abort).collect();
                    self.decode_actions(acts);
                    for (from, req) in timed_out {
                        let more = self.dec.role.handle(&mut self.dec.pool, DecodeEvent::Prefill { from, msg: Message::Fenced { req } });
                        self.decode_actions(more);
                    }
                } else {
                    self.decode_actions(acts);
                }
            }
            Action::GatewayTick => {
                self.budget.gateway_ticks -= 1;
                self.gw_now += TICK_MS;
                let acts = self.gw.handle(GatewayEvent::Tick { now_ms: self.gw_now });
                self.gateway_actions(acts);
            }
            Action::CrashPrefill(id) => self.crash_prefill(id),
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
        let Some(r) = self.request(req) else { return };
        self.ghost(req).submitted = true;
        let tokens = (0..r.prompt).map(|t| req.0 as u32 * 10 + t).collect();
        let acts = self.gw.handle(GatewayEvent::Submit {
            req,
            tokens,
            max_tokens: r.max_tokens,
            sampling: sampling(),
            stop: vec![],
            trace: TraceContext::default(),
        });
        self.gateway_actions(acts);
    }

    fn deliver(&mut self, from: Node, to: Node, env: Envelope) {
        match (to, env) {
            (Node::Gateway, Envelope::Msg(msg)) => {
                let Node::Prefill(w) = from else {
                    let acts = self.gw.handle(GatewayEvent::FromWorker { from: DECODE, msg });
                    return self.gateway_actions(acts);
                };
                let acts = self.gw.handle(GatewayEvent::FromWorker { from: w, msg });
                self.gateway_actions(acts);
            }
            (Node::Gateway, Envelope::Closed) => {
                if let Node::Prefill(id) = from {
                    let acts = self.gw.handle(GatewayEvent::WorkerLeft { id });
                    self.gateway_actions(acts);
                }
            }
            (Node::Decode, env) => {
                let ev = match (from, env) {
                    // Broken: the driver takes `Fenced` for information and drops it.
                    (Node::Prefill(_), Envelope::Msg(Message::Fenced { .. })) if self.cfg.variant == Variant::DropFence => return,
                    (Node::Prefill(w), Envelope::Msg(msg)) => DecodeEvent::Prefill { from: w, msg },
                    (Node::Prefill(w), Envelope::Closed) => DecodeEvent::PrefillClosed { from: w },
                    (_, Envelope::Msg(msg)) => DecodeEvent::Gateway(msg),
                    (_, Envelope::Closed) => return,
                };
                self.decode_event(ev);
            }
            (Node::Prefill(w), Envelope::Msg(msg)) => self.prefill_message(w, msg),
            (Node::Prefill(w), Envelope::Closed) => {
                let Some(p) = self.prefills.iter_mut().find(|p| p.id == w) else { return };
                let acts = p.role.decode_closed(DECODE);
                self.prefill_actions(w, acts);
            }
        }
    }

    // ---------------------------------------------------------------- gateway driver

    fn gateway_actions(&mut self, acts: Vec<GatewayAction>) {
        for a in acts {
            match a {
                GatewayAction::ToWorker { to, msg } => {
                    if let Message::Reserve { req, .. } = &msg
                        && self.ghosts.get(req).is_some_and(|g| g.rejected)
                    {
                        self.violate(Prop::RejectionTerminal, format!("Reserve sent for {req} after it was rejected"));
                    }
                    let dest = if to == DECODE { Node::Decode } else { Node::Prefill(to) };
                    self.send(Node::Gateway, dest, msg);
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
            ClientOutput::Unavailable => Outcome::Unavailable,
        };
        let over = self.request(req).is_some_and(|r| self.cfg.over_capacity(r));
        let retry_variant = self.cfg.variant == Variant::RetryAfterReject;
        let g = self.ghost(req);
        g.outcomes.push(outcome);
        if matches!(outcome, Outcome::Rejected(_)) {
            g.rejected = true;
        }
        let outcomes = g.outcomes.clone();
        let retry = retry_variant && outcome == Outcome::Rejected(RejectReason::Capacity) && !g.retried;
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

    fn prefill_message(&mut self, w: WorkerId, msg: Message) {
        let keep = match &msg {
            Message::Prefill { req, tokens, decode, pages, sampling, trace } if self.cfg.variant == Variant::KeepRejectedJob => {
                // The incident's scheduler: a refused prompt becomes a 1-token placeholder.
                Some(PrefillJob {
                    req: *req,
                    tokens: tokens[..1.min(tokens.len())].to_vec(),
                    decode: *decode,
                    pages: pages.clone(),
                    sampling: sampling.clone(),
                    trace: trace.clone(),
                })
            }
            _ => None,
        };
        let Some(p) = self.prefills.iter_mut().find(|p| p.id == w) else { return };
        let acts = p.role.handle(msg);
        if let Some(job) = keep {
            let rejected = acts.iter().any(|a| matches!(a, PrefillAction::ToGateway(Message::Rejected { req, reason: RejectReason::ContextLength, .. }) if *req == job.req));
            if rejected {
                p.zombies.push_back(job);
            }
        }
        self.prefill_actions(w, acts);
    }

    /// A worker refused a request. Refusing it for context or capacity decides the
    /// request's fate (I3); a refusal of a duplicate message is about the message, and
    /// becomes the request's fate only if the gateway passes it to the client.
    fn worker_rejected(&mut self, req: RequestId, reason: RejectReason) {
        if matches!(reason, RejectReason::ContextLength | RejectReason::Capacity) {
            self.ghost(req).rejected = true;
        }
    }

    fn prefill_actions(&mut self, w: WorkerId, acts: Vec<PrefillAction>) {
        for a in acts {
            match a {
                PrefillAction::ToGateway(m) => {
                    if let Message::Rejected { req, reason, .. } = &m {
                        self.worker_rejected(*req, *reason);
                    }
                    self.send(Node::Prefill(w), Node::Gateway, m);
                }
                PrefillAction::ToDecode { to, msg } => {
                    if to == DECODE {
                        self.send(Node::Prefill(w), Node::Decode, msg);
                    }
                }
            }
        }
    }

    /// One unit of prefill work, as `prefill_worker::compute` does it: take the next job and
    /// lease its pages if none is running; check `keep_going`, compute one page and send its
    /// chunks, and after the last page report the outcome (no message is handled between
    /// the last chunk and `Done`, as in the server). Taking a job and computing its first
    /// page are one step: an abort that would arrive between them has the same effect on
    /// every other role as one arriving just before (`Fenced`, no chunk).
    fn prefill_step(&mut self, w: WorkerId) {
        let Some(i) = self.prefills.iter().position(|p| p.id == w) else { return };
        if self.prefills[i].job.is_none() {
            self.start_job(i);
        }
        let Some(mut j) = self.prefills[i].job.take() else { return };
        let p = &mut self.prefills[i];
        let req = j.job.req;
        let n = j.job.tokens.len();
        if !j.zombie && !p.role.keep_going(req) {
            let _ = j.seq.release(&mut p.pool);
            let acts = p.role.job_ended(req, JobOutcome::Stopped);
            return self.prefill_actions(w, acts);
        }
        let end = (j.done + LAYOUT.page_size).min(n);
        for pos in j.done..end {
            let v = kv_value(req, pos);
            let row = [v; LAYOUT.kv_heads * LAYOUT.head_dim];
            let (lease, slot) = j.seq.locate(pos).expect("prefill reserved its prompt");
            for layer in 0..LAYOUT.layers {
                p.pool.write(lease, layer, slot, &row, &row).expect("prefill writes its own pages");
            }
        }
        j.seq.commit(&p.pool, end - j.done).expect("prefill commits what it wrote");
        let chunks = export_chunks(&p.pool, &j.seq, &j.job.pages, j.done, end, &mut j.manifest);
        j.done = end;
        match chunks {
            Ok(chunks) => {
                for (header, data) in chunks {
                    if self.ghosts.get(&req).is_some_and(|g| g.rejected) {
                        self.violate(Prop::RejectionTerminal, format!("chunk for {req} sent after it was rejected"));
                    }
                    self.send(Node::Prefill(w), Node::Decode, Message::KvChunk { req, header, data });
                }
            }
            Err(e) => {
                let p = &mut self.prefills[i];
                let _ = j.seq.release(&mut p.pool);
                let acts = if j.zombie { Vec::new() } else { p.role.job_ended(req, JobOutcome::Failed(e.to_string())) };
                return self.prefill_actions(w, acts);
            }
        }
        let p = &mut self.prefills[i];
        if j.done < n {
            p.job = Some(j);
            return;
        }
        let _ = j.seq.release(&mut p.pool);
        let (tokens, first_token, manifest) = (n as u32, FIRST_TOKEN, j.manifest.digest());
        if j.zombie {
            self.send(Node::Prefill(w), Node::Decode, Message::Done { req, tokens, first_token, manifest });
        } else {
            let acts = p.role.job_ended(req, JobOutcome::Done { tokens, first_token, manifest });
            self.prefill_actions(w, acts);
        }
    }

    fn start_job(&mut self, i: usize) {
        let w = self.prefills[i].id;
        let p = &mut self.prefills[i];
        let (job, zombie) = match p.role.next_job() {
            Some(job) => (job, false),
            None => match p.zombies.pop_front() {
                Some(job) => (job, true),
                None => return,
            },
        };
        let req = job.req;
        let mut seq = SequenceKv::new(req);
        if let Err(e) = seq.reserve(&mut p.pool, job.tokens.len()) {
            let acts = if zombie { Vec::new() } else { p.role.job_ended(req, JobOutcome::Failed(format!("prefill KV pool: {e}"))) };
            return self.prefill_actions(w, acts);
        }
        p.job = Some(Job { job, seq, done: 0, manifest: Manifest::default(), zombie });
        if self.ghosts.get(&req).is_some_and(|g| g.rejected) {
            self.violate(Prop::RejectionTerminal, format!("prefill computes {req} after it was rejected"));
        }
    }

    fn crash_prefill(&mut self, id: WorkerId) {
        let Some(i) = self.prefills.iter().position(|p| p.id == id) else { return };
        self.budget.prefill_crashes -= 1;
        // Its process, pool, queue and job are gone; what it sent is still on the wire and
        // its connections close after it; what was on its way to it is lost.
        let fresh = WorkerId(self.next_worker);
        self.next_worker += 1;
        self.prefills[i] = Self::prefill_worker(self.cfg, fresh);
        self.net.retain(|(_, to), _| *to != Node::Prefill(id));
        for to in [Node::Gateway, Node::Decode] {
            self.net.entry((Node::Prefill(id), to)).or_default().push_back(Envelope::Closed);
        }
        let acts = self.gw.handle(GatewayEvent::WorkerJoined { id: fresh, role: Role::Prefill });
        self.gateway_actions(acts);
    }

    // ---------------------------------------------------------------- decode driver

    fn decode_event(&mut self, ev: DecodeEvent) {
        let before = self.dec.role.stats();
        let (chunk, done) = match &ev {
            DecodeEvent::Prefill { msg: Message::KvChunk { req, header, .. }, .. } => (Some((*req, header.slot_count as usize)), None),
            DecodeEvent::Prefill { msg: Message::Done { req, .. }, .. } => (None, Some(*req)),
            _ => (None, None),
        };
        let acts = self.dec.role.handle(&mut self.dec.pool, ev);
        let after = self.dec.role.stats();
        if let Some((req, slots)) = chunk
            && after.chunks_verified > before.chunks_verified
        {
            let g = self.ghost(req);
            g.landed += slots;
            if g.rejected {
                self.violate(Prop::RejectionTerminal, format!("decode accepted a chunk for {req} after it was rejected"));
            }
        }
        if let Some(req) = done
            && after.coverage_failed > before.coverage_failed
            && self.cfg.variant == Variant::TrustDone
        {
            // Broken: "transfer complete" is trusted; the request is started on what landed.
            let landed = self.ghosts.get(&req).map_or(0, |g| g.landed);
            self.check_start(req, landed);
        }
        self.decode_actions(acts);
    }

    /// I2 at the moment decode starts `req` with `coverage` prompt tokens in place; I3: a
    /// rejected request never reaches decode.
    fn check_start(&mut self, req: RequestId, coverage: usize) {
        let g = self.ghosts.get(&req).cloned().unwrap_or_default();
        if g.reserved_prompt != Some(coverage) || g.landed != coverage {
            self.violate(
                Prop::VerifiedCoverage,
                format!("{req} started with {coverage} prompt tokens; reserved {:?}, landed {}", g.reserved_prompt, g.landed),
            );
        }
        if g.rejected {
            self.violate(Prop::RejectionTerminal, format!("{req} started decoding after it was rejected"));
        }
    }

    fn decode_actions(&mut self, acts: Vec<DecodeAction>) {
        for a in acts {
            match a {
                DecodeAction::ToGateway(m) => {
                    match &m {
                        Message::Rejected { req, reason, .. } => self.worker_rejected(*req, *reason),
                        Message::Reserved { req, .. } => {
                            if self.ghosts.get(req).is_some_and(|g| g.rejected) {
                                self.violate(Prop::RejectionTerminal, format!("decode reserved pages for {req} after it was rejected"));
                            }
                            let prompt = self.request(*req).map(|r| r.prompt as usize);
                            self.ghost(*req).reserved_prompt = prompt;
                        }
                        _ => {}
                    }
                    self.send(Node::Decode, Node::Gateway, m);
                }
                DecodeAction::ToPrefill { to, msg } => self.send(Node::Decode, Node::Prefill(to), msg),
                DecodeAction::Start(ds) => {
                    let req = ds.req;
                    self.check_start(req, ds.seq.prompt_tokens());
                    let seq = ds.seq.into_sequence();
                    if seq.len() != self.ghosts.get(&req).and_then(|g| g.reserved_prompt).unwrap_or(usize::MAX) {
                        self.violate(Prop::VerifiedCoverage, format!("{req} started with {} committed prompt tokens", seq.len()));
                    }
                    self.read_all(req, &seq);
                    // The first token came with `Done`; the engine ends a one-token request
                    // at once, without a decode step.
                    let r = Running { seq, max_tokens: ds.max_tokens, generated: 1 };
                    if r.generated < r.max_tokens {
                        self.dec.running.insert(req, r);
                    } else {
                        self.finish(req, r);
                    }
                }
                DecodeAction::Stop { req } => {
                    if let Some(r) = self.dec.running.remove(&req)
                        && let Err(e) = r.seq.release(&mut self.dec.pool)
                    {
                        self.violate(Prop::SingleLease, format!("releasing stopped {req}: {e}"));
                    }
                    self.dec.role.finished(req);
                }
            }
        }
    }

    /// Attention, as the engine does it: every position of the sequence, every layer, read
    /// through `KvPool::read` with the sequence's own lease; the value must be the mock
    /// model's for this request and position.
    fn read_all(&mut self, req: RequestId, seq: &SequenceKv) {
        let positions = if self.cfg.variant == Variant::ReadPastWatermark { seq.reserved_tokens() } else { seq.len() };
        if let Err(why) = read_positions(&self.dec.pool, req, seq, positions) {
            self.violate(Prop::ReadIsolation, why);
        }
    }

    fn decode_step(&mut self, req: RequestId) {
        let Some(mut r) = self.dec.running.remove(&req) else { return };
        // Feed the last token: write its KV at the next position, commit it, attend.
        let pos = r.seq.len();
        let v = kv_value(req, pos);
        let row = [v; LAYOUT.kv_heads * LAYOUT.head_dim];
        let written = r.seq.locate(pos).and_then(|(lease, slot)| {
            (0..LAYOUT.layers).try_for_each(|layer| self.dec.pool.write(lease, layer, slot, &row, &row))
        });
        if let Err(e) = written.and_then(|()| r.seq.commit(&self.dec.pool, 1)) {
            self.violate(Prop::ReadIsolation, format!("{req} cannot write its own position {pos}: {e}"));
        }
        self.read_all(req, &r.seq);
        r.generated += 1;
        if r.generated < r.max_tokens {
            self.dec.running.insert(req, r);
        } else {
            self.finish(req, r);
        }
    }

    /// The decode loop ends a sequence: its pages go back, the gateway hears `Finished`.
    fn finish(&mut self, req: RequestId, r: Running) {
        let prompt = self.request(req).map_or(0, |q| q.prompt);
        if let Err(e) = r.seq.release(&mut self.dec.pool) {
            self.violate(Prop::SingleLease, format!("releasing finished {req}: {e}"));
        }
        self.dec.role.finished(req);
        let done = Message::Finished {
            req,
            finish: bulkhead_protocol::Finish::Length,
            text: String::new(),
            prompt_tokens: prompt,
            completion_tokens: r.generated,
        };
        self.send(Node::Decode, Node::Gateway, done);
    }

    // ---------------------------------------------------------------- state checks

    /// Checks on the state as it stands (I1 single lease, I4 no late writes), recorded
    /// as violations. Run after every step.
    pub fn check_state(&mut self) {
        let handles = self.handles();
        let refs = self.write_refs();
        let stats = self.dec.pool.stats();
        let mut problems: Vec<(Prop, String)> = Vec::new();
        let mut by_page: BTreeMap<u32, &observe::Handle> = BTreeMap::new();
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
                format!("pool has {} leased / {} quarantined pages, holders have {leased} / {quarantined}", stats.leased_pages, stats.quarantined_pages),
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

    /// Every live handle on a decode page: the decode role's reservations and quarantines
    /// (read from its `Debug` output, the only view of its private state) and the decode
    /// loop's sequences.
    fn handles(&self) -> Vec<observe::Handle> {
        let mut out = observe::handles(&format!("{:?}", self.dec.role));
        for r in self.dec.running.values() {
            for l in r.seq.leases() {
                out.push(observe::Handle { page: l.page().0, generation: l.generation().0, owner: l.owner(), quarantined: false });
            }
        }
        out
    }

    /// Every way a chunk for a decode page may still arrive: a `Prefill` on its way to a
    /// live prefill worker, a job in a prefill queue or running, a chunk on the wire.
    fn write_refs(&self) -> Vec<observe::WriteRef> {
        let mut out = Vec::new();
        for (&(from, to), q) in &self.net {
            for env in q {
                let Envelope::Msg(m) = env else { continue };
                match (m, from, to) {
                    (Message::Prefill { req, pages, .. }, _, Node::Prefill(_)) => {
                        for p in pages {
                            out.push(observe::WriteRef { page: p.page.0, generation: p.generation.0, req: *req, via: "Prefill on the wire" });
                        }
                    }
                    (Message::KvChunk { req, header, .. }, _, Node::Decode) => out.push(observe::WriteRef {
                        page: header.page.0,
                        generation: header.generation.0,
                        req: *req,
                        via: "chunk on the wire",
                    }),
                    _ => {}
                }
            }
        }
        for p in &self.prefills {
            out.extend(observe::queued_refs(&format!("{:?}", p.role)));
            let jobs = p.job.iter().map(|j| &j.job).chain(p.zombies.iter());
            for j in jobs {
                for r in &j.pages {
                    out.push(observe::WriteRef { page: r.page.0, generation: r.generation.0, req: j.req, via: "prefill job" });
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
            && self.gw.in_flight() == 0
            && (self.dec.role.pending(), self.dec.role.fencing(), self.dec.role.decoding()) == (0, 0, 0)
            && self.dec.running.is_empty()
            && self.prefills.iter().all(|p| p.job.is_none() && p.zombies.is_empty() && p.role.queued() == 0 && !p.role.busy())
            && full(&self.dec.pool)
            && self.prefills.iter().all(|p| full(&p.pool))
    }

    /// Every request submitted and ended for its client.
    pub fn requests_ended(&self) -> bool {
        self.ghosts.values().all(|g| g.submitted && (g.client_gone || !g.outcomes.is_empty()))
    }

    /// Every request that fits finished, every one that does not was rejected.
    pub fn all_served(&self) -> bool {
        self.ghosts.iter().all(|(req, g)| {
            let over = self.request(*req).is_some_and(|r| self.cfg.over_capacity(r));
            g.outcomes == [if over { Outcome::Rejected(RejectReason::ContextLength) } else { Outcome::Finished }]
        })
    }

    // ---------------------------------------------------------------- fingerprint

    /// The canonical description of the state the checker deduplicates on (see
    /// [`crate::fingerprint`]): every role's and pool's `Debug` output, the driver's jobs
    /// and sequences, the network, the budgets and the ghost state.
    pub fn describe(&self) -> String {
        let mut s = String::with_capacity(4096);
        // Clocks and deadlines are read only by the next tick; once a role can tick no more,
        // they are dead state and two worlds that differ only there behave alike.
        let mut gw = format!("{:?}", self.gw);
        if self.budget.gateway_ticks == 0 {
            gw = blank_numbers(&gw, &["now_ms: ", "deadline_ms: "]);
        }
        // The round-robin position matters only to requests not yet submitted.
        if self.ghosts.values().all(|g| g.submitted) && self.cfg.variant != Variant::RetryAfterReject {
            gw = blank_numbers(&gw, &["next_pick: "]);
        }
        let _ = write!(s, "gw {gw} | ");
        for p in &self.prefills {
            let _ = write!(s, "prefill {:?} {:?} zombies {:?} ", p.id, p.role, p.zombies);
            if let Some(j) = &p.job {
                let _ = write!(s, "job {:?} done {} zombie {} Manifest({}) ", j.job.req, j.done, j.zombie, j.manifest.digest());
            }
            let _ = write!(s, "free {} | ", p.pool.stats().free_pages);
        }
        let d = self.dec.pool.stats();
        let mut role = format!("{:?}", self.dec.role);
        if self.budget.decode_ticks == 0 {
            role = blank_numbers(&role, &["now_ms: ", "deadline_ms: "]);
        }
        let _ = write!(s, "decode {role} pool {} {} {} running [", d.free_pages, d.leased_pages, d.quarantined_pages);
        for (req, r) in &self.dec.running {
            let _ = write!(s, "{req:?} {:?} {} ", r.seq, r.generated);
        }
        let _ = write!(s, "] | net ");
        for ((from, to), q) in &self.net {
            let _ = write!(s, "{from:?}->{to:?} {q:?} ");
        }
        let _ = write!(s, "| ghosts {:?} budget {:?} next {}", self.ghosts, self.budget, self.next_worker);
        s
    }

    /// A readable dump of the world, for counterexamples and the explorer.
    pub fn dump(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "gateway: {:?}", self.gw);
        for p in &self.prefills {
            let _ = writeln!(s, "prefill {}: {:?}", p.id, p.role);
            if let Some(j) = &p.job {
                let _ = writeln!(s, "  job {} done {}/{} zombie {}", j.job.req, j.done, j.job.tokens.len(), j.zombie);
            }
            let _ = writeln!(s, "  pool {:?}", p.pool.stats());
        }
        let _ = writeln!(s, "decode: {:?}", self.dec.role);
        let _ = writeln!(s, "  pool {:?}", self.dec.pool.stats());
        for (req, r) in &self.dec.running {
            let _ = writeln!(s, "  running {req}: {} tokens, {} generated", r.seq.len(), r.generated);
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

/// `s` with the number after each of `keys` replaced by `_`.
fn blank_numbers(s: &str, keys: &[&str]) -> String {
    let mut hits: Vec<usize> = keys.iter().flat_map(|k| s.match_indices(k).map(move |(i, _)| i + k.len())).collect();
    hits.sort_unstable();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    for at in hits {
        out.push_str(&s[i..at]);
        out.push('_');
        i = at + s[at..].bytes().take_while(u8::is_ascii_digit).count();
    }
    out.push_str(&s[i..]);
    out
}

fn full(pool: &KvPool) -> bool {
    let s = pool.stats();
    s.free_pages == s.total_pages
}

/// Reads positions `0..positions` of `seq` through the pool and checks each holds the mock
/// model's value for `req`.
fn read_positions(pool: &KvPool, req: RequestId, seq: &SequenceKv, positions: usize) -> Result<(), String> {
    let hd = LAYOUT.head_dim;
    for pos in 0..positions {
        let (lease, slot) = seq.locate(pos).map_err(|e| format!("{req} position {pos}: {e}"))?;
        for layer in 0..LAYOUT.layers {
            let r = pool.read(lease, layer).map_err(|e| format!("{req} read of page {} refused: {e}", lease.page()))?;
            if slot >= r.len() {
                return Err(format!("{req} read position {pos} (page {} slot {slot}) past the watermark {}", lease.page(), r.len()));
            }
            let want = kv_value(req, pos);
            for head in 0..LAYOUT.kv_heads {
                for x in [&r.k_head(head)[slot * hd..(slot + 1) * hd], &r.v_head(head)[slot * hd..(slot + 1) * hd]] {
                    if x.iter().any(|v| v.to_f32() != want) {
                        return Err(format!("{req} position {pos} holds {:?}, not its own KV {want}", x.iter().map(|v| v.to_f32()).collect::<Vec<_>>()));
                    }
                }
            }
        }
    }
    Ok(())
}
