//! The gateway role alone: admission at the served context, routing around departed
//! workers, which worker may speak for a request, and aborts reaching every other worker
//! (I3, I5). Each test kills mutants `cargo mutants` found surviving the cluster tests
//! (docs/TESTING.md).

use bulkhead_kv::{Generation, PageId, PageRef, RequestId};
use bulkhead_protocol::gateway::{
    BusyReason, ClientOutput, GatewayAction, GatewayConfig, GatewayEvent, GatewayRole, GatewaySettings, GatewayStats, KvShape, Phase,
    QUEUE_WAIT_BUCKETS, RegisterError, Submission, TenantId, TenantPolicy, attempt_id, client_of,
};
use bulkhead_protocol::*;

const P1: WorkerId = WorkerId(1);
const D2: WorkerId = WorkerId(2);
const P3: WorkerId = WorkerId(3);
const D4: WorkerId = WorkerId(4);
const TIMEOUT_MS: u64 = 100;

const DIGEST: u64 = 0xb0;

fn hello(worker: WorkerId, role: Role, max_context: u32) -> Hello {
    let kv_addr = if role == Role::Decode { "decode:9".to_string() } else { String::new() };
    Hello { role, model_digest: DIGEST, page_size: 4, kv_bytes_per_token: 16, capacity_tokens: 64, max_context, kv_addr, worker }
}

fn join(g: &mut GatewayRole, id: WorkerId, role: Role) -> Vec<GatewayAction> {
    g.join(&hello(id, role, 8)).expect("a matching worker registers")
}

fn config(max_queued: usize, tenants: &[(u32, TenantPolicy)]) -> GatewayConfig {
    GatewayConfig {
        model_context: 8,
        model_digest: DIGEST,
        settings: GatewaySettings {
            admission_check: true,
            request_timeout_ms: TIMEOUT_MS,
            max_queued,
            queue_timeout_ms: TIMEOUT_MS / 2,
            migration_limit: 3,
            prefill_window_tokens: 0,
        },
        tenants: tenants.iter().map(|(t, p)| (TenantId(*t), *p)).collect(),
    }
}

fn gateway(workers: &[(WorkerId, Role)]) -> GatewayRole {
    let mut g = GatewayRole::new(config(4, &[]));
    for &(id, role) in workers {
        join(&mut g, id, role);
    }
    g
}

fn submit(g: &mut GatewayRole, req: u64, prompt: usize, max_tokens: u32) -> Vec<GatewayAction> {
    let ev = GatewayEvent::Submit {
        req: RequestId(req),
        submission: Submission {
            tokens: vec![5; prompt],
            max_tokens,
            max_tokens_set: true,
            sampling: Sampling::default(),
            stop: vec![],
            trace: TraceContext::default(),
            tenant: TenantId(0),
            cache: None,
            priority: 0,
        },
    };
    g.handle(ev)
}

fn from(g: &mut GatewayRole, from: WorkerId, msg: Message) -> Vec<GatewayAction> {
    g.handle(GatewayEvent::FromWorker { from, msg })
}

fn reserved(req: u64) -> Message {
    Message::Reserved { req: RequestId(req), held: 0, pages: vec![PageRef { page: PageId(0), generation: Generation(1) }], local: false }
}

fn token(req: u64) -> Message {
    Message::Token { req: RequestId(req), token: 9, text: "x".into(), logprobs: None }
}

/// (decode, prefill) a Reserve was routed to.
fn routed(acts: &[GatewayAction]) -> (WorkerId, WorkerId) {
    match acts {
        [GatewayAction::ToWorker { to, msg: Message::Reserve { prefill, .. } }] => (*to, *prefill),
        other => panic!("no Reserve: {other:?}"),
    }
}

fn to_client(acts: &[GatewayAction]) -> Vec<&ClientOutput> {
    acts.iter().filter_map(|a| if let GatewayAction::ToClient { out, .. } = a { Some(out) } else { None }).collect()
}

/// Workers a message of kind `Abort` or `Cancel` went to, in order.
fn aborted(acts: &[GatewayAction]) -> Vec<WorkerId> {
    acts.iter()
        .filter_map(|a| match a {
            GatewayAction::ToWorker { to, msg: Message::Abort { .. } | Message::Cancel { .. } } => Some(*to),
            _ => None,
        })
        .collect()
}

#[test]
fn the_gateway_admits_exactly_the_served_context_and_refuses_when_it_cannot_route() {
    let mut g = gateway(&[(P1, Role::Prefill)]);
    assert_eq!(g.max_context(), 8);
    assert!(!g.ready(), "no decode worker yet");
    let starting = submit(&mut g, 1, 4, 4);
    assert!(
        matches!(to_client(&starting).as_slice(), [ClientOutput::Unavailable { detail }] if detail.contains("starting") && detail.contains("decode")),
        "{starting:?}"
    );
    join(&mut g, D2, Role::Decode);
    assert!(g.ready());
    assert_eq!(routed(&submit(&mut g, 2, 4, 4)), (D2, P1), "4 + 4 = the context: admitted");
    let over = submit(&mut g, 3, 5, 4);
    assert!(matches!(to_client(&over).as_slice(), [ClientOutput::Rejected { reason: RejectReason::ContextLength, .. }]), "{over:?}");
    // A second request under an id in flight would take over the first one's replies.
    assert!(matches!(to_client(&submit(&mut g, 2, 1, 1)).as_slice(), [ClientOutput::Unavailable { .. }]));
    assert_eq!(g.in_flight(), 1);
    assert_eq!(g.stats(), GatewayStats { submitted: 4, rejected_at_gateway: 1, ..GatewayStats::default() });
}

#[test]
fn only_the_assigned_decode_worker_moves_a_request_on_and_speaks_to_the_client() {
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode)]);
    submit(&mut g, 1, 4, 4);
    assert!(from(&mut g, P1, reserved(1)).is_empty(), "a Reserved from the prefill worker");
    let acts = from(&mut g, D2, reserved(1));
    assert!(matches!(acts.as_slice(), [GatewayAction::ToWorker { to: P1, msg: Message::Prefill { .. } }]), "{acts:?}");
    assert!(from(&mut g, D2, reserved(1)).is_empty(), "a second Reserved sends no second Prefill");
    assert!(from(&mut g, P1, token(1)).is_empty());
    assert_eq!(to_client(&from(&mut g, D2, token(1))), [&ClientOutput::Token { token: 9, text: "x".into(), logprobs: None }]);
    let finished = Message::Finished {
        req: RequestId(1),
        finish: FinishReason::Stop,
        text: String::new(),
        prompt_tokens: 4,
        completion_tokens: 1,
        cached_tokens: 0,
    };
    assert!(from(&mut g, P1, finished.clone()).is_empty());
    assert_eq!(g.in_flight(), 1);
    assert_eq!(to_client(&from(&mut g, D2, finished)).len(), 1);
    assert_eq!(g.in_flight(), 0);
    assert_eq!(g.stats(), GatewayStats { submitted: 1, finished: 1, queue_waits: left_queue_at_once(1), ..GatewayStats::default() });
}

