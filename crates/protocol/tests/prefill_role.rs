//! The prefill role alone: worker-side admission, duplicates, and aborts that end a job in
//! the queue or between chunks (I3), each with the fence the decode worker waits for (I4).
//! Each test kills mutants `cargo mutants` found surviving the cluster tests
//! (docs/TESTING.md).

use bulkhead_kv::{Generation, PageId, PageRef, RequestId};
use bulkhead_protocol::prefill::{JobOutcome, PrefillAction, PrefillConfig, PrefillEvent, PrefillRole, PrefillStats};
use bulkhead_protocol::*;

const DECODE: WorkerId = WorkerId(2);
const PAGE: usize = 4;
const MAX_PROMPT: usize = 8;

const KEEPALIVE_MS: u64 = 250;

/// A role with an open KV connection to DECODE.
fn role() -> PrefillRole {
    let mut p = PrefillRole::new(PrefillConfig { max_prompt: MAX_PROMPT, page_size: PAGE, keepalive_ms: KEEPALIVE_MS });
    assert!(p.handle(PrefillEvent::DecodeConnected { decode: DECODE }).is_empty());
    p
}

/// A Prefill for `req` with `tokens` prompt tokens and `pages` target pages.
fn prefill(req: u64, tokens: usize, pages: usize) -> PrefillEvent {
    prefill_for(req, tokens, pages, DECODE)
}

fn prefill_for(req: u64, tokens: usize, pages: usize, decode: WorkerId) -> PrefillEvent {
    let pages = (0..pages).map(|i| PageRef { page: PageId(i as u32), generation: Generation(1) }).collect();
    let m = Message::Prefill {
        req: RequestId(req),
        tokens: vec![5; tokens],
        decode,
        held: 0,
        pages,
        sampling: Sampling::default(),
        skip_draws: 0,
        trace: TraceContext::default(),
        cache: None,
    };
    PrefillEvent::Gateway { from: GatewayId(0), msg: m }
}

fn abort(req: u64) -> PrefillEvent {
    PrefillEvent::Gateway { from: GatewayId(0), msg: Message::Abort { req: RequestId(req), reason: AbortReason::ClientGone } }
}

/// The actions as (to gateway?, message) pairs, checking every decode-bound one goes to DECODE.
fn sent(acts: Vec<PrefillAction>) -> Vec<(bool, Message)> {
    acts.into_iter()
        .map(|a| match a {
            PrefillAction::ToGateway(m) => (true, m),
            PrefillAction::ToDecode { to, msg } => {
                assert_eq!(to, DECODE);
                (false, msg)
            }
            PrefillAction::Connect { decode, addr } => panic!("unexpected connect to {decode} at {addr}"),
            PrefillAction::Rejoin => panic!("unexpected rejoin"),
        })
        .collect()
}

fn rejected(reason: RejectReason) -> impl Fn(&(bool, Message)) -> bool {
    move |(to_gateway, m)| *to_gateway && matches!(m, Message::Rejected { reason: r, .. } if *r == reason)
}

fn fenced(req: u64) -> impl Fn(&(bool, Message)) -> bool {
    move |(to_gateway, m)| !*to_gateway && *m == Message::Fenced { req: RequestId(req) }
}

#[test]
fn a_prompt_up_to_the_limit_is_queued_and_malformed_ones_are_refused_and_fenced() {
    let mut p = role();
    assert!(p.handle(prefill(1, MAX_PROMPT, 2)).is_empty(), "exactly the limit is admitted");
    let over = sent(p.handle(prefill(2, MAX_PROMPT + 1, 3)));
    assert!(matches!(over.as_slice(), [a, b] if rejected(RejectReason::ContextLength)(a) && fenced(2)(b)), "{over:?}");
    // No tokens; pages that do not match the prompt (one short, one over).
    for (req, tokens, pages) in [(3, 0, 0), (4, 5, 1), (5, 4, 2)] {
        let acts = sent(p.handle(prefill(req, tokens, pages)));
        assert!(matches!(acts.as_slice(), [a, b] if rejected(RejectReason::Invalid)(a) && fenced(req)(b)), "{acts:?}");
    }
    assert_eq!((p.queued(), p.busy()), (1, false));
    assert_eq!(p.stats(), PrefillStats { admitted: 1, rejected_context: 1, rejected_invalid: 3, ..PrefillStats::default() });
}

