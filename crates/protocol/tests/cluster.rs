//! The three role state machines wired together in process through the production driver
//! core ([`bulkhead_protocol::driver`]), with real KV pools, a mock model (KV values are a
//! function of request and position) and a network that delivers messages one at a time,
//! so every protocol step can be interrupted.

use std::collections::{BTreeMap, VecDeque};

use bulkhead_kv::{KvChecks, KvError, KvLayout, KvPool, PoolConfig, RequestId, SequenceKv};
use bulkhead_protocol::decode::{DecodeAction, DecodeConfig, DecodeEvent, DecodeRole, DecodeStart, LocalStart};
use bulkhead_protocol::driver::Honest;
use bulkhead_protocol::driver::decode::{DecodeDriver, DecodeEngine, DecodeLink, DecodePolicy, GenEvent};
use bulkhead_protocol::driver::prefill::{Batching, Chunk, First, LinkDown, PrefillCompute, PrefillDriver, PrefillLink, PrefillPolicy};
use bulkhead_protocol::gateway::{
    ClientOutput, GatewayAction, GatewayConfig, GatewayEvent, GatewayRole, GatewaySettings, Submission, TenantId,
};
use bulkhead_protocol::prefill::{PrefillConfig, PrefillEvent, PrefillJob, PrefillRole};
use bulkhead_protocol::*;

const PREFILL: WorkerId = WorkerId(1);
const DECODE: WorkerId = WorkerId(2);
const LAYOUT: KvLayout = KvLayout { layers: 2, kv_heads: 1, head_dim: 2, page_size: 4 };
const DIGEST: u64 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum To {
    Gateway(WorkerId),
    Decode { from_prefill: bool },
    Prefill,
}

type Wire = VecDeque<(To, Message)>;

/// The mock prefill model: position `p` of request `r` holds `kv_value(r, p)`; the first
/// token is always 7.
struct MockCompute;

impl PrefillCompute for MockCompute {
    type Error = KvError;
    fn compute(&mut self, pool: &mut KvPool, chunks: &mut [Chunk<'_>]) -> Result<Vec<Option<First>>, KvError> {
        chunks.iter_mut().map(|c| compute_one(pool, c)).collect()
    }
}

fn compute_one(pool: &mut KvPool, c: &mut Chunk<'_>) -> Result<Option<First>, KvError> {
    for pos in c.from..c.to {
        let (lease, slot) = c.seq.locate(pos)?;
        let v = kv_value(c.seq.owner(), pos);
        for layer in 0..LAYOUT.layers {
            pool.write(lease, layer, slot, &[v, v], &[v, v])?;
        }
    }
    c.seq.commit(pool, c.to - c.from)?;
    Ok((c.to == c.tokens.len()).then_some((7, None)))
}

/// The mock decode loop: every prompt position must read back the mock model's value;
/// each step emits a token "x", and "!" with `Finished` once `max_tokens` are out.
struct MockEngine {
    pool: KvPool,
    decoding: BTreeMap<RequestId, (SequenceKv, u32)>,
}

impl DecodeEngine for MockEngine {
    type Error = KvError;
    fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }
    fn add_verified(&mut self, ds: DecodeStart) -> Result<Vec<GenEvent>, KvError> {
        let seq = ds.seq.into_sequence();
        for pos in 0..seq.len() {
            let (lease, slot) = seq.locate(pos)?;
            let r = self.pool.read(lease, 0)?;
            assert_eq!(r.k_head(0)[slot * 2].to_f32(), kv_value(ds.req, pos), "decode reads its own prompt KV");
        }
        self.decoding.insert(ds.req, (seq, ds.max_tokens));
        Ok(Vec::new())
    }
    fn add_local(&mut self, ls: LocalStart) -> Result<Vec<GenEvent>, KvError> {
        // This cluster never configures local prefill.
        ls.seq.into_sequence().release(&mut self.pool).map_err(|u| u.error)?;
        Err(KvError::NotReserved { pos: 0, reserved: 0 })
    }
    fn step(&mut self) -> Result<Vec<GenEvent>, KvError> {
        let mut out = Vec::new();
        let reqs: Vec<RequestId> = self.decoding.keys().copied().collect();
        for req in reqs {
            let Some((_, left)) = self.decoding.get_mut(&req) else { continue };
            *left -= 1;
            if *left > 0 {
                out.push(GenEvent::Token { req, token: 9, text: "x".into(), logprobs: None });
                continue;
            }
            let Some((seq, _)) = self.decoding.remove(&req) else { continue };
            let prompt_tokens = seq.len() as u32;
            seq.release(&mut self.pool).map_err(|u| u.error)?;
            out.push(GenEvent::Finished { req, finish: FinishReason::Length, text: "!".into(), prompt_tokens, completion_tokens: 1 });
        }
        Ok(out)
    }
    fn abort(&mut self, req: RequestId) {
        if let Some((seq, _)) = self.decoding.remove(&req) {
            seq.release(&mut self.pool).unwrap();
        }
    }
    fn active(&self) -> usize {
        self.decoding.len()
    }