#[test]
fn a_worker_rejection_ends_the_request_and_a_prefill_rejection_aborts_the_decode_reservation() {
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode)]);
    let rejected = |req| Message::Rejected { req: RequestId(req), reason: RejectReason::ContextLength, detail: "long".into() };
    submit(&mut g, 1, 4, 4);
    let acts = from(&mut g, D2, rejected(1));
    assert!(aborted(&acts).is_empty() && to_client(&acts).len() == 1, "{acts:?}");
    submit(&mut g, 2, 4, 4);
    from(&mut g, D2, reserved(2));
    let acts = from(&mut g, P1, rejected(2));
    assert_eq!(aborted(&acts), [D2]);
    assert!(matches!(to_client(&acts).as_slice(), [ClientOutput::Rejected { .. }]));
    assert_eq!(g.stats().rejected_by_worker, 2);
}

#[test]
fn a_failure_reported_by_one_worker_aborts_the_request_on_the_other() {
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode)]);
    submit(&mut g, 1, 4, 4);
    from(&mut g, D2, reserved(1));
    let failed = Message::Failed { req: RequestId(1), reason: FailReason::TransferRefused, detail: "checksum".into() };
    let acts = from(&mut g, D2, failed);
    assert_eq!(aborted(&acts), [P1]);
    submit(&mut g, 2, 4, 4);
    from(&mut g, D2, reserved(2));
    assert_eq!(aborted(&g.handle(GatewayEvent::ClientGone { req: RequestId(2) })), [D2, P1]);
    let want = GatewayStats { submitted: 2, failed: 1, client_gone: 1, queue_waits: left_queue_at_once(2), ..GatewayStats::default() };
    assert_eq!(g.stats(), want);
}

#[test]
fn a_departed_prefill_worker_costs_its_unsent_requests_nothing_and_a_departed_decode_moves_its_own() {
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode), (P3, Role::Prefill), (D4, Role::Decode)]);
    // Round robin: the first request goes to the second worker of each role.
    assert_eq!(routed(&submit(&mut g, 1, 4, 4)), (D4, P3));
    assert_eq!(routed(&submit(&mut g, 2, 4, 4)), (D2, P1));
    // Nothing was sent to P1 yet: request 2's reservation is cancelled and it goes again,
    // as a new attempt, to the prefill worker that is left.
    let acts = g.handle(GatewayEvent::WorkerLeft { id: P1 });
    assert!(to_client(&acts).is_empty(), "{acts:?}");
    assert_eq!(aborted(&acts), [D2], "the old reservation is cancelled, the departed worker not written to");
    let again = acts.iter().find_map(|a| match a {
        GatewayAction::ToWorker { to, msg: Message::Reserve { req, prefill, .. } } => Some((*to, *req, *prefill)),
        _ => None,
    });
    let Some((decode, attempt, prefill)) = again else { panic!("not sent again: {acts:?}") };
    assert_eq!((attempt, prefill), (attempt_id(RequestId(2), 1), P3));
    assert_eq!(client_of(attempt), RequestId(2));
    assert_eq!(g.in_flight(), 2);
    // The decode worker D4 leaves: what it held moves to D2 as a new attempt (I11), the
    // client hears nothing, and prefill workers stop reconnecting to it.
    let acts = g.handle(GatewayEvent::WorkerLeft { id: D4 });
    let moved = if decode == D4 { 2 } else { 1 };
    assert!(to_client(&acts).is_empty(), "{acts:?}");
    let reserves = acts.iter().filter(|a| matches!(a, GatewayAction::ToWorker { to: D2, msg: Message::Reserve { .. } })).count();
    assert_eq!(reserves, moved, "{acts:?}");
    assert!(
        acts.iter().any(|a| matches!(a, GatewayAction::ToWorker { to: P3, msg: Message::PeerLeft { worker: D4 } })),
        "prefill workers stop reconnecting to it"
    );
    assert_eq!(g.in_flight(), 2);
    assert_eq!(g.stats().migrated, moved as u64);
    for req in 3..5 {
        assert_eq!(routed(&submit(&mut g, req, 4, 4)), (D2, P3));
    }
}

/// A prefill worker that lost its KV connection to a decode worker leaves that route at
/// once: new requests take the other prefill worker (not a 503 `worker_lost` while it
/// rejoins), and it is back in the rotation under its new id only.
#[test]
fn a_prefill_worker_that_lost_its_kv_connection_is_routed_around_at_once() {
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode), (P3, Role::Prefill)]);
    from(&mut g, P1, Message::KvLost { decode: D2 });
    for req in 1..5 {
        assert_eq!(routed(&submit(&mut g, req, 4, 4)), (D2, P3), "request {req}");
    }
    // It rejoins under a new id: routable again; the old id is gone for good.
    g.handle(GatewayEvent::WorkerLeft { id: P1 });
    join(&mut g, WorkerId(5), Role::Prefill);
    let routes: Vec<WorkerId> = (5..9).map(|req| routed(&submit(&mut g, req, 4, 4)).1).collect();
    assert!(routes.contains(&WorkerId(5)) && !routes.contains(&P1), "{routes:?}");
}