#[test]
fn a_duplicate_prefill_is_refused_without_fencing_the_job_that_is_still_writing() {
    let mut p = role();
    p.handle(prefill(1, 4, 1));
    p.handle(prefill(2, 4, 1));
    let running = p.next_job().expect("a job");
    assert_eq!((running.req, p.queued(), p.busy()), (RequestId(1), 1, true));
    for req in [1, 2] {
        // A fence now would let the decode worker free pages the first job still writes.
        let acts = sent(p.handle(prefill(req, 4, 1)));
        assert!(matches!(acts.as_slice(), [a] if rejected(RejectReason::Duplicate)(a)), "{acts:?}");
    }
    // Even one over the limit: the refusal is about the message, the job goes on.
    let acts = sent(p.handle(prefill(1, MAX_PROMPT + 1, 3)));
    assert!(matches!(acts.as_slice(), [a] if rejected(RejectReason::Duplicate)(a)), "{acts:?}");
    assert_eq!(p.stats().rejected_invalid, 3);
}

#[test]
fn an_abort_ends_a_queued_job_at_once_and_a_running_one_at_its_next_chunk_with_a_fence() {
    let mut p = role();
    p.handle(prefill(1, 4, 1));
    p.handle(prefill(2, 4, 1));
    p.handle(prefill(3, 4, 1));
    assert_eq!(p.queued(), 3);
    assert!(p.next_job().is_some_and(|j| j.req == RequestId(1)));
    let acts = sent(p.handle(abort(2)));
    assert!(matches!(acts.as_slice(), [a] if fenced(2)(a)), "{acts:?}");
    assert_eq!(p.queued(), 1);
    assert!(p.keep_going(RequestId(1)));
    assert!(!p.keep_going(RequestId(3)), "only the running job goes on");
    assert!(p.handle(abort(1)).is_empty(), "the running job is told at its next chunk");
    assert!(!p.keep_going(RequestId(1)));
    // It finished computing anyway: the decode worker gets a fence, never a Done.
    let acts =
        sent(p.job_ended(RequestId(1), JobOutcome::Done { tokens: 4, first_token: 7, manifest: 1, cached: 0, first_logprobs: None }));
    assert!(matches!(acts.as_slice(), [a] if fenced(1)(a)), "{acts:?}");
    assert!(p.next_job().is_some_and(|j| j.req == RequestId(3)), "the aborted job never runs");
    let acts =
        sent(p.job_ended(RequestId(3), JobOutcome::Done { tokens: 4, first_token: 7, manifest: 1, cached: 0, first_logprobs: None }));
    assert!(matches!(acts.as_slice(), [(false, Message::Done { .. })]), "{acts:?}");
    assert_eq!(p.stats(), PrefillStats { admitted: 3, aborted: 2, completed: 1, ..PrefillStats::default() });
}

#[test]
fn a_lost_decode_connection_fails_the_jobs_bound_for_it_and_no_others_and_the_gateway_hears() {
    let mut p = role();
    let other = WorkerId(4);
    p.handle(PrefillEvent::DecodeConnected { decode: other });
    p.handle(prefill_for(1, 4, 1, DECODE));
    p.handle(prefill_for(2, 4, 1, DECODE));
    p.handle(prefill_for(3, 4, 1, other));
    assert!(p.next_job().is_some_and(|j| j.req == RequestId(1)));
    let acts = sent(p.handle(PrefillEvent::DecodeLost { decode: DECODE }));
    assert!(matches!(&acts[0], (true, Message::KvLost { decode }) if *decode == DECODE), "{acts:?}");
    let failed: Vec<RequestId> = acts[1..]
        .iter()
        .map(|(to_gateway, m)| match m {
            Message::Failed { req, reason: FailReason::WorkerLost, .. } if *to_gateway => *req,
            m => panic!("unexpected {m:?}"),
        })
        .collect();
    assert_eq!(failed, [RequestId(2)], "the queued job for the closed connection fails");
    assert!(!p.keep_going(RequestId(1)), "the running one stops at its next chunk");
    assert!(!p.connected(DECODE) && p.connected(other));
}

