//! The prefill driver with a prefix cache (design I7): a hit computes only the rest and
//! still sends every prompt page; another tenant never hits; a cache under pressure serves
//! what a cold pool serves; an abort during a hit gives every shared lease back.

mod support;
use support::Recorder;

use bulkhead_kv::{Generation, KvChecks, KvError, KvLayout, KvPool, PageId, PageRef, PoolConfig, PrefixCache, RequestId};
use bulkhead_protocol::cache::{CacheScope, CacheSecret};
use bulkhead_protocol::driver::prefill::{Batching, Chunk, First, PrefillCompute, PrefillDriver, Step};
use bulkhead_protocol::prefill::{JobOutcome, PrefillConfig, PrefillEvent, PrefillRole};
use bulkhead_protocol::*;

const LAYOUT: KvLayout = KvLayout { layers: 2, kv_heads: 1, head_dim: 2, page_size: 4 };
const DECODE: WorkerId = WorkerId(2);
const DIGEST: u64 = 7;

/// A model whose KV at a position is a function of the prompt up to it (as a real model's
/// is), so a cached page is exactly what the same prefix would compute.
struct PrefixModel {
    computed: usize,
}

fn kv_of(tokens: &[u32], pos: usize) -> f32 {
    (tokens[..=pos].iter().fold(17u32, |h, t| h.wrapping_mul(31).wrapping_add(*t)) % 2000) as f32
}

impl PrefillCompute for PrefixModel {
    type Error = KvError;
    fn compute(&mut self, pool: &mut KvPool, chunks: &mut [Chunk<'_>]) -> Result<Vec<Option<First>>, KvError> {
        let mut firsts = Vec::new();
        for c in chunks {
            for pos in c.from..c.to {
                let (lease, slot) = c.seq.locate(pos)?;
                let v = kv_of(c.tokens, pos);
                for layer in 0..LAYOUT.layers {
                    pool.write(lease, layer, slot, &[v, v], &[v, v])?;
                }
            }
            c.seq.commit(pool, c.to - c.from)?;
            self.computed += c.to - c.from;
            firsts.push((c.to == c.tokens.len()).then_some((1, None)));
        }
        Ok(firsts)
    }
}

struct Worker {
    driver: PrefillDriver,
    pool: KvPool,
    model: PrefixModel,
    link: Recorder,
}

fn worker(pages: usize) -> Worker {
    worker_batching(pages, Batching::one_chunk(4))
}

fn worker_batching(pages: usize, batching: Batching) -> Worker {
    let pool = KvPool::new(PoolConfig { layout: LAYOUT, pages, checks: KvChecks::all() }).unwrap();
    let mut role = PrefillRole::new(PrefillConfig { max_prompt: pages * 4, page_size: 4, keepalive_ms: 1000 });
    role.handle(PrefillEvent::DecodeConnected { decode: DECODE });
    let driver = PrefillDriver::new(role, batching).with_cache(PrefixCache::new(pages), DIGEST);
    Worker { driver, pool, model: PrefixModel { computed: 0 }, link: Recorder::default() }
}

fn scope(tenant: &str) -> CacheScope {
    CacheSecret::from_random([3; 32]).scope(tenant, None)
}

impl Worker {
    fn submit(&mut self, req: u64, tokens: &[u32], cache: Option<CacheScope>) {
        let pages = (0..tokens.len().div_ceil(4)).map(|i| PageRef { page: PageId(i as u32), generation: Generation(1) }).collect();
        let m = Message::Prefill {
            req: RequestId(req),
            tokens: tokens.to_vec(),
            decode: DECODE,
            held: 0,
            pages,
            sampling: Sampling::default(),
            skip_draws: 0,
            trace: TraceContext::default(),
            cache,
        };
        self.driver.handle(PrefillEvent::Gateway { from: GatewayId(0), msg: m }, &mut self.link);
    }

    /// One step; these tests run one job at a time.
    fn step(&mut self) -> Step {
        let mut steps = self.driver.step(&mut self.model, &mut self.pool, &mut self.link);
        assert_eq!(steps.len(), 1, "one job per step: {steps:?}");
        steps.remove(0)
    }

