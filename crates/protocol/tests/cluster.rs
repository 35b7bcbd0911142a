//! The three role state machines wired together in process, with real KV pools, a mock
//! model (KV values are a function of request and position) and a network that delivers
//! messages one at a time, so every protocol step can be interrupted.

use std::collections::{BTreeMap, VecDeque};

use bulkhead_kv::transfer::{export_chunks, Manifest};
use bulkhead_kv::{KvLayout, KvPool, KvChecks, PoolConfig, RequestId, SequenceKv};
use bulkhead_protocol::decode::{DecodeAction, DecodeConfig, DecodeEvent, DecodeRole};
use bulkhead_protocol::gateway::{ClientOutput, GatewayAction, GatewayConfig, GatewayEvent, GatewayRole};
use bulkhead_protocol::prefill::{JobOutcome, PrefillAction, PrefillConfig, PrefillJob, PrefillRole};
use bulkhead_protocol::*;

const PREFILL: WorkerId = WorkerId(1);
const DECODE: WorkerId = WorkerId(2);
const LAYOUT: KvLayout = KvLayout { layers: 2, kv_heads: 1, head_dim: 2, page_size: 4 };

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum To {
    Gateway(WorkerId),
    Decode { from_prefill: bool },
    Prefill,
}

struct Job {
    job: PrefillJob,
    seq: SequenceKv,
    done: usize,
    manifest: Manifest,
}

struct Cluster {
    gw: GatewayRole,
    dec: DecodeRole,
    dpool: KvPool,
    pre: PrefillRole,
    ppool: KvPool,
    net: VecDeque<(To, Message)>,
    outputs: BTreeMap<RequestId, Vec<ClientOutput>>,
    decoding: BTreeMap<RequestId, (SequenceKv, u32)>,
    job: Option<Job>,
    now: u64,
}

fn sampling() -> Sampling {
    Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, seed: None, ignore_eos: false }
}

impl Cluster {
    fn new(prefill_pool_tokens: usize, decode_pool_tokens: usize, gateway_check: bool) -> Self {
        let pool = |t: usize| KvPool::new(PoolConfig { layout: LAYOUT, pages: t / LAYOUT.page_size, checks: KvChecks::all() }).unwrap();
        let max_context = prefill_pool_tokens.min(decode_pool_tokens);
        let mut gw = GatewayRole::new(GatewayConfig { max_context, admission_check: gateway_check, request_timeout_ms: 10_000 });
        gw.handle(GatewayEvent::WorkerJoined { id: PREFILL, role: Role::Prefill });
        gw.handle(GatewayEvent::WorkerJoined { id: DECODE, role: Role::Decode });
        Cluster {
            gw,
            dec: DecodeRole::new(DecodeConfig { max_context: decode_pool_tokens, transfer_timeout_ms: 1_000 }),
            dpool: pool(decode_pool_tokens),
            pre: PrefillRole::new(PrefillConfig { max_prompt: prefill_pool_tokens, page_size: LAYOUT.page_size }),
            ppool: pool(prefill_pool_tokens),
            net: VecDeque::new(),
            outputs: BTreeMap::new(),
            decoding: BTreeMap::new(),
            job: None,
            now: 0,
        }
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
        self.gateway(GatewayEvent::Submit { req: RequestId(req), tokens, max_tokens, sampling: sampling(), stop: vec![], trace: TraceContext::default() });
    }

    fn decode_actions(&mut self, acts: Vec<DecodeAction>) {
        for a in acts {
            match a {
                DecodeAction::ToGateway(m) => self.net.push_back((To::Gateway(DECODE), m)),
                DecodeAction::ToPrefill { msg, .. } => self.net.push_back((To::Prefill, msg)),
                DecodeAction::Start(ds) => {
                    // Every prompt position reads back the mock model's value for (req, pos).
                    let seq = ds.seq.into_sequence();
                    for pos in 0..seq.len() {
                        let (lease, slot) = seq.locate(pos).unwrap();
                        let r = self.dpool.read(lease, 0).unwrap();
                        assert_eq!(r.k_head(0)[slot * 2].to_f32(), kv_value(ds.req, pos), "decode reads its own prompt KV");
                    }
                    self.decoding.insert(ds.req, (seq, ds.max_tokens));
                }
                DecodeAction::Stop { req } => {
                    if let Some((seq, _)) = self.decoding.remove(&req) {
                        seq.release(&mut self.dpool).unwrap();
                    }
                }
            }
        }
    }