#[test]
fn a_job_waits_for_its_kv_connection_and_one_for_an_unknown_decode_worker_fails_at_once() {
    let mut p = PrefillRole::new(PrefillConfig { max_prompt: MAX_PROMPT, page_size: PAGE, keepalive_ms: KEEPALIVE_MS });
    let acts = p.handle(prefill(1, 4, 1));
    assert!(matches!(acts.as_slice(), [PrefillAction::ToGateway(Message::Failed { reason: FailReason::WorkerLost, .. })]), "{acts:?}");
    p.handle(PrefillEvent::Gateway { from: GatewayId(0), msg: Message::DecodePeer { worker: DECODE, addr: "d:1".into() } });
    assert!(p.handle(prefill(2, 4, 1)).is_empty(), "introduced: the job waits for the connection");
    assert!(p.next_job().is_none() && !p.has_ready_job());
    p.handle(PrefillEvent::DecodeConnected { decode: DECODE });
    assert!(p.next_job().is_some_and(|j| j.req == RequestId(2)));
    assert!(p.keep_going(RequestId(2)));
}

#[test]
fn a_lost_kv_connection_makes_the_worker_rejoin_under_a_new_id_unless_the_decode_worker_left() {
    use bulkhead_protocol::prefill::REJOIN_AFTER_MS;
    let rejoins = |acts: &[PrefillAction]| acts.iter().filter(|a| **a == PrefillAction::Rejoin).count();
    // The decode worker left: its connection's loss is expected, no rejoin.
    let mut p = role();
    p.handle(PrefillEvent::Gateway { from: GatewayId(0), msg: Message::PeerLeft { worker: DECODE } });
    p.handle(PrefillEvent::DecodeLost { decode: DECODE });
    assert!(!p.rejoin_pending());
    assert_eq!(rejoins(&p.handle(PrefillEvent::Tick { now_ms: 60_000 })), 0);
    // Lost while the decode worker is in the cluster: jobs for it fail at once, and after
    // a grace period (the gateway's `PeerLeft` may be on its way) the worker rejoins.
    let mut p = role();
    p.handle(prefill(1, 4, 1));
    let other = WorkerId(4);
    p.handle(PrefillEvent::DecodeConnected { decode: other });
    p.handle(prefill_for(2, 4, 1, other));
    let acts = p.handle(PrefillEvent::DecodeLost { decode: DECODE });
    assert!(acts.iter().any(|a| matches!(a, PrefillAction::ToGateway(Message::Failed { req, .. }) if *req == RequestId(1))), "{acts:?}");
    assert!(p.rejoin_pending());
    assert_eq!(rejoins(&p.handle(PrefillEvent::Tick { now_ms: REJOIN_AFTER_MS - 1 })), 0);
    let acts = p.handle(PrefillEvent::Tick { now_ms: REJOIN_AFTER_MS });
    assert_eq!(rejoins(&acts), 1);
    // Rejoining, it gives up every job (the gateway sends them elsewhere) and takes none.
    assert!(acts.iter().any(|a| matches!(a, PrefillAction::ToGateway(Message::Failed { req, .. }) if *req == RequestId(2))), "{acts:?}");
    assert_eq!(p.queued(), 0);
    let late = p.handle(prefill_for(3, 4, 1, other));
    assert!(matches!(late.as_slice(), [PrefillAction::ToGateway(Message::Failed { .. })]), "{late:?}");
    assert!(!p.rejoin_pending());
    assert_eq!(rejoins(&p.handle(PrefillEvent::Tick { now_ms: 60_000 })), 0, "once");
}