/// With the only prefill worker lost, requests wait in the queue for one to come back (a
/// restarted worker rejoins within seconds) instead of getting 503 at once; they get 503,
/// saying why, when none came back within the queue timeout. A server that never had a
/// prefill worker says it is starting, at once.
#[test]
fn requests_wait_for_a_lost_role_to_rejoin_and_get_503_only_past_the_queue_timeout() {
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode)]);
    g.handle(GatewayEvent::WorkerLeft { id: P1 });
    assert!(to_client(&submit(&mut g, 1, 4, 4)).is_empty(), "queued, not refused");
    assert_eq!(g.queued(), 1);
    // The worker comes back: the request goes on.
    let acts = join(&mut g, P3, Role::Prefill);
    assert_eq!(reserves(&acts), [(D2, RequestId(1))]);
    assert!(acts.iter().any(|a| matches!(a, GatewayAction::ToWorker { to: D2, msg: Message::Reserve { prefill: P3, .. } })));
    // Lost again, and nobody comes: 503 at the queue timeout, naming the role.
    g.handle(GatewayEvent::WorkerLeft { id: P3 });
    assert!(to_client(&submit(&mut g, 2, 4, 4)).is_empty());
    let acts = g.handle(GatewayEvent::Tick { now_ms: TIMEOUT_MS / 2 });
    assert!(
        to_client(&acts).iter().any(|o| matches!(o, ClientOutput::Unavailable { detail } if detail.contains("no prefill worker"))),
        "{acts:?}"
    );
    // Past the queue timeout since the loss: refused at once.
    assert!(matches!(to_client(&submit(&mut g, 3, 4, 4)).as_slice(), [ClientOutput::Unavailable { .. }]));
    // Never had one: refused at once, saying the server is starting.
    let mut fresh = gateway(&[(D2, Role::Decode)]);
    let acts = submit(&mut fresh, 1, 4, 4);
    assert!(matches!(to_client(&acts).as_slice(), [ClientOutput::Unavailable { detail }] if detail.contains("starting")), "{acts:?}");
}

/// A request admitted while a role had no worker is checked again when one joins: a worker
/// serving a shorter context makes it over-long, and it is refused before anything is
/// reserved (found by the fault schedules, seed 5741: it had finished with 200).
#[test]
fn a_queued_request_is_admitted_again_against_the_context_of_the_workers_that_joined() {
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode)]);
    g.handle(GatewayEvent::WorkerLeft { id: P1 });
    assert!(to_client(&submit(&mut g, 1, 3, 4)).is_empty(), "7 tokens fit the model's 8: queued");
    let acts = g.join(&hello(P3, Role::Prefill, 4)).expect("joins");
    assert!(reserves(&acts).is_empty(), "{acts:?}");
    assert!(matches!(to_client(&acts).as_slice(), [ClientOutput::Rejected { reason: RejectReason::ContextLength, .. }]), "{acts:?}");
    assert_eq!((g.in_flight(), g.stats().rejected_at_gateway), (0, 1));
}

#[test]
fn a_request_times_out_at_its_deadline_and_not_before() {
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode)]);
    submit(&mut g, 1, 4, 4);
    assert!(g.handle(GatewayEvent::Tick { now_ms: TIMEOUT_MS - 1 }).is_empty());
    let acts = g.handle(GatewayEvent::Tick { now_ms: TIMEOUT_MS });
    assert!(matches!(to_client(&acts).as_slice(), [ClientOutput::Failed { reason: FailReason::Timeout, .. }]), "{acts:?}");
}

/// Worker messages of `acts` as (to, message).
fn to_workers(acts: &[GatewayAction]) -> Vec<(WorkerId, &Message)> {
    acts.iter().filter_map(|a| if let GatewayAction::ToWorker { to, msg } = a { Some((*to, msg)) } else { None }).collect()
}

#[test]
fn registration_welcomes_a_matching_worker_introduces_prefills_to_decodes_and_refuses_the_rest() {
    let mut g = gateway(&[]);
    let acts = join(&mut g, P1, Role::Prefill);
    assert_eq!(to_workers(&acts), [(P1, &Message::Welcome { gateway: GatewayId(0) })]);
    let peer = Message::DecodePeer { worker: D2, addr: "decode:9".into() };
    let acts = join(&mut g, D2, Role::Decode);
    assert_eq!(
        to_workers(&acts),
        [(D2, &Message::Welcome { gateway: GatewayId(0) }), (P1, &peer)],
        "the prefill hears of the new decode worker"
    );
    let acts = join(&mut g, P3, Role::Prefill);
    assert_eq!(
        to_workers(&acts),
        [(P3, &Message::Welcome { gateway: GatewayId(0) }), (P3, &peer)],
        "a new prefill hears of every decode worker"
    );
    let other_model = Hello { model_digest: DIGEST + 1, ..hello(D4, Role::Decode, 8) };
    assert_eq!(g.join(&other_model).unwrap_err(), RegisterError::Model { worker: DIGEST + 1, gateway: DIGEST });
    let other_layout = Hello { page_size: 8, ..hello(D4, Role::Decode, 8) };
    let err = g.join(&other_layout).unwrap_err();
    assert_eq!(
        err,
        RegisterError::Layout {
            worker: KvShape { page_size: 8, kv_bytes_per_token: 16 },
            registered: KvShape { page_size: 4, kv_bytes_per_token: 16 }
        }
    );
    assert_eq!(g.join(&hello(D2, Role::Decode, 8)).unwrap_err(), RegisterError::Duplicate(D2));
    assert_eq!(g.workers(Role::Decode), [D2], "refused workers are not routed to");
}

#[test]
fn the_served_context_is_the_smallest_a_registered_worker_accepts_and_grows_back_when_it_leaves() {
    let mut g = gateway(&[(P1, Role::Prefill)]);
    g.join(&hello(D2, Role::Decode, 6)).unwrap();
    assert_eq!(g.max_context(), 6);
    g.join(&hello(D4, Role::Decode, 100)).unwrap();
    assert_eq!(g.max_context(), 6, "never more than the model's context nor the smallest worker's");
    g.handle(GatewayEvent::WorkerLeft { id: D2 });
    assert_eq!(g.max_context(), 8, "the model's context caps a bigger worker");
}

#[test]
fn a_lost_kv_connection_is_reported_unreachable_and_a_worker_that_leaves_is_told_to_its_peers() {
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode), (D4, Role::Decode)]);
    let acts = from(&mut g, P1, Message::KvLost { decode: D4 });
    assert_eq!(to_workers(&acts), [(D4, &Message::PrefillUnreachable { worker: P1 })]);
    // Leaving is final for the worker id (a restarted worker joins under a new one), so
    // the peers hear `PeerLeft` and refuse that id from then on.
    let acts = g.handle(GatewayEvent::WorkerLeft { id: P1 });
    let left = Message::PeerLeft { worker: P1 };
    assert_eq!(to_workers(&acts), [(D2, &left), (D4, &left)]);
    let mut g = gateway(&[(P1, Role::Prefill), (P3, Role::Prefill), (D2, Role::Decode)]);
    let acts = g.handle(GatewayEvent::WorkerLeft { id: D2 });
    let left = Message::PeerLeft { worker: D2 };
    assert_eq!(to_workers(&acts), [(P1, &left), (P3, &left)], "a decode worker's leaving is told to every prefill worker");
}

