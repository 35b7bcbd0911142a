//! The gateway role alone: admission at the served context, routing around departed
//! workers, which worker may speak for a request, and aborts reaching every other worker
//! (I3, I5). Each test kills mutants `cargo mutants` found surviving the cluster tests
//! (docs/TESTING.md).

use bulkhead_kv::{Generation, PageId, PageRef, RequestId};
use bulkhead_protocol::gateway::{ClientOutput, GatewayAction, GatewayConfig, GatewayEvent, GatewayRole, GatewayStats};
use bulkhead_protocol::*;

const P1: WorkerId = WorkerId(1);
const D2: WorkerId = WorkerId(2);
const P3: WorkerId = WorkerId(3);
const D4: WorkerId = WorkerId(4);
const TIMEOUT_MS: u64 = 100;

fn gateway(workers: &[(WorkerId, Role)]) -> GatewayRole {
    let mut g = GatewayRole::new(GatewayConfig { max_context: 0, admission_check: true, request_timeout_ms: TIMEOUT_MS });
    g.set_max_context(8);
    for &(id, role) in workers {
        g.handle(GatewayEvent::WorkerJoined { id, role });
    }
    g
}

fn submit(g: &mut GatewayRole, req: u64, prompt: usize, max_tokens: u32) -> Vec<GatewayAction> {
    let sampling = Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, seed: None, ignore_eos: false };
    let ev = GatewayEvent::Submit { req: RequestId(req), tokens: vec![5; prompt], max_tokens, sampling, stop: vec![], trace: TraceContext::default() };
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
    g.handle(GatewayEvent::WorkerJoined { id: D2, role: Role::Decode });
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
    let finished = Message::Finished { req: RequestId(1), finish: Finish::Stop, text: String::new(), prompt_tokens: 4, completion_tokens: 1 };
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
