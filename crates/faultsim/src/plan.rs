//! What one schedule is: drawn entirely from its seed before it runs.
//!
//! A plan fixes the cluster (page layout, how many prefill and decode workers, pool sizes
//! and the contexts they advertise, whether the gateway checks the context itself, the
//! timeouts), the requests (fitting ones, some filling the context exactly; prompts over
//! the context, `max_tokens` in the billions, empty prompts, zero `max_tokens`), when each
//! is submitted and whether its client leaves, and the faults with their times. Which
//! connection a fault hits is drawn when it fires, among those alive then.

use std::collections::BTreeMap;

use bulkhead_kv::{KvLayout, RequestId};
use bulkhead_protocol::gateway::request_id;
use bulkhead_protocol::{GatewayId, GrammarSpec, Role, Sampling};

use crate::dice::Dice;
use crate::model::Shape;

/// What a worker process is started with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerPlan {
    /// Prefill or decode.
    pub role: Role,
    /// Pages in its KV pool.
    pub pool_pages: usize,
    /// The context it advertises: its pool and the model's context, whichever is smaller
    /// (I5: a worker never advertises more than its pool holds).
    pub context: usize,
}

/// The kind of request, by construction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    /// Fits every worker's context.
    Fits,
    /// Prompt plus `max_tokens` over the served context, or a prompt over the prefill's.
    OverContext,
    /// `max_tokens` far beyond any context.
    HugeMaxTokens,
    /// No prompt tokens.
    EmptyPrompt,
    /// `max_tokens` of zero.
    ZeroMaxTokens,
}

/// One client request.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestPlan {
    /// Its id at the gateway.
    pub req: RequestId,
    /// How it was made.
    pub kind: RequestKind,
    /// Prompt tokens; the first one is unique within the schedule, so no two prompts
    /// share a prefix and any foreign KV shows in the output, except the prompts drawn as
    /// copies of an earlier one (with the prefix cache: the same prefix, of the same or
    /// the other tenant).
    pub tokens: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// Its tenant (0 or 1): its prefix-cache scope.
    pub tenant: u32,
    /// How its tokens are picked: mostly greedy; some requests carry a grammar,
    /// log-probabilities, penalties or seeded sampling, which every worker that picks a
    /// token (the prefill's first, the decode's after a handoff or a retraction) must
    /// follow alike.
    pub sampling: Sampling,
}

/// A fault; its target is drawn when it fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// A KV connection (prefill → decode) dies.
    CutKv,
    /// A worker's gateway connection dies; the worker exits when it sees the close, as
    /// the production workers do. A fresh one registers `restart_after_ms` later.
    CutGateway { restart_after_ms: Option<u64> },
    /// Bytes the decoder refuses reach one end of a live connection, which closes it.
    Garble,
    /// A worker process dies: its role state and pool are lost. A fresh one (new id, new
    /// pool) registers `restart_after_ms` later.
    Crash { role: Role, restart_after_ms: Option<u64> },
    /// A gateway process dies (never the last one alive): its connections close, its
    /// clients are gone with it, and the workers end its requests on their own. It is not
    /// restarted.
    LoseGateway,
}

/// A fault that strikes mid-transfer: right after the schedule's `after_chunks`-th KV
/// chunk is sent, on the connection or the workers of that chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MidTransfer {
    /// Which chunk of the schedule (1 = the first) triggers it.
    pub after_chunks: u64,
    /// What happens.
    pub what: MidTransferFault,
    /// A crashed worker's replacement registers this much later.
    pub restart_after_ms: Option<u64>,
}

/// What a [`MidTransfer`] fault does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MidTransferFault {
    /// The KV connection carrying the chunk dies.
    Cut,
    /// The prefill worker sending it dies.
    CrashPrefill,
    /// The decode worker receiving it dies.
    CrashDecode,
}

/// Something that happens at a planned time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Planned {
    /// A worker process starts and registers.
    Start(WorkerPlan),
    /// A client submits request `RequestPlan::req`.
    Submit(RequestId),
    /// The client of a request goes away.
    ClientGone(RequestId),
    /// A fault.
    Fault(Fault),
}

