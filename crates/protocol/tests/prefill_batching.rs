//! Batched prefill (issue 17): one step computes the chunks of several jobs within the
//! step's token budget, oldest job first; a long prompt takes one chunk a step and does not
//! hold short ones back; a job whose pages do not fit beside the running ones waits for
//! them (and fails only when it cannot fit alone); a model error fails only the job it
//! belongs to; every job's chunks go to its own decode pages.

mod support;
use support::Recorder;

use std::collections::BTreeMap;

use bulkhead_kv::{Generation, KvChecks, KvLayout, KvPool, PageId, PageRef, PoolConfig, RequestId};
use bulkhead_protocol::driver::prefill::{Batching, Chunk, First, PrefillCompute, PrefillDriver, Step};
use bulkhead_protocol::prefill::{JobOutcome, PrefillConfig, PrefillEvent, PrefillFailure, PrefillRole};
use bulkhead_protocol::*;

const LAYOUT: KvLayout = KvLayout { layers: 1, kv_heads: 1, head_dim: 2, page_size: 4 };
const DECODE: WorkerId = WorkerId(2);
/// The request whose chunks the model refuses, alone or not.
const POISONED: RequestId = RequestId(66);

/// Writes the request's id at every position; records each pass's chunks.
#[derive(Default)]
struct Model {
    passes: Vec<Vec<(RequestId, usize, usize)>>,
}

#[derive(Debug)]
struct Refused;

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("refused")
    }
}

impl PrefillCompute for Model {
    type Error = Refused;
    fn compute(&mut self, pool: &mut KvPool, chunks: &mut [Chunk<'_>]) -> Result<Vec<Option<First>>, Refused> {
        self.passes.push(chunks.iter().map(|c| (c.seq.owner(), c.from, c.to)).collect());
        if chunks.iter().any(|c| c.seq.owner() == POISONED) {
            return Err(Refused);
        }
        let mut firsts = Vec::new();
        for c in chunks {
            let v = c.seq.owner().0 as f32;
            for pos in c.from..c.to {
                let (lease, slot) = c.seq.locate(pos).map_err(|_| Refused)?;
                pool.write(lease, 0, slot, &[v, v], &[v, v]).map_err(|_| Refused)?;
            }
            c.seq.commit(pool, c.to - c.from).map_err(|_| Refused)?;
            firsts.push((c.to == c.tokens.len()).then_some((c.seq.owner().0 as u32, None)));
        }
        Ok(firsts)
    }
}

struct Worker {
    driver: PrefillDriver,
    pool: KvPool,
    model: Model,
    link: Recorder,
    /// Decode page of each request's first page (its pages follow on).
    first_page: BTreeMap<RequestId, u32>,
}

/// A worker of `pages` pages computing `chunk` pages of a job and `step` pages in all per step.
fn worker(pages: usize, chunk: usize, step: usize) -> Worker {
    let pool = KvPool::new(PoolConfig { layout: LAYOUT, pages, checks: KvChecks::all() }).unwrap();
    let ps = LAYOUT.page_size;
    let mut role = PrefillRole::new(PrefillConfig { max_prompt: 1024, page_size: ps, keepalive_ms: 1000 });
    role.handle(PrefillEvent::DecodeConnected { decode: DECODE });
    let driver = PrefillDriver::new(role, Batching { chunk_tokens: chunk * ps, step_tokens: step * ps });
    Worker { driver, pool, model: Model::default(), link: Recorder::default(), first_page: BTreeMap::new() }
}

impl Worker {
    fn submit(&mut self, req: u64, tokens: usize) {
        let first = 100 * req as u32;
        self.first_page.insert(RequestId(req), first);
        let pages =
            (0..tokens.div_ceil(LAYOUT.page_size) as u32).map(|i| PageRef { page: PageId(first + i), generation: Generation(1) }).collect();
        let tokens = (0..tokens as u32).collect();
        let m = Message::Prefill {
            req: RequestId(req),
            tokens,
            decode: DECODE,
            held: 0,
            pages,
            sampling: Sampling::default(),
            skip_draws: 0,
            trace: TraceContext::default(),
            cache: None,
        };
        self.driver.handle(PrefillEvent::Gateway { from: GatewayId(0), msg: m }, &mut self.link);
    }