    // This loop gives every finished sequence back itself (no decode-side cache here).
    fn keep_finished(&mut self) {}

    fn take_retired(&mut self) -> Vec<bulkhead_protocol::decode::Retired> {
        Vec::new()
    }

    // Nothing is computed here (no local prefill in this cluster).
    fn lend_computed(&mut self, _: RequestId, _: &mut dyn FnMut(&mut KvPool, &mut bulkhead_kv::SequenceKv)) -> bool {
        false
    }
}

/// The prefill worker's transport: onto the wire.
struct PrefillWire<'a>(&'a mut Wire);

impl PrefillLink for PrefillWire<'_> {
    fn to_gateway(&mut self, msg: Message) {
        self.0.push_back((To::Gateway(PREFILL), msg));
    }
    fn to_decode(&mut self, _: WorkerId, msg: Message) -> Result<(), LinkDown> {
        self.0.push_back((To::Decode { from_prefill: true }, msg));
        Ok(())
    }
    fn connect(&mut self, _: WorkerId, _: &str) {}
    fn rejoin(&mut self) {}
}

/// The decode worker's transport: onto the wire.
struct DecodeWire<'a>(&'a mut Wire);

impl DecodeLink for DecodeWire<'_> {
    fn to_gateway(&mut self, msg: Message) {
        self.0.push_back((To::Gateway(DECODE), msg));
    }
    fn to_prefill(&mut self, _: WorkerId, msg: Message) {
        self.0.push_back((To::Prefill, msg));
    }
    fn disconnect(&mut self, _: WorkerId) {}
}

struct Cluster<PP: PrefillPolicy = Honest, DP: DecodePolicy = Honest> {
    gw: GatewayRole,
    dec: DecodeDriver<MockEngine, DP>,
    pre: PrefillDriver<PP>,
    ppool: KvPool,
    net: Wire,
    outputs: BTreeMap<RequestId, Vec<ClientOutput>>,
    now: u64,
}

impl Cluster {
    fn new(prefill_pool_tokens: usize, decode_pool_tokens: usize, gateway_check: bool) -> Self {
        Cluster::with_policies(prefill_pool_tokens, decode_pool_tokens, gateway_check, Honest, Honest)
    }
}