fn capacity(req: RequestId) -> Message {
    Message::Rejected { req, reason: RejectReason::Capacity, detail: "full".into() }
}

/// The attempt ids of the Reserves in `acts`, with the decode worker each went to.
fn reserves(acts: &[GatewayAction]) -> Vec<(WorkerId, RequestId)> {
    acts.iter()
        .filter_map(|a| match a {
            GatewayAction::ToWorker { to, msg: Message::Reserve { req, .. } } => Some((*to, *req)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_decode_worker_out_of_room_queues_requests_until_it_frees_some_and_the_queue_is_bounded_in_size_and_time() {
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode)]);
    assert_eq!(routed(&submit(&mut g, 1, 4, 4)), (D2, P1));
    from(&mut g, D2, reserved(1));
    assert_eq!(routed(&submit(&mut g, 2, 4, 4)), (D2, P1));
    // No room for request 2: it waits, as a new attempt, at the queue's head.
    let acts = from(&mut g, D2, capacity(RequestId(2)));
    assert!(to_client(&acts).is_empty() && reserves(&acts).is_empty(), "{acts:?}");
    assert_eq!(g.phase_of(attempt_id(RequestId(2), 1)), Some(Phase::Queued));
    assert_eq!(g.phase_of(RequestId(2)), None, "the old attempt is over");
    // Later requests queue behind it without being sent to the full worker.
    for req in 3..6 {
        assert!(submit(&mut g, req, 4, 4).is_empty(), "request {req} waits");
    }
    assert_eq!(g.queued(), 4);
    let full = submit(&mut g, 6, 4, 4);
    assert!(matches!(to_client(&full).as_slice(), [ClientOutput::Busy { reason: BusyReason::QueueFull, .. }]), "{full:?}");
    // Request 1 finishes: room again, the head goes first under its next attempt id.
    let finished = Message::Finished {
        req: RequestId(1),
        finish: FinishReason::Stop,
        text: String::new(),
        prompt_tokens: 4,
        completion_tokens: 1,
        cached_tokens: 0,
    };
    let acts = from(&mut g, D2, finished);
    let sent = reserves(&acts);
    assert_eq!(sent.first(), Some(&(D2, attempt_id(RequestId(2), 1))), "{acts:?}");
    assert_eq!(sent.len(), 4, "the whole queue is offered again");
    // Each of them out of room once more; nothing frees: they wait out the queue timeout.
    for (_, attempt) in sent {
        from(&mut g, D2, capacity(attempt));
    }
    assert_eq!(g.queued(), 4);
    let acts = g.handle(GatewayEvent::Tick { now_ms: TIMEOUT_MS / 2 - 1 });
    assert!(to_client(&acts).is_empty(), "a tick offers the queue again, it refuses nothing early: {acts:?}");
    for (_, attempt) in reserves(&acts) {
        from(&mut g, D2, capacity(attempt));
    }
    let acts = g.handle(GatewayEvent::Tick { now_ms: TIMEOUT_MS / 2 + 1 });
    let busy = to_client(&acts);
    assert_eq!(busy.len(), 4, "{acts:?}");
    assert!(busy.iter().all(|o| matches!(o, ClientOutput::Busy { reason: BusyReason::QueueTimeout, .. })));
    let s = g.stats();
    // Four requests were refused for room, some of them more than once: each counts once.
    assert_eq!((s.queue_full, s.queue_timeouts, s.requeued_capacity), (1, 4, 4));
    // One left the queue at once for a reservation; the four that timed out waited until
    // the tick, half the request timeout later.
    assert_eq!((s.queue_waits.iter().sum::<u64>(), s.queue_waits[0]), (5, 1), "{s:?}");
    assert_eq!(s.queue_wait_ms_total, 4 * (TIMEOUT_MS / 2 + 1), "{s:?}");
    assert_eq!(g.in_flight(), 0);
}

#[test]
fn a_retracted_request_resumes_from_its_tokens_and_a_prompt_lost_with_its_prefill_worker_is_retried_once_elsewhere() {
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode), (P3, Role::Prefill)]);
    routed(&submit(&mut g, 1, 3, 4));
    from(&mut g, D2, reserved(1));
    from(&mut g, D2, token(1));
    let acts = from(&mut g, D2, Message::Retracted { req: RequestId(1), tokens: vec![11, 12] });
    assert!(to_client(&acts).is_empty(), "the client sees nothing of it: {acts:?}");
    // The decode worker gave pages away: the request waits until it has room again, past
    // the queue timeout (its client is mid-stream), until the request timeout.
    assert!(reserves(&acts).is_empty());
    let acts = g.handle(GatewayEvent::Tick { now_ms: TIMEOUT_MS / 2 + 1 });
    assert!(to_client(&acts).is_empty(), "a stream is never cut by the queue timeout: {acts:?}");
    for (_, attempt) in reserves(&acts) {
        from(&mut g, D2, capacity(attempt));
    }
    let acts = g.handle(GatewayEvent::Tick { now_ms: TIMEOUT_MS / 2 + 2 });
    let resent = acts.iter().find_map(|a| match a {
        GatewayAction::ToWorker { msg: Message::Reserve { req, prompt_tokens, max_tokens, resume, .. }, .. } => {
            Some((*req, *prompt_tokens, *max_tokens, resume.clone()))
        }
        _ => None,
    });
    let Some((attempt, ..)) = resent.clone() else { panic!("not resent: {acts:?}") };
    assert_eq!(resent, Some((attempt, 5, 2, vec![11, 12])), "{acts:?}");
    let acts = from(&mut g, D2, Message::Reserved { req: attempt, held: 0, pages: vec![], local: false });
    let prefill = acts.iter().find_map(|a| match a {
        GatewayAction::ToWorker { to, msg: Message::Prefill { tokens, skip_draws, .. } } => Some((*to, tokens.clone(), *skip_draws)),
        _ => None,
    });
    let Some((to, tokens, skip)) = prefill else { panic!("no Prefill: {acts:?}") };
    assert_eq!((tokens, skip), (vec![5, 5, 5, 11, 12], 2));
    // That prefill worker loses the prompt before a token came: one retry, elsewhere.
    let lost = |req| Message::Failed { req, reason: FailReason::WorkerLost, detail: "gone".into() };
    let acts = from(&mut g, to, lost(attempt));
    assert!(to_client(&acts).is_empty(), "{acts:?}");
    let again = acts.iter().find_map(|a| match a {
        GatewayAction::ToWorker { msg: Message::Reserve { req, prefill, .. }, .. } => Some((*req, *prefill)),
        _ => None,
    });
    let Some((attempt, prefill)) = again else { panic!("not retried: {acts:?}") };
    assert_ne!(prefill, to, "another prefill worker, there being one");
    from(&mut g, D2, Message::Reserved { req: attempt, held: 0, pages: vec![], local: false });
    let acts = from(&mut g, prefill, lost(attempt));
    assert!(matches!(to_client(&acts).as_slice(), [ClientOutput::Failed { reason: FailReason::WorkerLost, .. }]), "only once: {acts:?}");
    let s = g.stats();
    assert_eq!((s.retracted, s.retried, s.failed), (1, 1, 1));
}

