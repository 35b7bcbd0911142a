//! A prefill worker that can no longer reach a decode worker (it left the cluster, or its KV
//! connection was lost and it does not reconnect: `PrefillUnreachable` from the gateway)
//! fences that decode worker's quarantines only if it never opened a KV connection there
//! (found by the fault schedules: such pages stayed quarantined for ever). One that did
//! connect is fenced by that connection closing.

use bulkhead_kv::{KvChecks, KvLayout, KvPool, PoolConfig, RequestId};
use bulkhead_protocol::decode::{DecodeConfig, DecodeEvent, DecodeRole};
use bulkhead_protocol::*;

const PREFILL: WorkerId = WorkerId(1);
const LAYOUT: KvLayout = KvLayout { layers: 2, kv_heads: 1, head_dim: 2, page_size: 4 };

/// A decode role whose request 1 (named for `PREFILL`) was reserved, then aborted: its
/// pages are quarantined until that prefill is fenced.
fn aborted_reservation(connected: bool) -> (DecodeRole, KvPool) {
    let mut pool = KvPool::new(PoolConfig { layout: LAYOUT, pages: 8, checks: KvChecks::all() }).expect("pool");
    let mut dec = DecodeRole::new(DecodeConfig { max_context: 32, transfer_timeout_ms: 1_000, local_prefill_tokens: 0 });
    if connected {
        dec.handle(&mut pool, DecodeEvent::PrefillConnected { from: PREFILL });
    }
    let sampling = Sampling::default();
    let reserve = Message::Reserve {
        req: RequestId(1),
        prompt_tokens: 6,
        max_tokens: 2,
        prefill: PREFILL,
        sampling,
        stop: vec![],
        resume: vec![],
        prompt: vec![],
        trace: TraceContext::default(),
        cache: None,
    };
    dec.handle(&mut pool, DecodeEvent::Gateway { from: GatewayId(0), msg: reserve });
    dec.handle(
        &mut pool,
        DecodeEvent::Gateway { from: GatewayId(0), msg: Message::Abort { req: RequestId(1), reason: AbortReason::ClientGone } },
    );
    assert_eq!(pool.stats().quarantined_pages, 2, "the aborted reservation waits for its writer's fence");
    (dec, pool)
}

#[test]
fn a_prefill_that_left_without_connecting_fences_its_reservations() {
    let (mut dec, mut pool) = aborted_reservation(false);
    dec.handle(&mut pool, DecodeEvent::Gateway { from: GatewayId(0), msg: Message::PrefillUnreachable { worker: PREFILL } });
    let s = pool.stats();
    assert_eq!((s.quarantined_pages, s.free_pages), (0, s.total_pages), "{s:?}");
    assert!(!dec.known(RequestId(1)));
}

#[test]
fn a_prefill_that_connected_is_fenced_by_its_connection_not_by_leaving() {
    let (mut dec, mut pool) = aborted_reservation(true);
    dec.handle(&mut pool, DecodeEvent::Gateway { from: GatewayId(0), msg: Message::PrefillUnreachable { worker: PREFILL } });
    assert_eq!(pool.stats().quarantined_pages, 2, "chunks may still be in flight on its connection");
    dec.handle(&mut pool, DecodeEvent::PrefillClosed { from: PREFILL });
    let s = pool.stats();
    assert_eq!((s.quarantined_pages, s.free_pages), (0, s.total_pages), "{s:?}");
}