impl<PP: PrefillPolicy, DP: DecodePolicy> Cluster<PP, DP> {
    fn with_policies(prefill_pool_tokens: usize, decode_pool_tokens: usize, gateway_check: bool, pp: PP, dp: DP) -> Self {
        let pool = |t: usize| KvPool::new(PoolConfig { layout: LAYOUT, pages: t / LAYOUT.page_size, checks: KvChecks::all() }).unwrap();
        let model_context = prefill_pool_tokens.max(decode_pool_tokens);
        let mut gw = GatewayRole::new(GatewayConfig {
            model_context,
            model_digest: DIGEST,
            tenants: Default::default(),
            settings: GatewaySettings {
                admission_check: gateway_check,
                request_timeout_ms: 10_000,
                max_queued: 16,
                queue_timeout_ms: 10_000,
                migration_limit: 3,
                prefill_window_tokens: 0,
            },
        });
        let (ppool, dpool) = (pool(prefill_pool_tokens), pool(decode_pool_tokens));
        // Registration's introductions are the transports' business here: the KV
        // connection is simply open.
        gw.join(&Hello::for_pool(Role::Prefill, PREFILL, DIGEST, &ppool, prefill_pool_tokens, String::new())).unwrap();
        gw.join(&Hello::for_pool(Role::Decode, DECODE, DIGEST, &dpool, decode_pool_tokens, String::new())).unwrap();
        let mut role = PrefillRole::new(PrefillConfig { max_prompt: prefill_pool_tokens, page_size: LAYOUT.page_size, keepalive_ms: 250 });
        role.handle(PrefillEvent::DecodeConnected { decode: DECODE });
        let engine = MockEngine { pool: dpool, decoding: BTreeMap::new() };
        let mut c = Cluster {
            gw,
            dec: DecodeDriver::with_policy(
                DecodeRole::new(DecodeConfig { max_context: decode_pool_tokens, transfer_timeout_ms: 1_000, local_prefill_tokens: 0 }),
                engine,
                dp,
            ),
            pre: PrefillDriver::with_policy(role, Batching::one_chunk(LAYOUT.page_size), pp),
            ppool,
            net: VecDeque::new(),
            outputs: BTreeMap::new(),
            now: 0,
        };
        c.decode_event(DecodeEvent::PrefillConnected { from: PREFILL });
        c
    }

    fn dpool(&self) -> &KvPool {
        &self.dec.engine().pool
    }

    fn gateway(&mut self, ev: GatewayEvent) {
        for a in self.gw.handle(ev) {
            match a {
                GatewayAction::ToWorker { to, msg } => {
                    let dest = if to == DECODE { To::Decode { from_prefill: false } } else { To::Prefill };
                    self.net.push_back((dest, msg));
                }
                GatewayAction::ToClient { req, out } => self.outputs.entry(req).or_default().push(out),
            }
        }
    }

    fn submit(&mut self, req: u64, prompt: u32, max_tokens: u32) {
        let tokens = (0..prompt).map(|i| i + req as u32 * 100).collect();
        self.gateway(GatewayEvent::Submit {
            req: RequestId(req),
            submission: Submission {
                tokens,
                max_tokens,
                max_tokens_set: true,
                sampling: Sampling::default(),
                stop: vec![],
                trace: TraceContext::default(),
                tenant: TenantId(0),
                cache: None,
                priority: 0,
            },
        });
    }

    fn decode_event(&mut self, ev: DecodeEvent) {
        self.dec.handle(ev, &mut DecodeWire(&mut self.net));
    }

    /// Deliver the next message; false if none.
    fn deliver(&mut self) -> bool {
        let Some((to, m)) = self.net.pop_front() else { return false };
        match to {
            To::Gateway(from) => self.gateway(GatewayEvent::FromWorker { from, msg: m }),
            To::Decode { from_prefill: true } => self.decode_event(DecodeEvent::Prefill { from: PREFILL, msg: m }),
            To::Decode { from_prefill: false } => self.decode_event(DecodeEvent::Gateway { from: GatewayId(0), msg: m }),
            To::Prefill => self.pre.handle(PrefillEvent::Gateway { from: GatewayId(0), msg: m }, &mut PrefillWire(&mut self.net)),
        }
        true
    }

    /// One unit of prefill work: start a job and compute its first page, or compute and
    /// send the next page, or end it.
    fn prefill_step(&mut self) -> bool {
        !self.pre.step(&mut MockCompute, &mut self.ppool, &mut PrefillWire(&mut self.net)).is_empty()
    }

    /// One decode step for every running sequence: a token, or the end.
    fn decode_step(&mut self) -> bool {
        let busy = self.dec.engine().active() > 0;
        self.dec.step(&mut DecodeWire(&mut self.net)).unwrap();
        busy
    }

    fn tick(&mut self, ms: u64) {
        self.now += ms;
        self.decode_event(DecodeEvent::Tick { now_ms: self.now });
        self.gateway(GatewayEvent::Tick { now_ms: self.now });
    }

    fn run(&mut self) {
        for _ in 0..10_000 {
            if !(self.deliver() || self.prefill_step() || self.decode_step()) {
                return;
            }
        }
        panic!("cluster did not quiesce");
    }