#[test]
fn after_losing_its_last_worker_of_a_role_the_gateway_says_since_when_and_queued_requests_wait_for_a_new_one() {
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode)]);
    g.handle(GatewayEvent::Tick { now_ms: 10 });
    g.handle(GatewayEvent::WorkerLeft { id: D2 });
    let acts = g.handle(GatewayEvent::Tick { now_ms: 2_510 });
    assert!(acts.is_empty());
    let refused = submit(&mut g, 1, 4, 4);
    assert!(
        matches!(to_client(&refused).as_slice(), [ClientOutput::Unavailable { detail }] if detail.contains("lost 2.5 s ago")),
        "{refused:?}"
    );
    assert_eq!(g.unavailable().map(|d| d.contains("decode")), Some(true));
    join(&mut g, D4, Role::Decode);
    assert_eq!(g.unavailable(), None);
    assert_eq!(routed(&submit(&mut g, 2, 4, 4)), (D4, P1));
}

fn submit_as(g: &mut GatewayRole, req: u64, tenant: u32, cache: Option<bulkhead_protocol::cache::CacheScope>) -> Vec<GatewayAction> {
    submit_scoped(g, req, tenant, cache, 0)
}

/// A 4-token prompt with 4 tokens to generate, of `tenant`, under `cache`, at `priority`.
fn submit_scoped(
    g: &mut GatewayRole,
    req: u64,
    tenant: u32,
    cache: Option<bulkhead_protocol::cache::CacheScope>,
    priority: i64,
) -> Vec<GatewayAction> {
    let ev = GatewayEvent::Submit {
        req: RequestId(req),
        submission: Submission {
            tokens: vec![5; 4],
            max_tokens: 4,
            max_tokens_set: true,
            sampling: Sampling::default(),
            stop: vec![],
            trace: TraceContext::default(),
            tenant: TenantId(tenant),
            cache,
            priority,
        },
    };
    g.handle(ev)
}

/// The requests (client ids) of every Reserve, in order.
fn reserved_reqs(acts: &[GatewayAction]) -> Vec<u64> {
    acts.iter()
        .filter_map(
            |a| if let GatewayAction::ToWorker { msg: Message::Reserve { req, .. }, .. } = a { Some(client_of(*req).0) } else { None },
        )
        .collect()
}

#[test]
fn the_tenants_queues_take_turns_so_one_tenants_burst_cannot_starve_another() {
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode)]);
    // The decode worker has no room: everything from here waits.
    assert_eq!(reserved_reqs(&submit_as(&mut g, 1, 0, None)), [1]);
    from(&mut g, D2, Message::Rejected { req: RequestId(1), reason: RejectReason::Capacity, detail: String::new() });
    for req in 2..=4 {
        assert!(reserved_reqs(&submit_as(&mut g, req, 0, None)).is_empty());
    }
    // Tenant 0 holds the most one tenant may queue (4, with its requeued head): a fifth is
    // turned away, while tenant 1 still gets in.
    let full = submit_as(&mut g, 5, 0, None);
    assert!(matches!(to_client(&full).as_slice(), [ClientOutput::Busy { reason: BusyReason::QueueFull, .. }]), "{full:?}");
    for req in [6, 7] {
        assert!(reserved_reqs(&submit_as(&mut g, req, 1, None)).is_empty());
    }
    assert_eq!(g.queued(), 6);
    // Room: the queues take turns, tenant 1 first (tenant 0 was served last).
    assert_eq!(reserved_reqs(&from(&mut g, D2, Message::Room)), [6, 1, 7, 2, 3, 4]);
}

#[test]
fn routing_follows_the_cache_a_prefill_reported_for_the_same_scope_and_load_wins_out_of_balance() {
    use bulkhead_protocol::cache::CacheSecret;
    let secret = CacheSecret::from_random([9; 32]);
    let (a, b) = (secret.scope("a", None), secret.scope("b", None));
    let setup = |report: bool| {
        let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode), (P3, Role::Prefill)]);
        if report {
            // P3 cached tenant a's page of this prompt (page size 4, digest DIGEST).
            from(&mut g, P3, Message::CacheReport { stored: a.page_keys(DIGEST, &[5; 4], 4), evicted: vec![] });
        }
        g
    };
    // What tenant a cached never moves tenant b's request: same route with or without it.
    let (mut with, mut without) = (setup(true), setup(false));
    assert_eq!(routed(&submit_as(&mut with, 1, 1, Some(b))), routed(&submit_as(&mut without, 1, 1, Some(b))));
    // Tenant a's requests go to P3 while loads stay within the balance threshold...
    let mut g = setup(true);
    for req in 1..=3 {
        assert_eq!(routed(&submit_as(&mut g, req, 0, Some(a))).1, P3, "request {req}");
    }
    assert_eq!(g.stats().routed_by_cache, 3);
    // ...and to the idle P1 once P3 holds three more than it.
    assert_eq!(routed(&submit_as(&mut g, 4, 0, Some(a))).1, P1);
    assert_eq!(g.stats().routed_by_load, 1);
    // An eviction report takes the page out of the index.
    let mut g = setup(true);
    from(&mut g, P3, Message::CacheReport { stored: vec![], evicted: a.page_keys(DIGEST, &[5; 4], 4) });
    submit_as(&mut g, 1, 0, Some(a));
    assert_eq!(g.stats().routed_by_cache, 0);
}

