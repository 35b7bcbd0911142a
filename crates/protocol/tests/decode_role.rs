//! The decode role alone, driven message by message: admission, which prefill worker may
//! fence which reservation, and quarantine until fenced (I3, I4, I5). Each test kills
//! mutants `cargo mutants` found surviving the cluster tests (docs/TESTING.md).

use bulkhead_kv::transfer::{Manifest, export_chunks};
use bulkhead_kv::{KvChecks, KvLayout, KvPool, PageRef, PoolConfig, RequestId, SequenceKv};
use bulkhead_protocol::decode::{DecodeAction, DecodeConfig, DecodeEvent, DecodeRole, DecodeStats};
use bulkhead_protocol::*;

const A: WorkerId = WorkerId(1);
const B: WorkerId = WorkerId(3);
const LAYOUT: KvLayout = KvLayout { layers: 2, kv_heads: 1, head_dim: 2, page_size: 4 };
const MAX_CONTEXT: usize = 32;

/// A decode role over its own pool, and a prefill pool to make real chunks from.
struct Rig {
    dec: DecodeRole,
    pool: KvPool,
    ppool: KvPool,
    /// What the role started, held as the engine holds it: a started sequence dropped here
    /// would leave its pages leased with no lease, which `check_invariants` reports.
    running: Vec<DecodeAction>,
}

fn pool(pages: usize) -> KvPool {
    KvPool::new(PoolConfig { layout: LAYOUT, pages, checks: KvChecks::all() }).expect("pool")
}

impl Rig {
    fn new(decode_pages: usize) -> Rig {
        let dec = DecodeRole::new(DecodeConfig { max_context: MAX_CONTEXT, transfer_timeout_ms: 1_000, local_prefill_tokens: 0 });
        let mut r = Rig { dec, pool: pool(decode_pages), ppool: pool(64), running: Vec::new() };
        for from in [A, B] {
            r.dec.handle(&mut r.pool, DecodeEvent::PrefillConnected { from });
        }
        r
    }

    fn gateway(&mut self, m: Message) -> Vec<DecodeAction> {
        self.dec.handle(&mut self.pool, DecodeEvent::Gateway { from: GatewayId(0), msg: m })
    }

    fn prefill(&mut self, from: WorkerId, msg: Message) -> Vec<DecodeAction> {
        self.dec.handle(&mut self.pool, DecodeEvent::Prefill { from, msg })
    }

    fn tick(&mut self, now_ms: u64) -> Vec<DecodeAction> {
        self.dec.handle(&mut self.pool, DecodeEvent::Tick { now_ms })
    }

    fn reserve(&mut self, req: u64, prompt: u32, max_tokens: u32, prefill: WorkerId) -> Vec<DecodeAction> {
        let sampling = Sampling::default();
        let trace = TraceContext::default();
        self.gateway(Message::Reserve {
            req: RequestId(req),
            prompt_tokens: prompt,
            max_tokens,
            prefill,
            sampling,
            stop: vec![],
            resume: vec![],
            prompt: vec![],
            trace,
            cache: None,
        })
    }

    /// Reserves and returns the prompt pages granted.
    fn reserved(&mut self, req: u64, prompt: u32, prefill: WorkerId) -> Vec<PageRef> {
        match self.reserve(req, prompt, 4, prefill).as_slice() {
            [DecodeAction::ToGateway(Message::Reserved { pages, .. })] => pages.clone(),
            other => panic!("request {req} not reserved: {other:?}"),
        }
    }

    /// The prompt's chunks for `pages` (written in the prefill pool), and their `Done`.
    fn transfer(&mut self, req: u64, prompt: usize, pages: &[PageRef]) -> (Vec<Message>, Message) {
        let req = RequestId(req);
        let mut seq = SequenceKv::new(req);
        seq.reserve(&mut self.ppool, prompt).expect("prefill pages");
        for pos in 0..prompt {
            let (lease, slot) = seq.locate(pos).expect("locate");
            for layer in 0..LAYOUT.layers {
                self.ppool.write(lease, layer, slot, &[1.0, 2.0], &[3.0, 4.0]).expect("write");
            }
        }
        seq.commit(&self.ppool, prompt).expect("commit");
        let mut manifest = Manifest::default();
        let chunks = export_chunks(&self.ppool, &seq, pages, 0, prompt, &mut manifest).expect("export");
        seq.release(&mut self.ppool).expect("release");
        let chunks = chunks.into_iter().map(|(header, data)| Message::KvChunk { req, header, data: data.into() }).collect();
        (chunks, Message::Done { req, tokens: prompt as u32, first_token: 7, manifest: manifest.digest(), cached: 0, first_logprobs: None })
    }