    /// Every request has exactly one terminal outcome; pools full, nothing quarantined.
    fn assert_clean(&self, reqs: &[u64]) {
        for r in reqs {
            let outs = self.outputs.get(&RequestId(*r)).map_or(&[][..], Vec::as_slice);
            let terminal = outs.iter().filter(|o| o.is_terminal()).count();
            assert!(terminal <= 1, "request {r}: {outs:?}");
        }
        for (name, p) in [("decode", self.dpool()), ("prefill", &self.ppool)] {
            let s = p.stats();
            assert_eq!((s.free_pages, s.quarantined_pages), (s.total_pages, 0), "{name} pool not back to full: {s:?}");
            p.check_invariants();
        }
        assert!(self.dec.is_idle() && self.pre.is_idle());
        assert_eq!(self.gw.in_flight(), 0);
    }

    fn terminal(&self, req: u64) -> Option<&ClientOutput> {
        self.outputs.get(&RequestId(req))?.iter().find(|o| o.is_terminal())
    }
}

fn kv_value(req: RequestId, pos: usize) -> f32 {
    ((req.0 % 16) * 64 + pos as u64 % 64) as f32
}

#[test]
fn a_request_flows_through_reserve_prefill_transfer_and_decode() {
    let mut c = Cluster::new(64, 128, true);
    c.submit(1, 10, 3);
    c.run();
    assert!(matches!(c.terminal(1), Some(ClientOutput::Finished { prompt_tokens: 10, .. })), "{:?}", c.outputs);
    assert_eq!(c.dec.role().stats().coverage_verified, 1);
    assert_eq!(c.dec.role().stats().chunks_verified, 3);
    c.assert_clean(&[1]);
}

/// The incident at the protocol level: the prefill pool is smaller than the prompt. With
/// the gateway's check on, nothing is ever reserved; with it off, the decode worker's
/// reservation is fenced by the prefill's rejection and released. Either way: rejected.
#[test]
fn a_prompt_longer_than_the_prefill_pool_is_rejected_with_or_without_the_gateway_check() {
    for check in [true, false] {
        let mut c = Cluster::new(16, 128, check);
        c.submit(1, 40, 4);
        c.run();
        if let Err(e) = incident_outcome(&c) {
            panic!("gateway check {check}: {e}");
        }
        let leased = c.dpool().stats().leases_granted;
        assert_eq!(leased == 0, check, "gateway check {check}: decode leases granted {leased}");
        c.assert_clean(&[1]);
    }
}

/// What the incident test demands of request 1 (a prompt over the prefill pool): rejected
/// for its context, never computed, nothing handed to decode.
fn incident_outcome<PP: PrefillPolicy, DP: DecodePolicy>(c: &Cluster<PP, DP>) -> Result<(), String> {
    if !matches!(c.terminal(1), Some(ClientOutput::Rejected { reason: RejectReason::ContextLength, .. })) {
        return Err(format!("the over-long request was not rejected: {:?}", c.outputs));
    }
    if c.ppool.stats().leases_granted != 0 {
        return Err("the prefill computed a rejected prompt".into());
    }
    if c.dec.role().stats().chunks_verified != 0 {
        return Err("decode accepted KV for a rejected prompt".into());
    }
    Ok(())
}

/// The incident's scheduler: a prompt the role refused keeps flowing as a 1-token
/// placeholder, behind the role's back.
struct PlaceholderScheduler;

impl PrefillPolicy for PlaceholderScheduler {
    fn refused(&mut self, job: &PrefillJob) -> Option<PrefillJob> {
        let mut keep = job.clone();
        keep.tokens.truncate(1);
        keep.pages.truncate(1);
        Some(keep)
    }
}

/// The incident's decode side: "transfer complete" is trusted, so a completion claim the
/// verifier refuses is answered as if the prompt had been read.
struct TrustsDone;

impl DecodePolicy for TrustsDone {
    fn outbound(&mut self, acts: Vec<DecodeAction>, _: &mut Vec<DecodeEvent>) -> Vec<DecodeAction> {
        acts.into_iter()
            .map(|a| match a {
                DecodeAction::ToGateway(Message::Failed { req, reason: FailReason::TransferRefused, .. }) => {
                    let done = Message::Finished {
                        req,
                        finish: FinishReason::Stop,
                        text: "fluent".into(),
                        prompt_tokens: 40,
                        completion_tokens: 1,
                        cached_tokens: 0,
                    };
                    DecodeAction::ToGateway(done)
                }
                a => a,
            })
            .collect()
    }
}

