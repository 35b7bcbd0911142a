//! The decode step allocates nothing once warm (issue 17): a counting global allocator sees
//! every allocation of every thread, the model's compute threads included, while a batch of
//! sequences takes decode steps through `Llama::forward_into`.
//!
//! Rayon's scheduler is the one exception: its work-stealing deques resize now and then,
//! and crossbeam's epoch collector then allocates a 2 KB garbage bag (seen once in 24
//! steps on a loaded machine, never on a quiet one). So the bound is "less than one
//! allocation per eight steps", which any allocation of the step's own fails.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bulkhead_gguf::{GgmlType, GgufFile};
use bulkhead_kv::{KvChecks, KvPool, PoolConfig, RequestId, SequenceKv};
use bulkhead_model::{Isa, Llama, SeqInput};

mod support;
use support::Shape;

/// Counts allocations (and reallocations) while `COUNTING` is set.
struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is passed straight to the system allocator; counting touches only
// atomics, never the heap.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout (every allocation goes there).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: the caller's contract for `realloc`, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const SHAPE: Shape = Shape { vocab: 50, hidden: 64, ffn: 96, heads: 4, kv_heads: 2, layers: 2 };
const BATCH: usize = 4;
const STEPS: usize = 24;
/// Allocations of rayon's own the bound allows (see the top of the file).
const SCHEDULER_ALLOWANCE: u64 = STEPS as u64 / 8;

/// Allocations made by `STEPS` decode steps of a batch of `BATCH` sequences, after as many
/// warm-up steps, on `isa` with `threads` compute threads.
fn allocations_per_steady_run(isa: Isa, threads: usize, checks: KvChecks) -> u64 {
    let w = support::model(GgmlType::Q8_0, "llama", SHAPE, None);
    let m = Llama::from_gguf(&GgufFile::parse(w.to_bytes()).expect("parse"), threads).expect("load").with_isa(isa);
    let page = 8;
    let tokens = 8 + 2 * STEPS + 1;
    let pages = BATCH * tokens.div_ceil(page);
    let mut pool = KvPool::new(PoolConfig { layout: m.kv_layout(page), pages, checks }).expect("pool");
    // As the engine does at start: no thread's attention buffers grow with the contexts.
    m.reserve_attention(tokens, page);
    let mut seqs: Vec<SequenceKv> = (0..BATCH as u64).map(|i| SequenceKv::new(RequestId(i))).collect();
    let mut logits = Vec::new();
    for (i, s) in seqs.iter_mut().enumerate() {
        s.reserve(&mut pool, tokens).expect("reserve");
        let prompt: Vec<u32> = (0..8).map(|t| ((t * 3 + i) % SHAPE.vocab) as u32).collect();
        m.forward_into(&mut pool, &mut [SeqInput { kv: s, tokens: &prompt, logit_rows: 1 }], &mut logits).expect("prefill");
    }
    let next: Vec<u32> = (0..BATCH as u32).collect();
    let run = |steps: usize, pool: &mut KvPool, seqs: &mut [SequenceKv], logits: &mut Vec<f32>| {
        for _ in 0..steps {
            // On the stack: the test's own step must not allocate either.
            let mut each = seqs.iter_mut();
            let mut inputs: [SeqInput<'_>; BATCH] = std::array::from_fn(|i| SeqInput {
                kv: each.next().expect("a sequence per input"),
                tokens: &next[i..i + 1],
                logit_rows: 1,
            });
            m.forward_into(pool, &mut inputs, logits).expect("step");
        }
    };
    run(STEPS, &mut pool, &mut seqs, &mut logits);
    let n = counted(|| run(STEPS, &mut pool, &mut seqs, &mut logits));
    assert_eq!(logits.len(), BATCH * SHAPE.vocab);
    n
}

/// Allocations `f` makes.
fn counted(f: impl FnOnce()) -> u64 {
    ALLOCATIONS.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::Relaxed);
    f();
    COUNTING.store(false, Ordering::Relaxed);
    ALLOCATIONS.load(Ordering::Relaxed)
}

#[test]
fn a_warm_decode_step_allocates_nothing() {
    // The counter sees an allocation (so a zero below means none, not a blind counter).
    assert_eq!(counted(|| drop(std::hint::black_box(vec![1u8; 3]))), 1);
    for isa in Isa::available() {
        for threads in [1, 2] {
            // Production's read checks, and every check with the auditor (as the tests run).
            for checks in [KvChecks::default(), KvChecks::all()] {
                let n = allocations_per_steady_run(isa, threads, checks);
                assert!(n <= SCHEDULER_ALLOWANCE, "{isa:?}, {threads} threads, {checks:?}: {STEPS} warm decode steps allocated {n} times");
            }
        }
    }
}