    /// Whether `acts` is one `Start`; the rig keeps the started sequence, as the engine would.
    fn started(&mut self, acts: Vec<DecodeAction>) -> bool {
        let started = matches!(acts.as_slice(), [DecodeAction::Start(_)]);
        self.running.extend(acts);
        started
    }

    /// (pending, fencing, decoding) of the role; (free, leased, quarantined) pages of the pool.
    fn state(&self) -> ((usize, usize, usize), (usize, usize, usize)) {
        let s = self.pool.stats();
        self.pool.check_invariants();
        ((self.dec.pending(), self.dec.fencing(), self.dec.decoding()), (s.free_pages, s.leased_pages, s.quarantined_pages))
    }
}

fn rejected(acts: &[DecodeAction]) -> Option<RejectReason> {
    match acts {
        [DecodeAction::ToGateway(Message::Rejected { reason, .. })] => Some(*reason),
        _ => None,
    }
}

#[test]
fn the_decode_worker_admits_up_to_its_context_and_refuses_duplicates_empty_requests_and_requests_beyond_its_pages() {
    let mut r = Rig::new(10);
    // Exactly the context fits: 28 + 4 = 32 tokens, 8 pages.
    assert!(rejected(&r.reserve(1, 28, 4, A)).is_none());
    assert_eq!(rejected(&r.reserve(2, 29, 4, A)), Some(RejectReason::ContextLength));
    assert_eq!(rejected(&r.reserve(3, 0, 4, A)), Some(RejectReason::Invalid));
    assert_eq!(rejected(&r.reserve(3, 4, 0, A)), Some(RejectReason::Invalid));
    // Within the context but over the 2 pages left.
    assert_eq!(rejected(&r.reserve(4, 8, 4, A)), Some(RejectReason::Capacity));
    assert_eq!(r.state(), ((1, 0, 0), (2, 8, 0)), "refusals lease nothing");
    // A request in flight in each state refuses a second reservation under its id.
    assert_eq!(rejected(&r.reserve(1, 4, 4, A)), Some(RejectReason::Duplicate));
    r.gateway(Message::Abort { req: RequestId(1), reason: AbortReason::ClientGone });
    assert_eq!(r.state(), ((0, 1, 0), (2, 0, 8)));
    assert_eq!(rejected(&r.reserve(1, 4, 4, A)), Some(RejectReason::Duplicate));
    r.prefill(A, Message::Fenced { req: RequestId(1) });
    let pages = r.reserved(5, 4, A);
    let (chunks, done) = r.transfer(5, 4, &pages);
    for c in chunks {
        r.prefill(A, c);
    }
    let acts = r.prefill(A, done);
    assert!(r.started(acts));
    assert_eq!(rejected(&r.reserve(5, 4, 4, A)), Some(RejectReason::Duplicate));
    let s = r.dec.stats();
    let counts = (s.reserved, s.rejected_context, s.rejected_capacity, s.rejected_invalid, s.fenced_releases, s.pages_quarantined);
    assert_eq!(counts, (2, 1, 1, 5, 8, 8));
}

#[test]
fn a_gateway_abort_quarantines_a_pending_reservation_until_fenced_and_stops_a_decoding_one() {
    let mut r = Rig::new(16);
    let pages = r.reserved(1, 6, A);
    let (chunks, done) = r.transfer(1, 6, &pages);
    r.prefill(A, chunks[0].clone());
    assert!(r.gateway(Message::Abort { req: RequestId(1), reason: AbortReason::ClientGone }).is_empty());
    assert_eq!(r.state(), ((0, 1, 0), (13, 0, 3)), "the prefill may still write: quarantined");
    // What was in flight lands late: dropped unread, and the Done fences without starting.
    assert!(r.prefill(A, chunks[1].clone()).is_empty());
    assert!(r.prefill(A, done).is_empty());
    assert_eq!(r.state(), ((0, 0, 0), (16, 0, 0)));
    let pages = r.reserved(2, 4, A);
    let (chunks, done) = r.transfer(2, 4, &pages);
    for c in chunks {
        r.prefill(A, c);
    }
    let acts = r.prefill(A, done);
    assert!(r.started(acts));
    assert_eq!(r.state().0, (0, 0, 1));
    let acts = r.gateway(Message::Abort { req: RequestId(2), reason: AbortReason::ClientGone });
    assert!(matches!(acts.as_slice(), [DecodeAction::Stop { req: RequestId(2) }]), "{acts:?}");
    assert_eq!(r.state().0, (0, 0, 0));
    let s = r.dec.stats();
    assert_eq!((s.late_chunks, s.chunks_verified, s.coverage_verified, s.fenced_releases), (1, 2, 1, 3));
}