/// The incident's exact bug put back, in test drivers only (the production roles and
/// verifier have no switch for it): the gateway's check off, the prefill driver keeps the
/// refused prompt flowing as a 1-token placeholder, the decode driver trusts its "done".
/// The incident test above must catch it; if it did not, it would prove nothing.
#[test]
fn the_incident_bug_reintroduced_is_caught_by_the_incident_test() {
    let mut c = Cluster::with_policies(16, 128, false, PlaceholderScheduler, TrustsDone);
    c.submit(1, 40, 4);
    c.run();
    let caught = incident_outcome(&c);
    assert!(caught.is_err(), "the incident test let the incident's bug through: {:?}", c.outputs);
    // And what the bug did: the request was answered as if its prompt had been read.
    assert!(matches!(c.terminal(1), Some(ClientOutput::Finished { .. })), "{:?}", c.outputs);
}

/// A client leaving after any number of delivered messages or work steps: one terminal
/// outcome at most, no hang, and once idle both pools are full with nothing quarantined.
#[test]
fn a_client_abort_at_every_protocol_step_leaves_clean_pools() {
    let mut full = Cluster::new(64, 128, true);
    full.submit(1, 10, 3);
    let mut steps = 0;
    while full.deliver() || full.prefill_step() || full.decode_step() {
        steps += 1;
    }
    for cut in 0..=steps {
        let mut c = Cluster::new(64, 128, true);
        c.submit(1, 10, 3);
        c.submit(2, 6, 2);
        for _ in 0..cut {
            if !(c.deliver() || c.prefill_step() || c.decode_step()) {
                break;
            }
        }
        c.gateway(GatewayEvent::ClientGone { req: RequestId(1) });
        c.run();
        assert!(matches!(c.terminal(2), Some(ClientOutput::Finished { .. })), "cut {cut}: the other request suffers: {:?}", c.outputs);
        c.assert_clean(&[1, 2]);
    }
}

#[test]
fn a_transfer_that_times_out_fails_once_and_its_pages_stay_quarantined_until_the_prefill_is_fenced() {
    let mut c = Cluster::new(64, 128, true);
    c.submit(1, 10, 3);
    // Reserve, Reserved, Prefill delivered; one page computed, sent and verified at decode
    // (re-arming the timer); the prefill then falls silent.
    while c.pre.running().next().is_none() {
        assert!(c.deliver() || c.prefill_step());
    }
    c.prefill_step();
    while c.dec.role().stats().chunks_verified == 0 {
        assert!(c.deliver());
    }
    c.tick(2_000);
    assert!(c.dpool().stats().quarantined_pages > 0, "a timeout alone frees nothing");
    c.run();
    assert!(matches!(c.terminal(1), Some(ClientOutput::Failed { reason: FailReason::Timeout, .. })), "{:?}", c.outputs);
    c.assert_clean(&[1]);
    assert!(c.dec.role().stats().late_chunks > 0 || c.dec.role().stats().fenced_releases > 0);
}

#[test]
fn prompts_queued_at_a_prefill_that_keeps_talking_still_finish_past_the_transfer_timeout() {
    let mut c = Cluster::new(64, 128, true);
    c.submit(1, 10, 3);
    c.submit(2, 6, 2);
    // Both reserved at decode and queued at the prefill; no chunk computed yet.
    while c.deliver() {}
    assert_eq!((c.dec.role().pending(), c.dec.role().stats().chunks_verified), (2, 0));
    // Five transfer timeouts pass in the queue, the prefill's keepalives arriving meanwhile.
    for _ in 0..10 {
        c.tick(500);
        c.net.push_back((To::Decode { from_prefill: true }, Message::KvKeepalive));
        while c.deliver() {}
    }
    c.run();
    for req in [1, 2] {
        assert!(matches!(c.terminal(req), Some(ClientOutput::Finished { .. })), "request {req}: {:?}", c.outputs);
    }
    c.assert_clean(&[1, 2]);
    assert_eq!(c.dec.role().stats().timeouts, 0);
}

