//! `bulkhead bench-engine`: prefill throughput for one long prompt and decode throughput at
//! several batch sizes, timed around the engine's forward pass plus greedy sampling.
//! Medians of repeated runs; figures only, no judgement (BENCHMARKS.md compares).

use std::time::Instant;

use bulkhead_kv::{KvPool, PoolConfig, RequestId, SequenceKv};
use bulkhead_model::{Llama, SeqInput};
use clap::Args;

use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt length for the prefill figure.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Context already in each sequence before decode is timed.
    #[arg(long, default_value_t = 128)]
    decode_context: usize,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 64)]
    decode_steps: usize,
    /// Batch sizes for decode.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    batches: Vec<usize>,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn argmax(l: &[f32]) -> u32 {
    let mut b = 0;
    for (i, &x) in l.iter().enumerate() {
        if x > l[b] {
            b = i;
        }
    }
    b as u32
}

/// Deterministic token ids that avoid special tokens, standing in for a prompt.
fn tokens(n: usize, salt: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| (100 + (i * 7919 + salt * 104_729) % (vocab - 200)) as u32).collect()
}

fn prefill_tps(m: &Llama, pool: &mut KvPool, n: usize) -> anyhow::Result<f64> {
    let prompt = tokens(n, 0, m.config.vocab);
    let mut kv = SequenceKv::new(RequestId(1));
    kv.reserve(pool, n)?;
    let t = Instant::now();
    m.forward(pool, &mut [SeqInput { kv: &mut kv, tokens: &prompt, want_logits: true }])?;
    let s = t.elapsed().as_secs_f64();
    kv.release(pool)?;
    Ok(n as f64 / s)
}

fn decode_tps(m: &Llama, pool: &mut KvPool, batch: usize, ctx: usize, steps: usize) -> anyhow::Result<f64> {
    let vocab = m.config.vocab;
    let mut seqs: Vec<SequenceKv> = (0..batch).map(|i| SequenceKv::new(RequestId(i as u64 + 10))).collect();
    for s in &mut seqs {
        s.reserve(pool, ctx + steps)?;
    }
    let prompts: Vec<Vec<u32>> = (0..batch).map(|i| tokens(ctx, i + 1, vocab)).collect();
    let logits = {
        let mut inputs: Vec<SeqInput> =
            seqs.iter_mut().zip(&prompts).map(|(kv, p)| SeqInput { kv, tokens: p, want_logits: true }).collect();
        m.forward(pool, &mut inputs)?
    };
    let mut next: Vec<[u32; 1]> = logits.chunks_exact(vocab).map(|l| [argmax(l)]).collect();
    let t = Instant::now();
    for _ in 0..steps {
        let logits = {
            let mut inputs: Vec<SeqInput> =
                seqs.iter_mut().zip(&next).map(|(kv, tok)| SeqInput { kv, tokens: tok, want_logits: true }).collect();
            m.forward(pool, &mut inputs)?
        };
        next = logits.chunks_exact(vocab).map(|l| [argmax(l)]).collect();
    }
    let s = t.elapsed().as_secs_f64();
    for kv in seqs {
        kv.release(pool)?;
    }
    Ok((batch * steps) as f64 / s)
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    let m = a.model.load()?.model;
    let layout = m.kv_layout(a.model.page_size as usize);
    let max_batch = a.batches.iter().copied().max().unwrap_or(1);
    let per_seq = layout.pages_for_tokens(a.decode_context + a.decode_steps);
    let pages = (per_seq * max_batch).max(layout.pages_for_tokens(a.prompt_tokens));
    let mut pool = KvPool::new(PoolConfig { layout, pages, poison_on_release: true })?;
    let reps = a.reps.max(1);
    // One untimed warm-up pass brings weights into cache and threads up.
    prefill_tps(&m, &mut pool, a.prompt_tokens.min(64))?;
    let prefill = median((0..reps).map(|_| prefill_tps(&m, &mut pool, a.prompt_tokens)).collect::<Result<_, _>>()?);
    let mut decode = Vec::new();
    for &b in &a.batches {
        let v = median((0..reps).map(|_| decode_tps(&m, &mut pool, b, a.decode_context, a.decode_steps)).collect::<Result<_, _>>()?);
        decode.push((b, v));
    }
    if a.json {
        let j = serde_json::json!({
            "isa": m.isa().name(),
            "threads": m.threads(),
            "prompt_tokens": a.prompt_tokens,
            "prefill_tok_s": prefill,
            "decode_context": a.decode_context,
            "decode_steps": a.decode_steps,
            "decode_tok_s": decode.iter().map(|(b, v)| serde_json::json!({"batch": b, "tok_s": v})).collect::<Vec<_>>(),
        });
        println!("{j}");
    } else {
        println!("bulkhead bench-engine: {} threads, kernels {}", m.threads(), m.isa().name());
        println!("prefill {:>5} tokens          {prefill:8.1} tok/s", a.prompt_tokens);
        for (b, v) in decode {
            println!("decode  batch {b:>3} (ctx {:>4})   {v:8.1} tok/s aggregate", a.decode_context);
        }
    }
    Ok(())
}
