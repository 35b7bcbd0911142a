//! The gateway role alone: admission at the served context, routing around departed
//! workers, which worker may speak for a request, and aborts reaching every other worker
//! (I3, I5). Each test kills mutants `cargo mutants` found surviving the cluster tests
//! (docs/TESTING.md).

use bulkhead_kv::{Generation, PageId, PageRef, RequestId};
use bulkhead_protocol::gateway::{ClientOutput, GatewayAction, GatewayConfig, GatewayEvent, GatewayRole, GatewayStats, KvShape, RegisterError};
use bulkhead_protocol::*;

const P1: WorkerId = WorkerId(1);
const D2: WorkerId = WorkerId(2);
const P3: WorkerId = WorkerId(3);
const D4: WorkerId = WorkerId(4);
const TIMEOUT_MS: u64 = 100;

const DIGEST: u64 = 0xb0;

fn hello(role: Role, max_context: u32) -> Hello {
    let kv_addr = if role == Role::Decode { "decode:9".to_string() } else { String::new() };
    Hello { role, model_digest: DIGEST, page_size: 4, kv_bytes_per_token: 16, capacity_tokens: 64, max_context, kv_addr }
}

fn join(g: &mut GatewayRole, id: WorkerId, role: Role) -> Vec<GatewayAction> {
    g.join(id, &hello(role, 8)).expect("a matching worker registers")
}

fn gateway(workers: &[(WorkerId, Role)]) -> GatewayRole {
    let mut g = GatewayRole::new(GatewayConfig { model_context: 8, model_digest: DIGEST, admission_check: true, request_timeout_ms: TIMEOUT_MS });
    for &(id, role) in workers {
        join(&mut g, id, role);
    }
    g
}

fn submit(g: &mut GatewayRole, req: u64, prompt: usize, max_tokens: u32) -> Vec<GatewayAction> {
    let ev = GatewayEvent::Submit { req: RequestId(req), tokens: vec![5; prompt], max_tokens, sampling: Sampling::default(), stop: vec![], trace: TraceContext::default() };
    g.handle(ev)
}

fn from(g: &mut GatewayRole, from: WorkerId, msg: Message) -> Vec<GatewayAction> {
    g.handle(GatewayEvent::FromWorker { from, msg })
}

fn reserved(req: u64) -> Message {
    Message::Reserved { req: RequestId(req), pages: vec![PageRef { page: PageId(0), generation: Generation(1) }] }
}

fn token(req: u64) -> Message {
    Message::Token { req: RequestId(req), token: 9, text: "x".into() }
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
    assert_eq!(to_client(&submit(&mut g, 1, 4, 4)), [&ClientOutput::Unavailable]);
    join(&mut g, D2, Role::Decode);
    assert!(g.ready());
    assert_eq!(routed(&submit(&mut g, 2, 4, 4)), (D2, P1), "4 + 4 = the context: admitted");
    let over = submit(&mut g, 3, 5, 4);
    assert!(matches!(to_client(&over).as_slice(), [ClientOutput::Rejected { reason: RejectReason::ContextLength, .. }]), "{over:?}");
    // A second request under an id in flight would take over the first one's replies.
    assert_eq!(to_client(&submit(&mut g, 2, 1, 1)), [&ClientOutput::Unavailable]);
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
    assert_eq!(to_client(&from(&mut g, D2, token(1))), [&ClientOutput::Token { text: "x".into() }]);
    let finished = Message::Finished { req: RequestId(1), finish: FinishReason::Stop, text: String::new(), prompt_tokens: 4, completion_tokens: 1 };
    assert!(from(&mut g, P1, finished.clone()).is_empty());
    assert_eq!(g.in_flight(), 1);
    assert_eq!(to_client(&from(&mut g, D2, finished)).len(), 1);
    assert_eq!(g.in_flight(), 0);
    assert_eq!(g.stats(), GatewayStats { submitted: 1, finished: 1, ..GatewayStats::default() });
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
    assert_eq!(g.stats(), GatewayStats { submitted: 2, failed: 1, client_gone: 1, ..GatewayStats::default() });
}