#[test]
fn reservations_of_a_silent_prefill_time_out_and_stay_quarantined_until_it_is_fenced() {
    let mut c = Cluster::new(64, 128, true);
    c.submit(1, 10, 3);
    while c.deliver() {}
    assert_eq!(c.dec.role().pending(), 1);
    // Nothing from the prefill (a cut link, a hung worker) for the transfer timeout.
    c.tick(999);
    assert_eq!((c.dec.role().pending(), c.dec.role().stats().timeouts), (1, 0), "one millisecond short");
    c.tick(1);
    assert_eq!((c.dec.role().pending(), c.dec.role().stats().timeouts), (0, 1));
    assert!(c.dpool().stats().quarantined_pages > 0, "a timeout alone frees nothing");
    c.run();
    assert!(matches!(c.terminal(1), Some(ClientOutput::Failed { .. })), "{:?}", c.outputs);
    c.assert_clean(&[1]);
}

#[test]
fn a_prefill_worker_lost_mid_transfer_fences_its_pages_and_its_request_waits_for_another() {
    let mut c = Cluster::new(64, 128, true);
    c.submit(1, 12, 3);
    while c.dec.role().stats().chunks_verified == 0 {
        assert!(c.deliver() || c.prefill_step());
    }
    // The prefill process dies: its queue, job and pool vanish, its connections close.
    c.pre = PrefillDriver::new(
        PrefillRole::new(PrefillConfig { max_prompt: 64, page_size: LAYOUT.page_size, keepalive_ms: 250 }),
        Batching::one_chunk(LAYOUT.page_size),
    );
    c.ppool = KvPool::new(PoolConfig { layout: LAYOUT, pages: 16, checks: KvChecks::all() }).unwrap();
    c.net.retain(|(to, _)| !matches!(to, To::Decode { from_prefill: true } | To::Prefill));
    c.decode_event(DecodeEvent::PrefillClosed { from: PREFILL });
    c.gateway(GatewayEvent::WorkerLeft { id: PREFILL });
    c.run();
    // Nothing reached the client: the request is tried once more, and waits for a prefill
    // worker (the cluster has no other); the pages it had at decode are back.
    assert_eq!(c.outputs.get(&RequestId(1)), None, "{:?}", c.outputs);
    assert_eq!((c.gw.queued(), c.gw.stats().retried), (1, 1));
    let s = c.dpool().stats();
    assert_eq!((s.free_pages, s.quarantined_pages), (s.total_pages, 0));
    // No worker comes: the queue turns it away with 503 (no prefill worker), not 429, and
    // nothing is left anywhere.
    c.tick(10_000);
    c.run();
    assert!(matches!(c.terminal(1), Some(ClientOutput::Unavailable { detail }) if detail.contains("no prefill worker")), "{:?}", c.outputs);
    c.assert_clean(&[1]);
}

#[test]
fn a_corrupted_or_foreign_chunk_fails_only_its_request() {
    for tamper in 0..3 {
        let mut c = Cluster::new(64, 128, true);
        c.submit(1, 10, 3);
        c.submit(2, 9, 3);
        let mut tampered = false;
        for _ in 0..10_000 {
            if !tampered && let Some(i) = c.net.iter().position(|(_, m)| matches!(m, Message::KvChunk { req: RequestId(1), .. })) {
                if let Message::KvChunk { header, data, .. } = &mut c.net[i].1 {
                    match tamper {
                        0 => data[3] ^= 0x10,
                        1 => header.generation.0 += 1000,
                        _ => header.page.0 = (header.page.0 + 7) % 32,
                    }
                }
                tampered = true;
            }
            if !(c.deliver() || c.prefill_step() || c.decode_step()) {
                break;
            }
        }
        assert!(
            matches!(c.terminal(1), Some(ClientOutput::Failed { reason: FailReason::TransferRefused, .. })),
            "tamper {tamper}: {:?}",
            c.outputs
        );
        assert!(matches!(c.terminal(2), Some(ClientOutput::Finished { .. })), "tamper {tamper}: {:?}", c.outputs);
        assert_eq!(c.dec.role().stats().chunks_refused, 1);
        // Only the flipped byte reaches the checksum check; a wrong page or generation is
        // refused before it.
        assert_eq!(c.dec.role().stats().checksum_failed, u64::from(tamper == 0), "tamper {tamper}");
        c.assert_clean(&[1, 2]);
    }
}