/// Deliberately broken drivers, to show that the checks bite. `None` in every normal
/// schedule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sabotage {
    /// The production drivers.
    #[default]
    None,
    /// The gateway driver loses the first token of every request on its way to the client.
    DropFirstToken,
    /// The decode driver takes `Fenced` for information and drops it, so quarantined pages
    /// wait for a fence that never comes.
    DropFences,
    /// The decode driver takes a transfer timeout for a fence, releasing the quarantined
    /// pages while the prefill worker may still be sending chunks for them (I4).
    ReleaseOnTimeout,
    /// The decode loop leaves a speculative step's rejected drafts' KV in place instead of
    /// rolling it back (I2 as amended for speculation): later steps attend to it.
    KeepRejectedDrafts,
}

/// What a run may do besides the production behaviour.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// No faults at all (requests, aborts and timeouts still happen).
    pub no_faults: bool,
    /// Per mille of frames delivered twice on their connection (breaks TCP's contract).
    pub raw_duplicates: u64,
    /// A broken driver.
    pub sabotage: Sabotage,
}

/// Everything a schedule does, drawn from its seed.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The seed it was drawn from.
    pub seed: u64,
    /// Page layout of every pool.
    pub layout: KvLayout,
    /// Prefill workers are started with this.
    pub prefill: WorkerPlan,
    /// Decode workers are started with this.
    pub decode: WorkerPlan,
    /// The model's context (the gateway serves at most this).
    pub model_context: usize,
    /// Gateways (1 or 2); request `i` goes to gateway `i % gateways` (its id says which),
    /// and every worker registers with each.
    pub gateways: u8,
    /// Whether the gateway checks the context itself (off: the workers' checks alone).
    pub gateway_check: bool,
    /// The gateway's request timeout.
    pub request_timeout_ms: u64,
    /// The decode workers' transfer timeout.
    pub transfer_timeout_ms: u64,
    /// Prefill compute chunk and transfer batch, in pages.
    pub chunk_pages: usize,
    /// Chunks one prefill step computes in all, of as many jobs (batched prefill).
    pub step_chunks: usize,
    /// Virtual time one prefill chunk takes, smallest and largest.
    pub prefill_cost_ms: (u64, u64),
    /// Virtual time one decode step takes, smallest and largest.
    pub decode_cost_ms: (u64, u64),
    /// Per mille of connections that are slow.
    pub slow_links: u64,
    /// The requests, by id.
    pub requests: Vec<RequestPlan>,
    /// What happens when, in time order.
    pub events: Vec<(u64, Planned)>,
    /// A fault triggered by the transfer itself rather than the clock.
    pub mid_transfer: Option<MidTransfer>,
    /// Whether prefill workers run a prefix cache (and requests carry their tenant's
    /// scope).
    pub prefix_cache: bool,
    /// With the cache, the decode worker computes a rest of at most this many tokens
    /// itself (`DecodeConfig::local_prefill_tokens`): every other cached schedule, by the
    /// seed's parity, so no draw of the dice moves.
    pub local_prefill: usize,
    /// Extras beyond production behaviour.
    pub options: Options,
}

impl Plan {
    /// The context the gateway serves once every role has registered: the smallest any
    /// worker advertises.
    pub fn served_context(&self) -> usize {
        self.prefill.context.min(self.decode.context).min(self.model_context)
    }