#[test]
fn only_the_assigned_prefill_worker_can_fence_a_quarantined_reservation() {
    let mut r = Rig::new(16);
    r.reserved(1, 8, A);
    r.gateway(Message::Abort { req: RequestId(1), reason: AbortReason::ClientGone });
    assert_eq!(r.state(), ((0, 1, 0), (13, 0, 3)));
    // B never wrote these pages; its word says nothing about A's writes in flight.
    let done = Message::Done { req: RequestId(1), tokens: 8, first_token: 7, manifest: 0, cached: 0, first_logprobs: None };
    r.prefill(B, done.clone());
    r.prefill(B, Message::Fenced { req: RequestId(1) });
    assert_eq!(r.state(), ((0, 1, 0), (13, 0, 3)), "fenced by the wrong worker");
    r.prefill(A, done);
    assert_eq!(r.state(), ((0, 0, 0), (16, 0, 0)));
}

#[test]
fn a_closed_prefill_connection_ends_only_the_transfers_it_was_writing() {
    let mut r = Rig::new(16);
    r.reserved(1, 4, A);
    let pages = r.reserved(2, 4, B);
    // Quarantined: 3 (A, 2 pages) and 4 (B, 3 pages).
    r.reserved(3, 4, A);
    r.reserved(4, 8, B);
    for req in [3, 4] {
        r.gateway(Message::Abort { req: RequestId(req), reason: AbortReason::ClientGone });
    }
    assert_eq!(r.state(), ((2, 2, 0), (7, 4, 5)));
    let acts = r.dec.handle(&mut r.pool, DecodeEvent::PrefillClosed { from: A });
    let failed: Vec<_> = acts
        .iter()
        .map(|a| match a {
            DecodeAction::ToGateway(Message::Failed { req, reason: FailReason::WorkerLost, .. }) => *req,
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(failed, [RequestId(1)]);
    // A's reservation is freed and its quarantine lifted; B's are untouched.
    assert_eq!(r.state(), ((1, 1, 0), (11, 2, 3)));
    let (chunks, done) = r.transfer(2, 4, &pages);
    for c in chunks {
        r.prefill(B, c);
    }
    let acts = r.prefill(B, done);
    assert!(r.started(acts), "B's transfer still completes");
}

#[test]
fn a_cancel_frees_a_quarantined_reservation_only_if_no_chunk_ever_landed() {
    let mut r = Rig::new(16);
    r.reserved(1, 4, A);
    let pages = r.reserved(2, 8, A);
    let (chunks, _) = r.transfer(2, 8, &pages);
    r.prefill(A, chunks[0].clone());
    for req in [1, 2] {
        r.gateway(Message::Abort { req: RequestId(req), reason: AbortReason::Timeout });
    }
    assert_eq!(r.state(), ((0, 2, 0), (11, 0, 5)));
    for req in [1, 2] {
        r.gateway(Message::Cancel { req: RequestId(req) });
    }
    // Nothing was written for 1 (2 pages): no writer can exist. 2 (3 pages) has a writer:
    // wait for its fence.
    assert_eq!(r.state(), ((0, 1, 0), (13, 0, 3)));
}

#[test]
fn a_timed_out_transfer_is_counted_failed_and_its_pages_stay_quarantined() {
    let mut r = Rig::new(16);
    let pages = r.reserved(1, 4, A);
    // Its one chunk lands (re-arming the timer); its Done never comes.
    let (chunks, _) = r.transfer(1, 4, &pages);
    r.prefill(A, chunks[0].clone());
    let acts = r.tick(1_000);
    assert!(
        matches!(
            acts.as_slice(),
            [DecodeAction::ToGateway(Message::Failed { reason: FailReason::Timeout, .. }), DecodeAction::ToPrefill { to: A, .. }]
        ),
        "{acts:?}"
    );
    assert_eq!(r.state(), ((0, 1, 0), (14, 0, 2)));
    assert_eq!(r.dec.stats(), DecodeStats { reserved: 1, chunks_verified: 1, timeouts: 1, pages_quarantined: 2, ..DecodeStats::default() });
}

// The transfer timeout is a silence timer: any frame from the assigned prefill worker (a
// chunk for any request, a keepalive) re-arms it, so a prompt queued behind others at a busy
// prefill waits, while a prefill silent for the timeout (cut off, hung) fails the transfer.

#[test]
fn a_reservation_whose_prefill_keeps_talking_waits_past_the_timeout_and_one_whose_prefill_is_silent_fails() {
    let mut r = Rig::new(16);
    let pages = r.reserved(1, 8, A);
    r.reserved(2, 4, B);
    // A sends keepalives every 600 ms for ten seconds; B says nothing.
    let mut timed_out = Vec::new();
    for now_ms in (600..=10_200).step_by(600) {
        for a in r.tick(now_ms) {
            if let DecodeAction::ToGateway(Message::Failed { req, reason: FailReason::Timeout, .. }) = a {
                timed_out.push((req.0, now_ms));
            }
        }
        assert!(r.prefill(A, Message::KvKeepalive).is_empty());
    }
    assert_eq!(timed_out, vec![(2, 1_200)], "only the silent prefill's reservation fails, once its silence reaches 1,000 ms");
    assert_eq!(r.dec.pending(), 1);
    // A's prompt reaches the front of its queue at last: the transfer completes.
    let (chunks, done) = r.transfer(1, 8, &pages);
    for c in chunks {
        assert!(r.prefill(A, c).is_empty());
    }
    let acts = r.prefill(A, done);
    assert!(r.started(acts));
    assert_eq!(r.dec.stats().timeouts, 1);
}

#[test]
fn a_transfer_that_stalls_for_the_transfer_timeout_after_a_chunk_fails_and_its_pages_stay_quarantined() {
    let mut r = Rig::new(16);
    let pages = r.reserved(1, 8, A);
    let (chunks, done) = r.transfer(1, 8, &pages);
    for now_ms in (500..=5_000).step_by(500) {
        assert!(r.tick(now_ms).is_empty(), "queued at a prefill that keeps talking");
        r.prefill(A, Message::KvKeepalive);
    }
    // The first chunk lands at 5,000 ms; nothing follows.
    r.prefill(A, chunks[0].clone());
    assert!(r.tick(5_999).is_empty(), "one millisecond short of the stall timeout");
    let acts = r.tick(6_000);
    match acts.as_slice() {
        [
            DecodeAction::ToGateway(Message::Failed { req: RequestId(1), reason: FailReason::Timeout, .. }),
            DecodeAction::ToPrefill { to: A, msg: Message::Abort { req: RequestId(1), reason: AbortReason::Timeout } },
        ] => {}
        other => panic!("expected Failed(Timeout) and an Abort to the prefill: {other:?}"),
    }
    assert_eq!(r.state(), ((0, 1, 0), (13, 0, 3)), "a timeout frees nothing: quarantined until the writer is fenced");
    assert!(r.tick(100_000).is_empty(), "fails once");
    // The prefill was still writing: its late chunk is dropped, its Done fences the pages.
    assert!(r.prefill(A, chunks[1].clone()).is_empty());
    assert_eq!(r.state(), ((0, 1, 0), (13, 0, 3)));
    assert!(r.prefill(A, done).is_empty());
    assert_eq!(r.state(), ((0, 0, 0), (16, 0, 0)));
    let s = r.dec.stats();
    assert_eq!((s.chunks_verified, s.late_chunks, s.timeouts, s.pages_quarantined, s.fenced_releases), (1, 1, 1, 3, 3));
}

#[test]
fn every_chunk_re_arms_the_transfer_timer() {
    let mut r = Rig::new(16);
    let pages = r.reserved(1, 8, A);
    let (chunks, done) = r.transfer(1, 8, &pages);
    r.tick(500);
    r.prefill(A, chunks[0].clone());
    assert!(r.tick(1_400).is_empty());
    // The second chunk at 1,400 ms moves the deadline from 1,500 to 2,400 ms.
    r.prefill(A, chunks[1].clone());
    assert!(r.tick(1_500).is_empty(), "the first chunk's deadline no longer holds");
    assert!(r.tick(2_399).is_empty());
    let acts = r.prefill(A, done);
    assert!(r.started(acts));
    assert!(r.tick(100_000).is_empty(), "a started request has no transfer timer");
    assert_eq!(r.state().0, (0, 0, 1));
    assert_eq!(r.dec.stats().timeouts, 0);
}

/// A lost gateway's requests end on the decode worker (issue 34) and no other gateway's
/// do: its decoding sequence stops, its reservation is quarantined and its prefill worker is
/// asked for the fence (the worker may never have got the job, and only it can say so), and
/// the pages come back only with that fence (I4).
#[test]
fn a_lost_gateways_requests_end_here_and_the_other_gateways_go_on() {
    use bulkhead_protocol::gateway::request_id;
    let (lost, kept) = (GatewayId(1), GatewayId(0));
    let mut r = Rig::new(16);
    let decoding = request_id(lost, 1);
    let pages = r.reserved(decoding.0, 4, A);
    let (chunks, done) = r.transfer(decoding.0, 4, &pages);
    for c in chunks {
        r.prefill(A, c);
    }
    let acts = r.prefill(A, done);
    assert!(r.started(acts));
    let pending = request_id(lost, 2);
    r.reserved(pending.0, 6, B);
    let other = request_id(kept, 1);
    r.reserved(other.0, 4, A);
    let acts = r.dec.handle(&mut r.pool, DecodeEvent::GatewayLost { gateway: lost });
    assert!(acts.iter().any(|a| matches!(a, DecodeAction::Stop { req } if *req == decoding)), "{acts:?}");
    let abort = |a: &DecodeAction| matches!(a, DecodeAction::ToPrefill { to: B, msg: Message::Abort { req, .. } } if *req == pending);
    assert!(acts.iter().any(abort), "the prefill worker is asked for its fence: {acts:?}");
    assert_eq!(acts.len(), 2, "nothing about the other gateway's request: {acts:?}");
    assert!(r.dec.known(other) && !r.dec.known(decoding));
    assert_eq!(r.state().0, (1, 1, 0), "one reservation left, one quarantined");
    assert!(r.prefill(B, Message::Fenced { req: pending }).is_empty());
    assert_eq!(r.state().0, (1, 0, 0), "the fence brings the pages back");
}

/// A finished sequence reaches the decode-side cache only if its written KV is exactly the
/// client's prompt and what was generated (the last token never fed): one position more
/// (a rejected speculative draft's KV left in place, the TGI #2711 class) would be
/// published under the key of a token that was never there, and keeps it out.
#[test]
fn a_finished_sequence_whose_kv_runs_past_its_tokens_is_not_published() {
    use bulkhead_kv::PrefixCache;
    use bulkhead_protocol::cache::CacheScope;
    use bulkhead_protocol::decode::Retired;
    for extra in [0, 1] {
        let mut r = Rig::new(16);
        let cache = PrefixCache::new(16);
        r.dec = std::mem::replace(
            &mut r.dec,
            DecodeRole::new(DecodeConfig { max_context: MAX_CONTEXT, transfer_timeout_ms: 1_000, local_prefill_tokens: 0 }),
        )
        .with_cache(cache, 0xD16E57);
        let prompt: Vec<u32> = (100..106).collect();
        let acts = r.gateway(Message::Reserve {
            req: RequestId(1),
            prompt_tokens: 6,
            max_tokens: 8,
            prefill: A,
            sampling: Sampling::default(),
            stop: vec![],
            resume: vec![],
            prompt: prompt.clone(),
            trace: TraceContext::default(),
            cache: Some(CacheScope([5; 32])),
        });
        let [DecodeAction::ToGateway(Message::Reserved { pages, .. })] = acts.as_slice() else { panic!("not reserved: {acts:?}") };
        let (chunks, done) = r.transfer(1, 6, &pages.clone());
        for c in chunks {
            r.prefill(A, c);
        }
        let mut acts = r.prefill(A, done);
        let Some(DecodeAction::Start(start)) = acts.pop() else { panic!("not started") };
        // Decoded: the first token (7) and 9 fed, 11 picked last; `extra` more positions.
        let mut seq = start.seq.into_sequence();
        seq.reserve(&mut r.pool, 8 + extra).expect("grow");
        for pos in 6..8 + extra {
            let (lease, slot) = seq.locate(pos).expect("locate");
            for layer in 0..LAYOUT.layers {
                r.pool.write(lease, layer, slot, &[1.0, 2.0], &[3.0, 4.0]).expect("write");
            }
        }
        seq.commit(&r.pool, 2 + extra).expect("commit");
        // The prompt's full page was published when it arrived; the retired sequence adds
        // its second full page (positions 4..8), or nothing.
        let before = r.dec.cache().map_or(0, |c| c.len());
        r.dec.retire(&mut r.pool, Retired { seq, generated: vec![7, 9, 11] });
        let published = r.dec.cache().map_or(0, |c| c.len()) - before;
        assert_eq!((r.dec.stats().extent_mismatches, published), (extra as u64, 1 - extra), "{extra} extra");
        assert_eq!(r.pool.stats().leased_pages, 0);
    }
}