    /// Runs the submitted job to its end; its outcome and the KV values it sent, in
    /// position order.
    fn run(&mut self, req: u64, tokens: &[u32], cache: Option<CacheScope>) -> (JobOutcome, Vec<f32>) {
        self.submit(req, tokens, cache);
        self.link.decode.clear();
        loop {
            if let Step::Ended { outcome, unreleased, .. } = self.step() {
                assert_eq!(unreleased, None);
                self.pool.check_invariants();
                assert_eq!(self.pool.stats().shared_leases, 0, "every shared lease is given back");
                let empty = self
                    .link
                    .gateway
                    .iter()
                    .any(|m| matches!(m, Message::CacheReport { stored, evicted } if stored.is_empty() && evicted.is_empty()));
                assert!(!empty, "no empty cache report");
                return (outcome, self.sent_values());
            }
        }
    }

    fn sent_values(&self) -> Vec<f32> {
        let mut out = Vec::new();
        for m in &self.link.decode {
            if let Message::KvChunk { header, data, .. } = m {
                // Layer 0's K of head 0 comes first: slot_count slots of head_dim 2 f16s.
                for s in 0..header.slot_count as usize {
                    let b = &data[s * 4..s * 4 + 2];
                    out.push(half::f16::from_le_bytes([b[0], b[1]]).to_f32());
                }
            }
        }
        out
    }
}

fn cached(o: &JobOutcome) -> u32 {
    match o {
        JobOutcome::Done { cached, .. } => *cached,
        other => panic!("not done: {other:?}"),
    }
}

#[test]
fn a_hit_computes_only_the_rest_and_sends_the_same_kv_for_every_prompt_position() {
    let mut w = worker(8);
    let prompt: Vec<u32> = (100..109).collect(); // 9 tokens: two full pages and one slot
    let (first, cold) = w.run(1, &prompt, Some(scope("a")));
    assert_eq!((cached(&first), w.model.computed), (0, 9));
    let stored = w.link.gateway.iter().find_map(|m| if let Message::CacheReport { stored, .. } = m { Some(stored.len()) } else { None });
    assert_eq!(stored, Some(2), "both full pages reported to the gateway, the partial one never shared");

    let (second, warm) = w.run(2, &prompt, Some(scope("a")));
    assert_eq!(cached(&second), 8);
    assert_eq!(w.model.computed, 9 + 1, "only the last position was computed");
    assert_eq!(warm, cold, "every prompt position is sent, cached ones with the same KV");
    assert_eq!(warm.len(), 9);

    // Another tenant, the same tokens: no hit. No scope at all: no hit, nothing stored.
    let (other, _) = w.run(3, &prompt, Some(scope("b")));
    assert_eq!(cached(&other), 0);
    let (none, _) = w.run(4, &prompt, None);
    assert_eq!(cached(&none), 0);
    assert_eq!(w.pool.stats().fence_failures, 0);
    // A prompt that is exactly cached pages: its last page is computed anyway.
    let (exact, _) = w.run(5, &prompt[..8], Some(scope("a")));
    assert_eq!(cached(&exact), 4);
}

#[test]
fn a_cache_under_pressure_serves_what_a_cold_pool_serves_and_refuses_what_it_refuses() {
    let mut w = worker(4); // 16 tokens
    let half: Vec<u32> = (0..8).collect();
    w.run(1, &[half.clone(), vec![50]].concat(), Some(scope("a")));
    assert_eq!(w.pool.stats().cached_pages, 2);
    // Half cached, the whole pool asked for: served, reusing the half.
    let full: Vec<u32> = [half.clone(), (8..16).collect()].concat();
    let (o, _) = w.run(2, &full, Some(scope("a")));
    assert_eq!(cached(&o), 8);
    // A cold prompt the size of the pool, under another tenant: the cache gives way.
    let other: Vec<u32> = (500..516).collect();
    let (o, _) = w.run(3, &other, Some(scope("b")));
    assert_eq!(cached(&o), 0);
    assert!(w.driver.cache().unwrap().stats().evicted_pages > 0);
    // One token more than the pool: refused at admission, as without a cache.
    w.submit(4, &(0..17).collect::<Vec<u32>>(), Some(scope("a")));
    assert!(w.link.gateway.iter().any(|m| matches!(m, Message::Rejected { req: RequestId(4), reason: RejectReason::ContextLength, .. })));
    w.pool.check_invariants();
}

#[test]
fn an_abort_during_a_hit_gives_every_shared_lease_back_and_leaves_the_cache_whole() {
    let mut w = worker(8);
    let prompt: Vec<u32> = (0..13).collect();
    w.run(1, &prompt, Some(scope("a")));
    // Shares the first two pages, then computes two chunks of its own.
    let longer: Vec<u32> = [&prompt[..8], &[90, 91, 92, 93, 94, 95, 96, 97][..]].concat();
    w.submit(2, &longer, Some(scope("a")));
    assert!(matches!(w.step(), Step::Computed { from: 8, to: 12, .. }));
    assert!(w.pool.stats().shared_leases > 0, "the hit holds its cached pages");
    w.driver.handle(
        PrefillEvent::Gateway { from: GatewayId(0), msg: Message::Abort { req: RequestId(2), reason: AbortReason::ClientGone } },
        &mut w.link,
    );
    assert!(matches!(w.step(), Step::Ended { outcome: JobOutcome::Stopped, .. }));
    let s = w.pool.stats();
    assert_eq!((s.shared_leases, s.cached_pages, s.leased_pages), (0, 3, 0));
    w.pool.check_invariants();
    // Still there for the next request of the tenant.
    let (o, _) = w.run(3, &prompt, Some(scope("a")));
    assert_eq!(cached(&o), 12);
}

/// Batched prefill with a cache: a job that starts with the same full page as a running job
/// of its scope waits for it and shares its pages (the siblings of `n > 1`), instead of
/// computing the same prefix beside it; another scope's equal prompt is not held back and
/// shares nothing. With the deferral removed the second job computes its whole prompt.
#[test]
fn a_job_whose_prefix_a_running_job_computes_waits_for_it_and_shares_its_pages() {
    let mut w = worker_batching(32, Batching { chunk_tokens: 4, step_tokens: 32 });
    let prompt: Vec<u32> = (0..13).collect();
    w.submit(1, &prompt, Some(scope("a")));
    w.submit(2, &prompt, Some(scope("a")));
    w.submit(3, &prompt, Some(scope("b")));
    let mut ended = std::collections::BTreeMap::new();
    let mut first_step_jobs = None;
    for _ in 0..20 {
        let steps = w.driver.step(&mut w.model, &mut w.pool, &mut w.link);
        first_step_jobs.get_or_insert(steps.len());
        for s in steps {
            if let Step::Ended { req, outcome, unreleased, .. } = s {
                assert_eq!(unreleased, None);
                ended.insert(req, outcome);
            }
        }
    }
    assert_eq!(first_step_jobs, Some(2), "requests 1 and 3 run together, 2 waits");
    assert_eq!(cached(&ended[&RequestId(1)]), 0);
    assert_eq!(cached(&ended[&RequestId(2)]), 12, "{ended:?}");
    assert_eq!(cached(&ended[&RequestId(3)]), 0, "another scope shares nothing");
    // 13 + 1 + 13 positions computed: the waiting job only its last one.
    assert_eq!(w.model.computed, 27);
    w.pool.check_invariants();
}

/// Conversations of one system prompt: once the shared prefix is cached, their next turns
/// differ only past it, so none waits for another (the first page each misses is its own);
/// each computes only its own part. Under the old rule (same first page: wait) they ran one
/// at a time.
#[test]
fn jobs_that_share_only_cached_pages_run_side_by_side() {
    let mut w = worker_batching(64, Batching { chunk_tokens: 4, step_tokens: 32 });
    let system: Vec<u32> = (0..8).collect();
    w.submit(1, &[&system[..], &[100]].concat(), Some(scope("a")));
    for _ in 0..10 {
        w.driver.step(&mut w.model, &mut w.pool, &mut w.link);
    }
    // Two conversations' next turns: the system prompt's two pages are cached.
    w.submit(2, &[&system[..], &[200, 201, 202, 203, 204]].concat(), Some(scope("a")));
    w.submit(3, &[&system[..], &[300, 301, 302, 303, 304]].concat(), Some(scope("a")));
    let steps = w.driver.step(&mut w.model, &mut w.pool, &mut w.link);
    let running: Vec<RequestId> = steps
        .iter()
        .map(|s| match s {
            Step::Computed { req, .. } | Step::Ended { req, .. } => *req,
        })
        .collect();
    assert_eq!(running, [RequestId(2), RequestId(3)], "both turns run in the first step: {steps:?}");
    w.pool.check_invariants();
}