    /// Draws a plan within `shape`.
    pub fn draw(seed: u64, dice: &mut Dice, shape: &Shape, options: Options) -> Plan {
        let layout = *dice.pick(&shape.layouts).unwrap_or(&KvLayout { layers: 1, kv_heads: 1, head_dim: 2, page_size: 4 });
        let ps = layout.page_size;
        let worker = |role, pages: u64| {
            let pool_pages = pages as usize;
            WorkerPlan { role, pool_pages, context: (pool_pages * ps).min(shape.model_context) }
        };
        let (dlo, dhi) = shape.decode_pages;
        // Often a pool that holds only a request or two: near-full pools and capacity refusals.
        let decode_pages = if dice.chance(400) { dice.range(dlo, dlo + 4) } else { dice.range(dlo, dhi) };
        let decode = worker(Role::Decode, decode_pages);
        let prefill = worker(Role::Prefill, dice.range(shape.prefill_pages.0, shape.prefill_pages.1));
        let mut plan = Plan {
            seed,
            layout,
            prefill,
            decode,
            model_context: shape.model_context,
            gateways: 1,
            gateway_check: dice.chance(700),
            request_timeout_ms: if dice.chance(200) { dice.range(30, 400) } else { dice.range(1_500, 4_000) },
            transfer_timeout_ms: if dice.chance(200) { dice.range(10, 200) } else { dice.range(800, 3_000) },
            chunk_pages: dice.range(1, 2) as usize,
            step_chunks: dice.range(1, 3) as usize,
            prefill_cost_ms: (1, dice.range(1, 10)),
            decode_cost_ms: (1, dice.range(1, 5)),
            slow_links: if dice.chance(300) { 300 } else { 0 },
            requests: Vec::new(),
            events: Vec::new(),
            mid_transfer: None,
            prefix_cache: false,
            local_prefill: 0,
            options,
        };
        let mut events = Vec::new();
        for _ in 0..dice.range(1, 3) {
            events.push((dice.range(0, 5), Planned::Start(prefill)));
        }
        for _ in 0..dice.range(1, 2) {
            events.push((dice.range(0, 5), Planned::Start(decode)));
        }
        let spread = *dice.pick(&[0, 50, 300, 1_500]).unwrap_or(&0);
        let base = dice.below(u64::from(shape.vocab)) as u32;
        for i in 0..dice.range(1, shape.max_requests) {
            let req = RequestId(i + 1);
            let r = plan.draw_request(dice, shape, req, (base + i as u32) % shape.vocab);
            // Most clients come once the workers had time to register; a few before.
            let at = if dice.chance(50) { dice.range(0, 30) } else { dice.range(30, 30 + spread) };
            events.push((at, Planned::Submit(req)));
            if dice.chance(150) {
                events.push((at + dice.range(0, 400), Planned::ClientGone(req)));
            }
            plan.requests.push(r);
        }
        if !options.no_faults {
            let faults = *dice.pick(&[0, 0, 1, 1, 2, 3]).unwrap_or(&0);
            for _ in 0..faults {
                let restart = |dice: &mut Dice| dice.chance(700).then(|| dice.range(5, 300));
                let fault = match dice.below(100) {
                    0..25 => Fault::CutKv,
                    25..40 => Fault::CutGateway { restart_after_ms: restart(dice) },
                    40..60 => Fault::Garble,
                    _ => {
                        let role = if dice.chance(500) { Role::Prefill } else { Role::Decode };
                        Fault::Crash { role, restart_after_ms: restart(dice) }
                    }
                };
                events.push((dice.range(0, spread + 300), Planned::Fault(fault)));
            }
        }
        if !options.no_faults && dice.chance(250) {
            let what = *dice
                .pick(&[MidTransferFault::Cut, MidTransferFault::CrashPrefill, MidTransferFault::CrashDecode])
                .unwrap_or(&MidTransferFault::Cut);
            let restart_after_ms = dice.chance(700).then(|| dice.range(5, 300));
            plan.mid_transfer = Some(MidTransfer { after_chunks: dice.range(1, 8), what, restart_after_ms });
        }
        // Stable: events planned for the same time keep the order they were drawn in.
        events.sort_by_key(|(at, _)| *at);
        // Drawn last, so the rest of every schedule is what it was before the cache.
        plan.prefix_cache = dice.chance(800);
        for i in 0..plan.requests.len() {
            plan.requests[i].tenant = dice.below(2) as u32;
            // Some fitting prompts repeat an earlier one's prefix (a chat's system prompt,
            // a next turn), with a suffix of their own, under either tenant.
            let earlier: Vec<usize> = (0..i).filter(|&j| plan.requests[j].kind == RequestKind::Fits).collect();
            if plan.requests[i].kind == RequestKind::Fits
                && dice.chance(400)
                && let Some(&j) = dice.pick(&earlier)
            {
                let n = plan.requests[i].tokens.len();
                let shared = plan.requests[j].tokens.len().min(n);
                let prefix = plan.requests[j].tokens[..shared].to_vec();
                plan.requests[i].tokens[..shared].copy_from_slice(&prefix);
            }
        }
        // Drawn after the cache, for the same reason.
        for r in &mut plan.requests {
            if dice.chance(300) {
                r.sampling = sampling_variant(dice.below(3));
            }
        }
        if plan.prefix_cache && seed.is_multiple_of(2) {
            plan.local_prefill = 2 * ps;
        }
        // Drawn last, so the rest of every schedule is what it was before several gateways:
        // some schedules run two, the requests alternating between them, and may lose one.
        if dice.chance(300) {
            plan.gateways = 2;
            let ids: BTreeMap<RequestId, RequestId> =
                plan.requests.iter().enumerate().map(|(i, r)| (r.req, request_id(GatewayId((i % 2) as u8), r.req.0))).collect();
            for r in &mut plan.requests {
                r.req = ids[&r.req];
            }
            for (_, e) in &mut events {
                if let Planned::Submit(req) | Planned::ClientGone(req) = e {
                    *req = ids[req];
                }
            }
            if !options.no_faults && dice.chance(400) {
                events.push((dice.range(0, spread + 300), Planned::Fault(Fault::LoseGateway)));
                events.sort_by_key(|(at, _)| *at);
            }
        }
        plan.events = events;
        plan
    }