#[test]
fn ticks_send_a_keepalive_on_every_open_kv_connection_once_per_interval() {
    let mut p = role();
    let keepalives =
        |acts: Vec<PrefillAction>| acts.iter().filter(|a| matches!(a, PrefillAction::ToDecode { msg: Message::KvKeepalive, .. })).count();
    assert_eq!(keepalives(p.handle(PrefillEvent::Tick { now_ms: KEEPALIVE_MS - 1 })), 0);
    assert_eq!(keepalives(p.handle(PrefillEvent::Tick { now_ms: KEEPALIVE_MS })), 1);
    assert_eq!(keepalives(p.handle(PrefillEvent::Tick { now_ms: 2 * KEEPALIVE_MS - 1 })), 0);
    p.handle(PrefillEvent::DecodeConnected { decode: WorkerId(9) });
    let acts = p.handle(PrefillEvent::Tick { now_ms: 2 * KEEPALIVE_MS });
    let to: Vec<WorkerId> = acts.iter().filter_map(|a| if let PrefillAction::ToDecode { to, .. } = a { Some(*to) } else { None }).collect();
    assert_eq!(to, [DECODE, WorkerId(9)]);
    p.handle(PrefillEvent::DecodeLost { decode: WorkerId(9) });
    assert_eq!(keepalives(p.handle(PrefillEvent::Tick { now_ms: 3 * KEEPALIVE_MS })), 1, "none on a lost connection");
    assert_eq!(p.stats().keepalives, 4);
}

#[test]
fn a_decode_peer_from_the_gateway_asks_the_driver_to_connect() {
    let mut p = role();
    let acts = p.handle(PrefillEvent::Gateway { from: GatewayId(0), msg: Message::DecodePeer { worker: WorkerId(5), addr: "h:1".into() } });
    assert_eq!(acts, [PrefillAction::Connect { decode: WorkerId(5), addr: "h:1".into() }]);
    assert!(!p.connected(WorkerId(5)), "connected only once the driver says so");
}

/// What the decode worker holds (`held`) must be whole pages short of the prompt's last
/// position, and the target pages must cover exactly the rest; anything else is refused and
/// fenced before a position is computed or sent.
#[test]
fn held_tokens_must_be_whole_pages_before_the_last_position_with_pages_for_the_rest() {
    let mut p = role();
    let with_held = |req: u64, tokens: usize, held: u32, pages: usize| {
        let PrefillEvent::Gateway {
            from: GatewayId(0),
            msg: Message::Prefill { req: r, tokens: t, decode, pages: pg, sampling, skip_draws, trace, cache, .. },
        } = prefill(req, tokens, pages)
        else {
            unreachable!("prefill() makes a Prefill")
        };
        PrefillEvent::Gateway {
            from: GatewayId(0),
            msg: Message::Prefill { req: r, tokens: t, decode, held, pages: pg, sampling, skip_draws, trace, cache },
        }
    };
    assert!(p.handle(with_held(1, 7, 4, 1)).is_empty(), "one page held, one page of targets for the rest");
    // Not a whole page; the whole prompt (its last position must be sent); past it; pages
    // for the whole prompt although one is held.
    for (req, tokens, held, pages) in [(2, 7, 2, 2), (3, 8, 8, 0), (4, 7, 12, 0), (5, 7, 4, 2)] {
        let acts = sent(p.handle(with_held(req, tokens, held, pages)));
        assert!(matches!(acts.as_slice(), [a, b] if rejected(RejectReason::Invalid)(a) && fenced(req)(b)), "{req}: {acts:?}");
    }
    assert_eq!(p.queued(), 1);
}

