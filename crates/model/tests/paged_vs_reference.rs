//! The paged, batched forward pass against the plain contiguous reference, on the real
//! default model: logits within tolerance and identical greedy continuations.

use bulkhead_kv::{KvChecks, KvPool, PoolConfig, RequestId, SequenceKv};
use bulkhead_model::reference::ReferenceState;
use bulkhead_model::{Llama, SeqInput};

/// Largest allowed |paged - reference| on any logit: none. The two share arithmetic and differ
/// in data structures only (see `bulkhead_model::reference`), so a correct paged pass is
/// bit-identical; a wrong slot, page or generation is not.
const LOGIT_TOL: f32 = 0.0;
const EOS: u32 = 2;
const GEN: usize = 32;

fn model() -> Llama {
    let path = bulkhead_fetch::ensure_default_model(false).expect("default model");
    Llama::load(path, 2).expect("load model")
}

fn prompts() -> Vec<Vec<u32>> {
    let v: serde_json::Value = serde_json::from_str(include_str!("fixtures/greedy_cases.json")).unwrap();
    let mut p: Vec<Vec<u32>> = v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["prompt_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect())
        .collect();
    // A prompt spanning many pages and not a multiple of the page size: several cases glued.
    let long: Vec<u32> = p.iter().take(6).flatten().copied().collect();
    assert!(long.len() > 150 && !long.len().is_multiple_of(16));
    p.push(long);
    p
}

fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best as u32
}

fn reference_run(m: &Llama, prompt: &[u32]) -> (Vec<f32>, Vec<u32>) {
    let mut st = ReferenceState::default();
    let mut logits = Vec::new();
    for &t in prompt {
        logits = m.reference_step(&mut st, t);
    }
    let first = logits.clone();
    let mut out = Vec::new();
    for _ in 0..GEN {
        let t = argmax(&logits);
        out.push(t);
        if t == EOS {
            break;
        }
        logits = m.reference_step(&mut st, t);
    }
    (first, out)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// All prompts prefilled together in one call (prefill chunks of different lengths side by
/// side), then decoded together step by step, each sequence leaving when it ends.
#[test]
fn batched_paged_forward_matches_the_contiguous_reference() {
    let m = model();
    let prompts = prompts();
    let mut pool = KvPool::new(PoolConfig { layout: m.kv_layout(16), pages: 256, checks: KvChecks::all() }).unwrap();
    let mut seqs: Vec<SequenceKv> = (0..prompts.len()).map(|i| SequenceKv::new(RequestId(i as u64))).collect();
    for (s, p) in seqs.iter_mut().zip(&prompts) {
        s.reserve(&mut pool, p.len() + GEN).unwrap();
    }
    let logits = {
        let mut inputs: Vec<SeqInput> = seqs.iter_mut().zip(&prompts).map(|(kv, p)| SeqInput { kv, tokens: p, logit_rows: 1 }).collect();
        m.forward(&mut pool, &mut inputs).unwrap()
    };
    let vocab = m.config.vocab;
    let mut outs: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut cur: Vec<Vec<f32>> = logits.chunks(vocab).map(<[f32]>::to_vec).collect();
    let first = cur.clone();
    let mut live: Vec<bool> = vec![true; prompts.len()];
    for _ in 0..GEN {
        let mut next = Vec::new();
        for i in 0..prompts.len() {
            if live[i] {
                let t = argmax(&cur[i]);
                outs[i].push(t);
                if t == EOS || outs[i].len() == GEN {
                    live[i] = false;
                } else {
                    next.push((i, [t]));
                }
            }
        }
        if next.is_empty() {
            break;
        }
        let mut idx = Vec::new();
        let mut inputs = Vec::new();
        for (kv, i) in seqs.iter_mut().enumerate().filter(|(i, _)| next.iter().any(|(j, _)| j == i)).map(|(i, kv)| (kv, i)) {
            let tok = &next.iter().find(|(j, _)| *j == i).unwrap().1;
            inputs.push(SeqInput { kv, tokens: tok, logit_rows: 1 });
            idx.push(i);
        }
        let l = m.forward(&mut pool, &mut inputs).unwrap();
        for (k, &i) in idx.iter().enumerate() {
            cur[i] = l[k * vocab..(k + 1) * vocab].to_vec();
        }
    }
    for (i, p) in prompts.iter().enumerate() {
        let (rl, rout) = reference_run(&m, p);
        let d = max_diff(&rl, &first[i]);
        assert!(d <= LOGIT_TOL, "prompt {i} ({} tokens): max logit difference {d}", p.len());
        assert_eq!(outs[i], rout, "prompt {i}: greedy continuation differs from the reference");
    }
    for s in seqs {
        s.release(&mut pool).unwrap();
    }
    assert_eq!(pool.stats().free_pages, 256);
}

/// Prefill split into uneven chunks, interleaved with another sequence's decode steps, gives
/// the same logits as one whole prefill (bit for bit: rows are independent).
#[test]
fn chunked_prefill_interleaved_with_decode_equals_whole_prefill() {
    let m = model();
    let prompts = prompts();
    let long = prompts.last().unwrap();
    let short = &prompts[0];
    let mut pool = KvPool::new(PoolConfig { layout: m.kv_layout(16), pages: 64, checks: KvChecks::all() }).unwrap();

    let mut whole = SequenceKv::new(RequestId(1));
    whole.reserve(&mut pool, long.len()).unwrap();
    let want = m.forward(&mut pool, &mut [SeqInput { kv: &mut whole, tokens: long, logit_rows: 1 }]).unwrap();
    whole.release(&mut pool).unwrap();

    let mut a = SequenceKv::new(RequestId(2));
    let mut b = SequenceKv::new(RequestId(3));
    a.reserve(&mut pool, long.len()).unwrap();
    b.reserve(&mut pool, short.len() + 8).unwrap();
    m.forward(&mut pool, &mut [SeqInput { kv: &mut b, tokens: short, logit_rows: 1 }]).unwrap();
    let mut got = Vec::new();
    let mut off = 0;
    for (step, chunk) in [37usize, 16, 1, 50, 500].into_iter().enumerate() {
        let end = (off + chunk).min(long.len());
        let dec = [short[step]];
        got = m
            .forward(
                &mut pool,
                &mut [
                    SeqInput { kv: &mut b, tokens: &dec, logit_rows: 1 },
                    SeqInput { kv: &mut a, tokens: &long[off..end], logit_rows: usize::from(end == long.len()) },
                ],
            )
            .unwrap();
        off = end;
        if off == long.len() {
            break;
        }
    }
    let vocab = m.config.vocab;
    assert_eq!(got.len(), 2 * vocab);
    let d = max_diff(&got[vocab..], &want);
    assert_eq!(d, 0.0, "chunked prefill differs from whole prefill by {d}");
    a.release(&mut pool).unwrap();
    b.release(&mut pool).unwrap();
}