    fn draw_request(&self, dice: &mut Dice, shape: &Shape, req: RequestId, first: u32) -> RequestPlan {
        let served = self.served_context();
        let prompt_of = |dice: &mut Dice, n: usize| -> Vec<u32> {
            let mut t = vec![first];
            t.extend((1..n).map(|_| dice.below(u64::from(shape.vocab)) as u32));
            t.truncate(n);
            t
        };
        // A prompt that fits the served context with room for at least one token.
        let fitting_prompt = |dice: &mut Dice| dice.range(1, shape.max_prompt.min(served - 1) as u64) as usize;
        let kind = match dice.below(100) {
            0..70 => RequestKind::Fits,
            70..82 => RequestKind::OverContext,
            82..88 => RequestKind::HugeMaxTokens,
            88..94 => RequestKind::EmptyPrompt,
            _ => RequestKind::ZeroMaxTokens,
        };
        let (tokens, max_tokens) = match kind {
            RequestKind::Fits => {
                let n = fitting_prompt(dice);
                let room = (served - n) as u64;
                // One in five fills the context exactly: the largest reservation there is.
                let max = if dice.chance(200) { room } else { dice.range(1, room.min(u64::from(shape.max_generate))) };
                (prompt_of(dice, n), max as u32)
            }
            RequestKind::OverContext if dice.chance(500) => {
                // Over the prefill's limit: the incident's prompt when the gateway check is off.
                let n = self.prefill.context + dice.range(1, 8) as usize;
                (prompt_of(dice, n), dice.range(1, 4) as u32)
            }
            RequestKind::OverContext => {
                let n = fitting_prompt(dice);
                (prompt_of(dice, n), (served - n) as u32 + dice.range(1, 8) as u32)
            }
            RequestKind::HugeMaxTokens => {
                let n = fitting_prompt(dice);
                (prompt_of(dice, n), *dice.pick(&[u32::MAX, 1 << 30, 100_000]).unwrap_or(&u32::MAX))
            }
            RequestKind::EmptyPrompt => (Vec::new(), dice.range(1, 4) as u32),
            RequestKind::ZeroMaxTokens => {
                let n = fitting_prompt(dice);
                (prompt_of(dice, n), 0)
            }
        };
        RequestPlan { req, kind, tokens, max_tokens, tenant: 0, sampling: Sampling::default() }
    }

    /// The request with id `req`.
    pub fn request(&self, req: RequestId) -> Option<&RequestPlan> {
        self.requests.iter().find(|r| r.req == req)
    }
}

/// A request's sampling other than plain greedy: a grammar with log-probabilities, seeded
/// sampling with penalties, or a JSON grammar with a repetition penalty.
fn sampling_variant(which: u64) -> Sampling {
    match which {
        0 => Sampling { grammar: Some(GrammarSpec::Regex("[a-z]+( [a-z]+)*".into())), logprobs: Some(2), ..Sampling::default() },
        1 => Sampling {
            temperature: 0.9,
            top_k: 40,
            seed: Some(7),
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            logprobs: Some(0),
            ..Sampling::default()
        },
        _ => Sampling { grammar: Some(GrammarSpec::JsonObject), repetition_penalty: 1.3, min_p: 0.05, ..Sampling::default() },
    }
}