/// The decode side's cache moves a request to the decode worker that holds its scope's
/// prefix (and tells it the scope and prompt), never another tenant's request, and never
/// moves a request ahead in its queue: a cached prefix decides where, not when.
#[test]
fn a_decode_workers_cache_picks_where_a_request_goes_never_when() {
    use bulkhead_protocol::cache::CacheSecret;
    let secret = CacheSecret::from_random([9; 32]);
    let (a, b) = (secret.scope("a", None), secret.scope("b", None));
    let setup = |report: bool| {
        let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode), (D4, Role::Decode)]);
        if report {
            // D4 kept tenant a's page of this prompt from an earlier turn.
            from(&mut g, D4, Message::CacheReport { stored: a.page_keys(DIGEST, &[5; 4], 4), evicted: vec![] });
        }
        g
    };
    // Tenant a's requests go to D4 whatever the round robin's turn; the Reserve carries the
    // scope and the prompt, for the decode worker's own lookup.
    let mut g = setup(true);
    for req in 1..=3 {
        let acts = submit_as(&mut g, req, 0, Some(a));
        assert_eq!(routed(&acts).0, D4, "request {req}");
        assert!(
            matches!(&acts[..], [GatewayAction::ToWorker { msg: Message::Reserve { cache: Some(c), prompt, .. }, .. }] if *c == a && prompt.len() == 4)
        );
    }
    assert_eq!(g.stats().decode_routed_by_cache, 3);
    // What tenant a cached never moves tenant b's request.
    let (mut with, mut without) = (setup(true), setup(false));
    assert_eq!(routed(&submit_as(&mut with, 1, 1, Some(b))), routed(&submit_as(&mut without, 1, 1, Some(b))));
    assert_eq!(with.stats().decode_routed_by_cache, 0);
    // Queued behind requests that hold nothing cached, the one whose prefix is cached waits
    // its turn: the decode worker that holds it is out of room, then has room again.
    let mut g = gateway(&[(P1, Role::Prefill), (D4, Role::Decode)]);
    from(&mut g, D4, Message::CacheReport { stored: a.page_keys(DIGEST, &[5; 4], 4), evicted: vec![] });
    assert_eq!(reserved_reqs(&submit_as(&mut g, 1, 0, None)), [1]);
    from(&mut g, D4, Message::Rejected { req: RequestId(1), reason: RejectReason::Capacity, detail: String::new() });
    assert!(reserved_reqs(&submit_as(&mut g, 2, 0, None)).is_empty(), "no room");
    assert!(reserved_reqs(&submit_as(&mut g, 3, 0, Some(a))).is_empty(), "no room");
    assert_eq!(reserved_reqs(&from(&mut g, D4, Message::Room)), [1, 2, 3], "first come, first served within the tenant");
}

/// Queue-wait buckets with `n` requests that left the queue as soon as they came.
fn left_queue_at_once(n: u64) -> [u64; QUEUE_WAIT_BUCKETS.len() + 1] {
    let mut w = [0; QUEUE_WAIT_BUCKETS.len() + 1];
    w[0] = n;
    w
}

/// I11: a lost decode worker costs no answer. Its streaming request moves to another
/// decode worker and resumes from the tokens the client has (they end the new attempt's
/// prompt, the sampler's draws for them skipped), without an error for the client; after
/// `migration_limit` moves the next loss fails it as before.
#[test]
fn a_stream_moves_off_a_lost_decode_worker_and_resumes_from_what_the_client_has() {
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode), (D4, Role::Decode)]);
    let (mut decode, _) = routed(&submit(&mut g, 1, 2, 6));
    from(&mut g, decode, reserved(1));
    for t in [11, 12] {
        from(&mut g, decode, Message::Token { req: RequestId(1), token: t, text: "x".into(), logprobs: None });
    }
    for attempt in 1..=3u32 {
        let acts = g.handle(GatewayEvent::WorkerLeft { id: decode });
        assert!(to_client(&acts).is_empty(), "move {attempt}: the client hears nothing: {acts:?}");
        let reserve = acts.iter().find_map(|a| match a {
            GatewayAction::ToWorker { to, msg: Message::Reserve { req, prompt_tokens, max_tokens, resume, .. } } => {
                Some((*to, *req, *prompt_tokens, *max_tokens, resume.clone()))
            }
            _ => None,
        });
        let (to, req, prompt_tokens, max_tokens, resume) = reserve.unwrap_or_else(|| panic!("move {attempt}: no new Reserve: {acts:?}"));
        assert_eq!((req, prompt_tokens, max_tokens, resume), (attempt_id(RequestId(1), attempt), 4, 4, vec![11, 12]));
        assert_ne!(to, decode);
        // A replacement registers, so a decode worker is always there to move to.
        join(&mut g, WorkerId(10 + attempt), Role::Decode);
        decode = to;
    }
    assert_eq!(g.stats().migrated, 3);
    let acts = g.handle(GatewayEvent::WorkerLeft { id: decode });
    assert!(
        matches!(to_client(&acts).as_slice(), [ClientOutput::Failed { reason: FailReason::WorkerLost, .. }]),
        "past the limit the loss fails it: {acts:?}"
    );
}

fn with_policies(policies: &[(u32, TenantPolicy)]) -> GatewayRole {
    let mut g = GatewayRole::new(config(16, policies));
    join(&mut g, P1, Role::Prefill);
    join(&mut g, D2, Role::Decode);
    g
}

fn submit_with(g: &mut GatewayRole, req: u64, tenant: u32, priority: i64) -> Vec<GatewayAction> {
    submit_scoped(g, req, tenant, None, priority)
}

/// Weights: a tenant of weight 2 is served while its recent use is below twice the
/// other's (with equal prompts, two of its requests for one); `priority` orders a
/// tenant's own queue (lower first, first come first served among equals) and never lets
/// it pass another tenant.
#[test]
fn weights_share_the_queue_and_priority_orders_only_the_tenants_own_requests() {
    let two = TenantPolicy { weight: 2, ..TenantPolicy::default() };
    let mut g = with_policies(&[(0, two)]);
    assert_eq!(reserved_reqs(&submit_with(&mut g, 1, 1, 0)), [1]);
    from(&mut g, D2, Message::Rejected { req: RequestId(1), reason: RejectReason::Capacity, detail: String::new() });
    for (req, tenant, priority) in [(2, 0, 0), (3, 0, 5), (4, 0, -1), (5, 1, -100), (6, 0, 0), (7, 1, 0)] {
        assert!(reserved_reqs(&submit_with(&mut g, req, tenant, priority)).is_empty());
    }
    // Tenant 1 was served last and used 4 tokens: tenant 0 goes next, two for each of
    // tenant 1's, its own queue by priority (4 at -1, then 2 and 6 at 0 in arrival order, then 3 at 5); tenant 1's
    // requeued request stays ahead of its -100, which waits its turn.
    assert_eq!(reserved_reqs(&from(&mut g, D2, Message::Room)), [4, 2, 1, 6, 3, 5, 7]);
}