    fn prefill_actions(&mut self, acts: Vec<PrefillAction>) {
        for a in acts {
            match a {
                PrefillAction::ToGateway(m) => self.net.push_back((To::Gateway(PREFILL), m)),
                PrefillAction::ToDecode { msg, .. } => self.net.push_back((To::Decode { from_prefill: true }, msg)),
            }
        }
    }

    /// Deliver the next message; false if none.
    fn deliver(&mut self) -> bool {
        let Some((to, m)) = self.net.pop_front() else { return false };
        match to {
            To::Gateway(from) => self.gateway(GatewayEvent::FromWorker { from, msg: m }),
            To::Decode { from_prefill } => {
                let ev = if from_prefill { DecodeEvent::Prefill { from: PREFILL, msg: m } } else { DecodeEvent::Gateway(m) };
                let acts = self.dec.handle(&mut self.dpool, ev);
                self.decode_actions(acts);
            }
            To::Prefill => {
                let acts = self.pre.handle(m);
                self.prefill_actions(acts);
            }
        }
        true
    }

    /// One unit of prefill work: start a job, or compute and send one page of it, or end it.
    fn prefill_step(&mut self) -> bool {
        if self.job.is_none() {
            let Some(job) = self.pre.next_job() else { return false };
            let mut seq = SequenceKv::new(job.req);
            seq.reserve(&mut self.ppool, job.tokens.len()).unwrap();
            self.job = Some(Job { job, seq, done: 0, manifest: Manifest::default() });
            return true;
        }
        let Some(mut j) = self.job.take() else { return false };
        let n = j.job.tokens.len();
        if !self.pre.keep_going(j.job.req) || j.done == n {
            let outcome = if j.done == n {
                JobOutcome::Done { tokens: n as u32, first_token: 7, manifest: j.manifest.digest() }
            } else {
                JobOutcome::Stopped
            };
            j.seq.release(&mut self.ppool).unwrap();
            let acts = self.pre.job_ended(j.job.req, outcome);
            self.prefill_actions(acts);
            return true;
        }
        let end = (j.done + LAYOUT.page_size).min(n);
        for pos in j.done..end {
            let (lease, slot) = j.seq.locate(pos).unwrap();
            for layer in 0..LAYOUT.layers {
                let v = kv_value(j.job.req, pos);
                self.ppool.write(lease, layer, slot, &[v, v], &[v, v]).unwrap();
            }
        }
        j.seq.commit(&self.ppool, end - j.done).unwrap();
        for (header, data) in export_chunks(&self.ppool, &j.seq, &j.job.pages, j.done, end, &mut j.manifest).unwrap() {
            self.net.push_back((To::Decode { from_prefill: true }, Message::KvChunk { req: j.job.req, header, data }));
        }
        j.done = end;
        self.job = Some(j);
        true
    }

    /// One decode step for every running sequence: a token, or the end.
    fn decode_step(&mut self) -> bool {
        let reqs: Vec<RequestId> = self.decoding.keys().copied().collect();
        for req in &reqs {
            let Some((_, left)) = self.decoding.get_mut(req) else { continue };
            *left -= 1;
            if *left == 0 {
                let Some((seq, _)) = self.decoding.remove(req) else { continue };
                let prompt = seq.len() as u32;
                seq.release(&mut self.dpool).unwrap();
                self.dec.finished(*req);
                self.net.push_back((To::Gateway(DECODE), Message::Finished { req: *req, finish: Finish::Length, text: "!".into(), prompt_tokens: prompt, completion_tokens: 1 }));
            } else {
                self.net.push_back((To::Gateway(DECODE), Message::Token { req: *req, token: 9, text: "x".into() }));
            }
        }
        !reqs.is_empty()
    }