#[test]
fn a_departed_worker_fails_only_its_requests_and_gets_no_new_ones() {
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode), (P3, Role::Prefill), (D4, Role::Decode)]);
    // Round robin: the first request goes to the second worker of each role.
    assert_eq!(routed(&submit(&mut g, 1, 4, 4)), (D4, P3));
    assert_eq!(routed(&submit(&mut g, 2, 4, 4)), (D2, P1));
    let acts = g.handle(GatewayEvent::WorkerLeft { id: P1 });
    assert!(
        matches!(to_client(&acts).as_slice(), [ClientOutput::Failed { reason: FailReason::WorkerLost, detail }] if detail == "worker-1 went away"),
        "{acts:?}"
    );
    assert_eq!(aborted(&acts), [D2], "the decode reservation is cancelled, not the departed worker");
    assert_eq!(g.in_flight(), 1);
    g.handle(GatewayEvent::WorkerLeft { id: D4 });
    assert_eq!(g.in_flight(), 0);
    for req in 3..5 {
        assert_eq!(routed(&submit(&mut g, req, 4, 4)), (D2, P3));
    }
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
    assert_eq!(to_workers(&acts), [(P1, &Message::Welcome { worker: P1 })]);
    let peer = Message::DecodePeer { worker: D2, addr: "decode:9".into() };
    let acts = join(&mut g, D2, Role::Decode);
    assert_eq!(to_workers(&acts), [(D2, &Message::Welcome { worker: D2 }), (P1, &peer)], "the prefill hears of the new decode worker");
    let acts = join(&mut g, P3, Role::Prefill);
    assert_eq!(to_workers(&acts), [(P3, &Message::Welcome { worker: P3 }), (P3, &peer)], "a new prefill hears of every decode worker");
    let other_model = Hello { model_digest: DIGEST + 1, ..hello(Role::Decode, 8) };
    assert_eq!(g.join(D4, &other_model).unwrap_err(), RegisterError::Model { worker: DIGEST + 1, gateway: DIGEST });
    let other_layout = Hello { page_size: 8, ..hello(Role::Decode, 8) };
    let err = g.join(D4, &other_layout).unwrap_err();
    assert_eq!(err, RegisterError::Layout { worker: KvShape { page_size: 8, kv_bytes_per_token: 16 }, registered: KvShape { page_size: 4, kv_bytes_per_token: 16 } });
    assert_eq!(g.join(D2, &hello(Role::Decode, 8)).unwrap_err(), RegisterError::Duplicate(D2));
    assert_eq!(g.workers(Role::Decode), [D2], "refused workers are not routed to");
}

#[test]
fn the_served_context_is_the_smallest_a_registered_worker_accepts_and_grows_back_when_it_leaves() {
    let mut g = gateway(&[(P1, Role::Prefill)]);
    g.join(D2, &hello(Role::Decode, 6)).unwrap();
    assert_eq!(g.max_context(), 6);
    g.join(D4, &hello(Role::Decode, 100)).unwrap();
    assert_eq!(g.max_context(), 6, "never more than the model's context nor the smallest worker's");
    g.handle(GatewayEvent::WorkerLeft { id: D2 });
    assert_eq!(g.max_context(), 8, "the model's context caps a bigger worker");
}

#[test]
fn a_prefill_that_leaves_or_loses_a_kv_connection_is_reported_unreachable_to_decode_workers() {
    let mut g = gateway(&[(P1, Role::Prefill), (D2, Role::Decode), (D4, Role::Decode)]);
    let acts = from(&mut g, P1, Message::KvLost { decode: D4 });
    assert_eq!(to_workers(&acts), [(D4, &Message::PrefillUnreachable { worker: P1 })]);
    let acts = g.handle(GatewayEvent::WorkerLeft { id: P1 });
    let unreachable = Message::PrefillUnreachable { worker: P1 };
    assert_eq!(to_workers(&acts), [(D2, &unreachable), (D4, &unreachable)]);
    assert!(to_workers(&g.handle(GatewayEvent::WorkerLeft { id: D2 })).is_empty(), "a decode worker's leaving tells no one");
}