#[test]
fn the_trace_context_reaches_the_decode_reservation_and_the_prefill_job() {
    let mut c = Cluster::new(64, 128, true);
    let trace = TraceContext { trace_id: [7; 16], request_id: "req-7".into(), tenant: "acme".into() };
    c.gateway(GatewayEvent::Submit {
        req: RequestId(1),
        submission: Submission {
            tokens: vec![1, 2, 3],
            max_tokens: 2,
            max_tokens_set: true,
            sampling: Sampling::default(),
            stop: vec![],
            trace: trace.clone(),
            tenant: TenantId(0),
            cache: None,
            priority: 0,
        },
    });
    let (mut reserve, mut prefill, mut job) = (None, None, None);
    for _ in 0..1000 {
        for (_, m) in &c.net {
            match m {
                Message::Reserve { trace, .. } => reserve = Some(trace.clone()),
                Message::Prefill { trace, .. } => prefill = Some(trace.clone()),
                _ => {}
            }
        }
        if let Some(j) = c.pre.targets().next() {
            job = Some(j.trace.clone());
        }
        if !(c.deliver() || c.prefill_step() || c.decode_step()) {
            break;
        }
    }
    assert_eq!((reserve.as_ref(), prefill.as_ref(), job.as_ref()), (Some(&trace), Some(&trace), Some(&trace)));
    assert!(matches!(c.terminal(1), Some(ClientOutput::Finished { .. })), "{:?}", c.outputs);
}

#[test]
fn a_short_transfer_claimed_done_is_refused_before_any_decode_step() {
    let mut c = Cluster::new(64, 128, true);
    c.submit(1, 10, 3);
    for _ in 0..10_000 {
        // Drop the last chunk in flight: the sender still says Done with all 10 tokens.
        if let Some(i) = c.net.iter().position(|(_, m)| matches!(m, Message::KvChunk { header, .. } if header.slot_count == 2)) {
            c.net.remove(i);
        }
        if !(c.deliver() || c.prefill_step() || c.decode_step()) {
            break;
        }
    }
    assert!(matches!(c.terminal(1), Some(ClientOutput::Failed { reason: FailReason::TransferRefused, .. })), "{:?}", c.outputs);
    assert_eq!(c.dec.role().stats().coverage_failed, 1);
    assert_eq!(c.dec.engine().active(), 0);
    c.assert_clean(&[1]);
}

#[test]
fn a_chunk_from_a_prefill_worker_other_than_the_assigned_one_is_refused() {
    let mut c = Cluster::new(64, 128, true);
    c.submit(1, 10, 3);
    // Run until the first chunk is on the wire, then hand it to decode as if another
    // prefill worker had sent it.
    let i = loop {
        if let Some(i) = c.net.iter().position(|(_, m)| matches!(m, Message::KvChunk { .. })) {
            break i;
        }
        assert!(c.deliver() || c.prefill_step());
    };
    let (_, chunk) = c.net.remove(i).unwrap();
    c.decode_event(DecodeEvent::Prefill { from: WorkerId(9), msg: chunk });
    c.run();
    assert!(matches!(c.terminal(1), Some(ClientOutput::Failed { reason: FailReason::TransferRefused, .. })), "{:?}", c.outputs);
    assert_eq!(c.dec.role().stats().chunks_refused, 1);
    assert_eq!(c.dec.role().stats().chunks_verified, 0, "nothing from the impostor was written");
    c.assert_clean(&[1]);
}

#[test]
fn the_decode_worker_refuses_a_request_over_its_context_before_leasing_anything() {
    let mut c = Cluster::new(64, 16, false);
    c.submit(1, 10, 10);
    c.run();
    assert!(matches!(c.terminal(1), Some(ClientOutput::Rejected { reason: RejectReason::ContextLength, .. })), "{:?}", c.outputs);
    assert_eq!((c.dpool().stats().leases_granted, c.ppool.stats().leases_granted), (0, 0));
    assert_eq!(c.dec.role().stats().rejected_context, 1);
    c.assert_clean(&[1]);
}