    fn tick(&mut self, ms: u64) {
        self.now += ms;
        let acts = self.dec.handle(&mut self.dpool, DecodeEvent::Tick { now_ms: self.now });
        self.decode_actions(acts);
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
        for (name, p) in [("decode", &self.dpool), ("prefill", &self.ppool)] {
            let s = p.stats();
            assert_eq!((s.free_pages, s.quarantined_pages), (s.total_pages, 0), "{name} pool not back to full: {s:?}");
            p.check_invariants();
        }
        assert_eq!((self.dec.pending(), self.dec.fencing(), self.dec.decoding()), (0, 0, 0));
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
    assert_eq!(c.dec.stats().coverage_verified, 1);
    assert_eq!(c.dec.stats().chunks_verified, 3);
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
        let leased = c.dpool.stats().leases_granted;
        assert_eq!(leased == 0, check, "gateway check {check}: decode leases granted {leased}");
        c.assert_clean(&[1]);
    }
}

/// What the incident test demands of request 1 (a prompt over the prefill pool): rejected
/// for its context, never computed, nothing handed to decode.
fn incident_outcome(c: &Cluster) -> Result<(), String> {
    if !matches!(c.terminal(1), Some(ClientOutput::Rejected { reason: RejectReason::ContextLength, .. })) {
        return Err(format!("the over-long request was not rejected: {:?}", c.outputs));
    }
    if c.ppool.stats().leases_granted != 0 {
        return Err("the prefill computed a rejected prompt".into());
    }
    if c.dec.stats().chunks_verified != 0 {
        return Err("decode accepted KV for a rejected prompt".into());
    }
    Ok(())
}

/// The incident's exact bug put back (test-only switches): the gateway's check off, the
/// prefill keeps the refused prompt flowing as a 1-token placeholder, decode trusts its
/// "done". The incident test above must catch it; if it did not, it would prove nothing.
#[test]
fn the_incident_bug_reintroduced_is_caught_by_the_incident_test() {
    let mut c = Cluster::new(16, 128, false);
    c.pre.replay_incident_bug();
    c.dec.replay_incident_bug();
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
    while c.job.is_none() {
        assert!(c.deliver() || c.prefill_step());
    }
    c.prefill_step();
    while c.dec.stats().chunks_verified == 0 {
        assert!(c.deliver());
    }
    c.tick(2_000);
    assert!(c.dpool.stats().quarantined_pages > 0, "a timeout alone frees nothing");
    c.run();
    assert!(matches!(c.terminal(1), Some(ClientOutput::Failed { reason: FailReason::Timeout, .. })), "{:?}", c.outputs);
    c.assert_clean(&[1]);
    assert!(c.dec.stats().late_chunks > 0 || c.dec.stats().fenced_releases > 0);
}

#[test]
fn prompts_queued_at_a_prefill_that_keeps_talking_still_finish_past_the_transfer_timeout() {
    let mut c = Cluster::new(64, 128, true);
    c.submit(1, 10, 3);
    c.submit(2, 6, 2);
    // Both reserved at decode and queued at the prefill; no chunk computed yet.
    while c.deliver() {}
    assert_eq!((c.dec.pending(), c.dec.stats().chunks_verified), (2, 0));
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
    assert_eq!(c.dec.stats().timeouts, 0);
}

#[test]
fn reservations_of_a_silent_prefill_time_out_and_stay_quarantined_until_it_is_fenced() {
    let mut c = Cluster::new(64, 128, true);
    c.submit(1, 10, 3);
    while c.deliver() {}
    assert_eq!(c.dec.pending(), 1);
    // Nothing from the prefill (a cut link, a hung worker) for the transfer timeout.
    c.tick(999);
    assert_eq!((c.dec.pending(), c.dec.stats().timeouts), (1, 0), "one millisecond short");
    c.tick(1);
    assert_eq!((c.dec.pending(), c.dec.stats().timeouts), (0, 1));
    assert!(c.dpool.stats().quarantined_pages > 0, "a timeout alone frees nothing");
    c.run();
    assert!(matches!(c.terminal(1), Some(ClientOutput::Failed { .. })), "{:?}", c.outputs);
    c.assert_clean(&[1]);
}