/// Limits: over `max_concurrent_requests` or `tokens_per_minute` a request is turned away
/// (429, with how long to wait), counted, and nothing of it is charged or queued; another
/// tenant is not affected; a finished request refunds what it did not use.
#[test]
fn a_tenant_over_its_limits_is_turned_away_alone_and_unused_tokens_come_back() {
    let limited = TenantPolicy { max_concurrent_requests: Some(2), tokens_per_minute: Some(20), ..TenantPolicy::default() };
    let mut g = with_policies(&[(0, limited)]);
    let busy = |acts: &[GatewayAction]| match to_client(acts).as_slice() {
        [ClientOutput::Busy { reason, detail }] => Some((*reason, detail.clone())),
        _ => None,
    };
    assert_eq!(reserved_reqs(&submit_with(&mut g, 1, 0, 0)), [1]); // 8 of 20 tokens
    assert_eq!(reserved_reqs(&submit_with(&mut g, 2, 0, 0)), [2]); // 16 of 20
    let (reason, detail) = busy(&submit_with(&mut g, 3, 0, 0)).expect("a third one in flight is refused");
    assert_eq!(reason, BusyReason::ConcurrencyLimit);
    assert!(detail.contains("max_concurrent_requests is 2"), "{detail}");
    assert_eq!(reason.code(), "concurrency_limit_exceeded");
    // Another tenant is not limited by tenant 0's limits.
    assert_eq!(reserved_reqs(&submit_with(&mut g, 4, 1, 0)), [4]);
    // Request 2 fails before any token: its prompt was used, 4 come back; request 1
    // finishes after one token: it used 5 of its 8, 3 come back. 11 of 20 are free again:
    // request 5 (8 tokens) fits, request 6 no longer does.
    from(&mut g, D2, Message::Failed { req: RequestId(2), reason: FailReason::Internal, detail: String::new() });
    from(&mut g, D2, reserved(1));
    from(&mut g, D2, token(1));
    let done = Message::Finished {
        req: RequestId(1),
        finish: FinishReason::Stop,
        text: String::new(),
        prompt_tokens: 4,
        completion_tokens: 1,
        cached_tokens: 0,
    };
    from(&mut g, D2, done);
    assert_eq!(reserved_reqs(&submit_with(&mut g, 5, 0, 0)), [5]);
    let (reason, detail) = busy(&submit_with(&mut g, 6, 0, 0)).expect("over the tokens per minute");
    assert!(matches!(reason, BusyReason::TokenLimit { retry_after_s } if retry_after_s >= 1), "{reason:?}");
    assert!(detail.contains("tokens_per_minute (20)"), "{detail}");
    assert_eq!(g.stats().over_limit, 2);
    // A minute later the bucket is full again.
    g.handle(GatewayEvent::Tick { now_ms: 60_000 });
    from(&mut g, D2, Message::Failed { req: RequestId(5), reason: FailReason::Internal, detail: String::new() });
    assert!(busy(&submit_with(&mut g, 7, 0, 0)).is_none());
}

/// The siblings of `n > 1` (requests of one scope and first page sent together, before any
/// decode worker reported a page) go to the decode worker that is receiving the first
/// one's prompt, whatever the round robin's turn, so they share the pages it publishes
/// there; another scope's request with the same tokens is not drawn to it.
#[test]
fn requests_with_the_same_first_page_follow_one_being_received_to_its_decode_worker() {
    use bulkhead_protocol::cache::CacheSecret;
    let secret = CacheSecret::from_random([9; 32]);
    let (a, b) = (secret.scope("a", None), secret.scope("b", None));
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode), (D4, Role::Decode)]);
    let first = routed(&submit_as(&mut g, 1, 0, Some(a))).0;
    for req in 2..=4 {
        assert_eq!(routed(&submit_as(&mut g, req, 0, Some(a))).0, first, "sibling {req}");
    }
    // Without a scope (no cache) or under another scope, the round robin decides.
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode), (D4, Role::Decode)]);
    let first = routed(&submit_as(&mut g, 1, 0, Some(a))).0;
    assert_ne!(routed(&submit_as(&mut g, 2, 1, Some(b))).0, first, "another scope takes the next turn");
    assert_ne!(routed(&submit_as(&mut g, 3, 1, None)).0, routed(&submit_as(&mut g, 4, 1, None)).0);
}

/// The prefill window: a prefill worker is given prompts up to the window (always one when
/// it has none); the rest wait at the gateway, where the tenants take turns, so a burst of
/// one tenant does not fill the prefill worker's first-come queue ahead of another's
/// request. Fails with the window check in `dispatch` removed.
#[test]
fn a_prefill_window_keeps_one_tenants_burst_at_the_gateway_where_tenants_take_turns() {
    let mut c = config(16, &[]);
    c.settings.prefill_window_tokens = 6;
    let mut g = GatewayRole::new(c);
    join(&mut g, P1, Role::Prefill);
    join(&mut g, D2, Role::Decode);
    // Tenant 0's burst: the first prompt (4 tokens) goes on; 4 + 4 > 6, so the rest wait.
    assert_eq!(reserved_reqs(&submit_as(&mut g, 1, 0, None)), [1]);
    for req in 2..=4 {
        assert!(reserved_reqs(&submit_as(&mut g, req, 0, None)).is_empty(), "request {req} went past the window");
    }
    // Tenant 1 arrives behind the whole burst and waits its turn at the gateway.
    assert!(reserved_reqs(&submit_as(&mut g, 5, 1, None)).is_empty());
    assert_eq!(g.queued(), 4);
    // Prompt 1 is computed (its first token): tenant 1 goes next, not tenant 0's second.
    from(&mut g, D2, reserved(1));
    assert_eq!(reserved_reqs(&from(&mut g, D2, token(1))), [5]);
    from(&mut g, D2, reserved(5));
    assert_eq!(reserved_reqs(&from(&mut g, D2, token(5))), [2]);
}