/// A decode worker that gives up a request whose job never reached this prefill worker (its
/// gateway died before sending it, or the transfer timed out first) gets the fence at
/// once instead of waiting for ever, and the job is refused if it still comes: its pages
/// may be another request's by then (I4). A gateway's abort of a job not here changes
/// nothing (the gateway knows whether it sent one).
#[test]
fn an_abort_from_the_decode_worker_of_a_job_not_here_is_fenced_and_the_late_job_refused() {
    let mut p = role();
    assert!(p.handle(abort(7)).is_empty(), "the gateway's abort of an unknown job is a no-op");
    let from_decode = PrefillEvent::Decode { from: DECODE, msg: Message::Abort { req: RequestId(7), reason: AbortReason::Timeout } };
    assert_eq!(sent(p.handle(from_decode)), [(false, Message::Fenced { req: RequestId(7) })]);
    assert!(p.tombstoned(RequestId(7)));
    assert!(sent(p.handle(prefill(7, 4, 1))).is_empty(), "the late job is dropped");
    assert_eq!((p.queued(), p.tombstoned(RequestId(7))), (0, false), "nothing queued; the tombstone is used up");
    assert_eq!(p.stats().fenced_unknown, 1);
}

/// A lost gateway's jobs end here as its aborts would (queued: fenced at once), and no
/// other gateway's job does.
#[test]
fn a_lost_gateways_jobs_end_and_the_other_gateways_stay() {
    use bulkhead_protocol::gateway::request_id;
    let mut p = role();
    let (lost, kept) = (request_id(GatewayId(3), 1), request_id(GatewayId(0), 1));
    p.handle(prefill(lost.0, 4, 1));
    p.handle(prefill(kept.0, 4, 1));
    let acts = sent(p.handle(PrefillEvent::GatewayLost { gateway: GatewayId(3) }));
    assert_eq!(acts, [(false, Message::Fenced { req: lost })]);
    assert!(p.has_job(kept) && !p.has_job(lost));
}

/// Two gateways introduce the same decode worker: one KV connection, and a `PeerLeft` from
/// one of them (the decode worker left that gateway only) fails nothing; only when the last
/// gateway that named it says so are its jobs failed. A lost gateway stops naming it but
/// does not end the connection the other gateway uses.
#[test]
fn a_decode_worker_introduced_by_two_gateways_gets_one_connection_and_leaves_with_the_last() {
    let (g0, g1) = (GatewayId(0), GatewayId(1));
    let peer = |from| PrefillEvent::Gateway { from, msg: Message::DecodePeer { worker: DECODE, addr: "d:1".into() } };
    let left = |from| PrefillEvent::Gateway { from, msg: Message::PeerLeft { worker: DECODE } };
    let mut p = PrefillRole::new(PrefillConfig { max_prompt: MAX_PROMPT, page_size: PAGE, keepalive_ms: KEEPALIVE_MS });
    assert!(matches!(p.handle(peer(g0)).as_slice(), [PrefillAction::Connect { .. }]));
    assert!(p.handle(peer(g1)).is_empty(), "no second KV connection to one decode worker");
    p.handle(PrefillEvent::DecodeConnected { decode: DECODE });
    p.handle(prefill(1, 4, 1));
    assert!(p.handle(left(g0)).is_empty() && p.connected(DECODE), "gateway 1 still routes through it");
    assert!(p.handle(PrefillEvent::GatewayLost { gateway: g1 }).is_empty());
    assert!(p.connected(DECODE) && p.has_job(RequestId(1)), "a lost gateway ends only its own jobs");
    p.handle(peer(g1));
    let acts = sent(p.handle(left(g1)));
    assert!(acts.iter().any(|(to_gw, m)| *to_gw && matches!(m, Message::Failed { .. })), "{acts:?}");
    assert!(!p.connected(DECODE));
}

/// A KV connection lost is fenced at the decode worker for this worker's id: another
/// gateway's late introduction of the same decode worker must not open a new connection
/// under that id (its chunks would land in pages the decode worker has released, I4;
/// found by the fault schedules, seed 57230). The rejoin under a new id follows.
#[test]
fn a_late_introduction_of_a_decode_worker_whose_connection_was_lost_opens_nothing() {
    let mut p = role();
    p.handle(PrefillEvent::DecodeLost { decode: DECODE });
    let acts = p.handle(PrefillEvent::Gateway { from: GatewayId(1), msg: Message::DecodePeer { worker: DECODE, addr: "d:1".into() } });
    assert!(acts.is_empty(), "no connection under the fenced id: {acts:?}");
    assert!(p.rejoin_pending());
}