#[test]
fn a_prefill_worker_lost_mid_transfer_fails_its_request_and_the_closed_connection_fences_its_pages() {
    let mut c = Cluster::new(64, 128, true);
    c.submit(1, 12, 3);
    while c.dec.stats().chunks_verified == 0 {
        assert!(c.deliver() || c.prefill_step());
    }
    // The prefill process dies: its queue and job vanish, its connections close.
    c.job = None;
    c.net.retain(|(to, _)| !matches!(to, To::Decode { from_prefill: true } | To::Prefill));
    let acts = c.dec.handle(&mut c.dpool, DecodeEvent::PrefillClosed { from: PREFILL });
    c.decode_actions(acts);
    c.gateway(GatewayEvent::WorkerLeft { id: PREFILL });
    c.run();
    assert!(matches!(c.terminal(1), Some(ClientOutput::Failed { .. })), "{:?}", c.outputs);
    let s = c.dpool.stats();
    assert_eq!((s.free_pages, s.quarantined_pages), (s.total_pages, 0));
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
        assert!(matches!(c.terminal(1), Some(ClientOutput::Failed { reason: FailReason::TransferRefused, .. })), "tamper {tamper}: {:?}", c.outputs);
        assert!(matches!(c.terminal(2), Some(ClientOutput::Finished { .. })), "tamper {tamper}: {:?}", c.outputs);
        assert_eq!(c.dec.stats().chunks_refused, 1);
        // Only the flipped byte reaches the checksum check; a wrong page or generation is
        // refused before it.
        assert_eq!(c.dec.stats().checksum_failed, u64::from(tamper == 0), "tamper {tamper}");
        c.assert_clean(&[1, 2]);
    }
}

#[test]
fn the_trace_context_reaches_the_decode_reservation_and_the_prefill_job() {
    let mut c = Cluster::new(64, 128, true);
    let trace = TraceContext { trace_id: [7; 16], request_id: "req-7".into() };
    c.gateway(GatewayEvent::Submit { req: RequestId(1), tokens: vec![1, 2, 3], max_tokens: 2, sampling: sampling(), stop: vec![], trace: trace.clone() });
    let (mut reserve, mut prefill, mut job) = (None, None, None);
    for _ in 0..1000 {
        for (_, m) in &c.net {
            match m {
                Message::Reserve { trace, .. } => reserve = Some(trace.clone()),
                Message::Prefill { trace, .. } => prefill = Some(trace.clone()),
                _ => {}
            }
        }
        if let Some(j) = &c.job {
            job = Some(j.job.trace.clone());
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
    assert_eq!(c.dec.stats().coverage_failed, 1);
    assert!(c.decoding.is_empty());
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
    let acts = c.dec.handle(&mut c.dpool, DecodeEvent::Prefill { from: WorkerId(9), msg: chunk });
    c.decode_actions(acts);
    c.run();
    assert!(matches!(c.terminal(1), Some(ClientOutput::Failed { reason: FailReason::TransferRefused, .. })), "{:?}", c.outputs);
    assert_eq!(c.dec.stats().chunks_refused, 1);
    assert_eq!(c.dec.stats().chunks_verified, 0, "nothing from the impostor was written");
    c.assert_clean(&[1]);
}

#[test]
fn the_decode_worker_refuses_a_request_over_its_context_before_leasing_anything() {
    let mut c = Cluster::new(64, 16, false);
    c.submit(1, 10, 10);
    c.run();
    assert!(matches!(c.terminal(1), Some(ClientOutput::Rejected { reason: RejectReason::ContextLength, .. })), "{:?}", c.outputs);
    assert_eq!((c.dpool.stats().leases_granted, c.ppool.stats().leases_granted), (0, 0));
    assert_eq!(c.dec.stats().rejected_context, 1);
    c.assert_clean(&[1]);
}