    fn step(&mut self) -> Vec<Step> {
        self.driver.step(&mut self.model, &mut self.pool, &mut self.link)
    }

    /// Steps until idle; how each job ended and after which step (counting from 1).
    fn run(&mut self) -> BTreeMap<RequestId, (JobOutcome, usize)> {
        let mut ended = BTreeMap::new();
        for n in 1..100 {
            let steps = self.step();
            if steps.is_empty() {
                break;
            }
            for s in steps {
                if let Step::Ended { req, outcome, unreleased, .. } = s {
                    assert_eq!(unreleased, None);
                    ended.insert(req, (outcome, n));
                }
            }
        }
        assert!(self.driver.is_idle(), "the driver is left with work");
        self.pool.check_invariants();
        assert_eq!(self.pool.stats().free_pages, self.pool.total_pages(), "every prefill page is back");
        ended
    }

    /// The chunks of `req` sent to the decode worker: (first decode page, slots).
    fn chunks_of(&self, req: RequestId) -> Vec<(u32, u32)> {
        self.link
            .decode
            .iter()
            .filter_map(|m| match m {
                Message::KvChunk { req: r, header, .. } if *r == req => Some((header.page.0, header.slot_count)),
                _ => None,
            })
            .collect()
    }
}

fn done(first_token: u32) -> impl Fn(&JobOutcome) -> bool {
    move |o| matches!(o, JobOutcome::Done { first_token: t, .. } if *t == first_token)
}

#[test]
fn a_long_prompt_takes_one_chunk_a_step_and_short_ones_behind_it_finish_first() {
    // Chunks of 2 pages, 5 pages a step: the long prompt (10 pages) gets 2 a step and the
    // two short ones (3 and 6 tokens) come along in the first step.
    let mut w = worker(32, 2, 5);
    w.submit(1, 40);
    w.submit(2, 3);
    w.submit(3, 6);
    let ended = w.run();
    assert!(done(2)(&ended[&RequestId(2)].0) && ended[&RequestId(2)].1 == 1, "{ended:?}");
    assert!(done(3)(&ended[&RequestId(3)].0) && ended[&RequestId(3)].1 == 1, "{ended:?}");
    assert!(done(1)(&ended[&RequestId(1)].0) && ended[&RequestId(1)].1 == 5, "{ended:?}");
    let ps = LAYOUT.page_size;
    assert_eq!(w.model.passes[0], vec![(RequestId(1), 0, 2 * ps), (RequestId(2), 0, 3), (RequestId(3), 0, 6)]);
    for pass in &w.model.passes {
        assert!(pass.iter().map(|(_, from, to)| to - from).sum::<usize>() <= 5 * ps, "over the budget: {pass:?}");
    }
}

#[test]
fn the_oldest_job_is_served_first_and_non_final_chunks_are_whole_pages() {
    // 3 pages a step, chunks of 2: the first job gets 2 pages, the second 1 (cut to a page).
    let mut w = worker(32, 2, 3);
    w.submit(1, 16);
    w.submit(2, 16);
    w.run();
    let ps = LAYOUT.page_size;
    assert_eq!(w.model.passes[0], vec![(RequestId(1), 0, 2 * ps), (RequestId(2), 0, ps)]);
    assert_eq!(w.model.passes[1], vec![(RequestId(1), 2 * ps, 4 * ps), (RequestId(2), ps, 2 * ps)]);
    for pass in &w.model.passes {
        for (_, from, to) in pass {
            assert!(from % ps == 0 && (to % ps == 0 || *to == 16), "{pass:?}");
        }
    }
}

#[test]
fn every_job_in_a_batch_sends_its_own_kv_to_its_own_decode_pages() {
    let mut w = worker(32, 2, 8);
    w.submit(1, 20);
    w.submit(2, 9);
    w.submit(3, 4);
    let ended = w.run();
    assert!(ended.values().all(|(o, _)| matches!(o, JobOutcome::Done { .. })), "{ended:?}");
    for (req, tokens) in [(RequestId(1), 20u32), (RequestId(2), 9), (RequestId(3), 4)] {
        let chunks = w.chunks_of(req);
        let first = w.first_page[&req];
        assert_eq!(chunks.iter().map(|c| c.1).sum::<u32>(), tokens, "{req}: {chunks:?}");
        assert!(chunks.iter().all(|(page, _)| (first..first + 10).contains(page)), "{req} wrote outside its pages: {chunks:?}");
    }
    // Each job's Done comes after its own last chunk.
    for req in [RequestId(1), RequestId(2), RequestId(3)] {
        let last_chunk = w.link.decode.iter().rposition(|m| matches!(m, Message::KvChunk { req: r, .. } if *r == req));
        let done_at = w.link.decode.iter().position(|m| matches!(m, Message::Done { req: r, .. } if *r == req));
        assert!(last_chunk < done_at, "{req}");
    }
}

#[test]
fn a_job_that_does_not_fit_beside_the_running_ones_waits_and_one_that_cannot_fit_alone_fails() {
    // 6 pages: the first job holds 4, the second needs 4 and waits for it; the third needs
    // 7, more than the pool, and fails once it is alone.
    let mut w = worker(6, 1, 8);
    w.submit(1, 16);
    w.submit(2, 16);
    w.submit(3, 28);
    let ended = w.run();
    let (o1, at1) = &ended[&RequestId(1)];
    let (o2, at2) = &ended[&RequestId(2)];
    assert!(done(1)(o1) && done(2)(o2), "{ended:?}");
    assert!(at2 > at1, "the second job ran only after the first: {ended:?}");
    assert!(w.model.passes.iter().all(|p| p.len() == 1), "never both at once: {:?}", w.model.passes);
    assert!(matches!(ended[&RequestId(3)].0, JobOutcome::Failed(PrefillFailure::NoPages(_))), "{ended:?}");
}

#[test]
fn a_model_error_in_a_batch_fails_only_the_job_it_belongs_to() {
    let mut w = worker(32, 2, 8);
    w.submit(1, 8);
    w.submit(POISONED.0, 8);
    w.submit(3, 8);
    let ended = w.run();
    assert!(done(1)(&ended[&RequestId(1)].0) && done(3)(&ended[&RequestId(3)].0), "{ended:?}");
    assert!(matches!(ended[&POISONED].0, JobOutcome::Failed(PrefillFailure::Compute(_))), "{ended:?}");
    // The batch, then each alone.
    assert_eq!(w.model.passes.len(), 4, "{:?}", w.model.passes);
    assert!(w.link.decode.iter().any(|m| matches!(m, Message::Fenced { req } if *req == POISONED)));
    assert!(w.link.gateway.iter().any(|m| matches!(m, Message::Failed { req, .. } if *req == POISONED)));
}

#[test]
fn an_abort_stops_one_job_of_a_batch_at_the_next_step_and_the_others_go_on() {
    let mut w = worker(32, 1, 8);
    w.submit(1, 16);
    w.submit(2, 16);
    assert_eq!(w.step().len(), 2);
    w.driver.handle(
        PrefillEvent::Gateway { from: GatewayId(0), msg: Message::Abort { req: RequestId(1), reason: AbortReason::ClientGone } },
        &mut w.link,
    );
    let ended = w.run();
    assert_eq!(ended[&RequestId(1)], (JobOutcome::Stopped, 1));
    assert!(done(2)(&ended[&RequestId(2)].0), "{ended:?}");
    assert_eq!(w.chunks_of(RequestId(1)).len(), 1, "one chunk before the abort, none after");
    assert!(w.link.decode.iter().any(|m| matches!(m, Message::Fenced { req } if *req == RequestId(1))));
}