/// Several gateways share workers: each numbers its requests inside its own id space, and
/// every attempt of a request names the gateway its answers go back to.
#[test]
fn request_ids_of_different_gateways_never_meet_and_every_attempt_names_its_gateway() {
    use bulkhead_protocol::gateway::{gateway_of, request_id};
    let (a, b) = (GatewayId(0), GatewayId(7));
    assert_eq!(request_id(a, 5), RequestId(5), "gateway 0 numbers as a single gateway does");
    assert_ne!(request_id(a, 5), request_id(b, 5));
    for n in [1, 2, (1 << 40) - 1] {
        for attempt in [0, 1, 3] {
            assert_eq!(gateway_of(attempt_id(request_id(b, n), attempt)), b);
            assert_eq!(client_of(attempt_id(request_id(b, n), attempt)), request_id(b, n));
        }
    }
    let mut g = GatewayRole::new(config(4, &[])).with_id(b);
    let acts = join(&mut g, P1, Role::Prefill);
    assert_eq!(to_workers(&acts), [(P1, &Message::Welcome { gateway: b })], "the Welcome names the gateway");
}

/// The queue serves the tenant that used least prefill lately per weight: a light tenant's
/// burst goes ahead of a tenant that keeps the server busy (round robin would put one of
/// the busy tenant's prompts between the two), and that use fades with time.
#[test]
fn a_light_tenants_burst_goes_ahead_of_a_busy_tenant_and_old_use_fades() {
    use bulkhead_protocol::gateway::USAGE_HALF_LIFE_MS;
    let mut patient = config(16, &[]);
    (patient.settings.request_timeout_ms, patient.settings.queue_timeout_ms) = (u64::MAX / 4, u64::MAX / 4);
    patient.settings.prefill_window_tokens = 6;
    let mut g = GatewayRole::new(patient);
    join(&mut g, P1, Role::Prefill);
    join(&mut g, D2, Role::Decode);
    // One prompt at a time (4 tokens, window 6): computing one lets the next go.
    let computed = |g: &mut GatewayRole, req: u64| {
        from(g, D2, reserved(req));
        reserved_reqs(&from(g, D2, token(req)))
    };
    assert_eq!(reserved_reqs(&submit_as(&mut g, 1, 0, None)), [1]);
    for req in 2..=5 {
        submit_as(&mut g, req, 0, None);
    }
    assert_eq!(computed(&mut g, 1), [2]);
    assert_eq!(computed(&mut g, 2), [3]);
    // Tenant 1's burst of two arrives while tenant 0 used 12 tokens: both go first.
    for req in [6, 7] {
        assert!(reserved_reqs(&submit_as(&mut g, req, 1, None)).is_empty());
    }
    assert_eq!(computed(&mut g, 3), [6]);
    assert_eq!(computed(&mut g, 6), [7]);
    assert_eq!(computed(&mut g, 7), [4]);
    // Much later tenant 0's use has faded to tenant 1's: equals take turns again, the one
    // after the last served first.
    g.handle(GatewayEvent::Tick { now_ms: 100 * USAGE_HALF_LIFE_MS });
    assert!(reserved_reqs(&submit_as(&mut g, 8, 1, None)).is_empty());
    assert_eq!(computed(&mut g, 4), [8], "tenant 1 is after tenant 0, served last");
    assert_eq!(computed(&mut g, 8), [5]);
}

/// A client that sends no `max_tokens` (the official clients' default) is charged its
/// prompt plus an estimate, not the rest of the context, so it fits a small budget; what it
/// really used is settled when it ends (a debt delays the next request by an honest, finite
/// `Retry-After`); a request larger than the whole budget is refused for good (400), not
/// told to retry.
#[test]
fn a_request_without_max_tokens_fits_a_small_token_budget_and_one_that_never_fits_is_refused_for_good() {
    let tpm = 1500;
    let policy = TenantPolicy { tokens_per_minute: Some(tpm), ..TenantPolicy::default() };
    let mut g = GatewayRole::new(GatewayConfig { model_context: 4096, ..config(16, &[(0, policy)]) });
    for (id, role) in [(P1, Role::Prefill), (D2, Role::Decode)] {
        g.join(&Hello { capacity_tokens: 1 << 20, ..hello(id, role, 4096) }).expect("registers");
    }
    let submit = |g: &mut GatewayRole, req: u64, prompt: usize, max_tokens: Option<u32>| {
        g.handle(GatewayEvent::Submit {
            req: RequestId(req),
            submission: Submission {
                tokens: vec![5; prompt],
                max_tokens: max_tokens.unwrap_or(4096 - prompt as u32),
                max_tokens_set: max_tokens.is_some(),
                sampling: Sampling::default(),
                stop: vec![],
                trace: TraceContext::default(),
                tenant: TenantId(0),
                cache: None,
                priority: 0,
            },
        })
    };
    // 100 + the estimate fits 1,500; the rest of the context (3,996) would not.
    assert_eq!(reserved_reqs(&submit(&mut g, 1, 100, None)), [1]);
    // It generates 1,000 tokens: 1,100 used against 356 charged leaves the bucket at
    // 1,500 − 1,100 = 400 tokens; the next default request (356) still fits, a third not.
    from(&mut g, D2, reserved(1));
    for _ in 0..1000 {
        from(&mut g, D2, token(1));
    }
    let done = Message::Finished {
        req: RequestId(1),
        finish: FinishReason::Length,
        text: String::new(),
        prompt_tokens: 100,
        completion_tokens: 1000,
        cached_tokens: 0,
    };
    from(&mut g, D2, done);
    assert_eq!(reserved_reqs(&submit(&mut g, 2, 100, None)), [2]);
    let acts = submit(&mut g, 3, 100, None);
    let [ClientOutput::Busy { reason: BusyReason::TokenLimit { retry_after_s }, detail }] = to_client(&acts).as_slice() else {
        panic!("expected a 429 for the tokens per minute: {acts:?}")
    };
    // 44 tokens are left, 356 are needed: 312 at 25 a second is 12.48 s, so 13 s.
    assert_eq!(*retry_after_s, 13, "{detail}");
    assert!(detail.contains("max_tokens is not set"), "{detail}");
    // Larger than the whole bucket: refused for good, whatever the bucket holds.
    for (req, prompt, max_tokens) in [(4, 1600, None), (5, 100, Some(1401))] {
        let acts = submit(&mut g, req, prompt, max_tokens);
        let [ClientOutput::OverBudget { detail }] = to_client(&acts).as_slice() else { panic!("expected a 400: {acts:?}") };
        assert!(detail.contains("tokens_per_minute of 1500") && detail.contains("never"), "{detail}");
    }
    // An explicit max_tokens that fits is charged in full, as before.
    g.handle(GatewayEvent::Tick { now_ms: 60_000 });
    assert_eq!(reserved_reqs(&submit(&mut g, 6, 100, Some(1400))), [6]);
}
