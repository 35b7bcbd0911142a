//! `bulkhead bench-engine`: prefill throughput for one long prompt and decode throughput at
//! several batch sizes, timed around the engine's forward pass plus greedy sampling.
//! Medians of repeated runs; figures only, no judgement (BENCHMARKS.md compares).

use std::time::Instant;

use bulkhead_kv::{KvChecks, KvPool, PoolConfig, RequestId, SequenceKv};
use bulkhead_model::kernels::int8_dot_chains;
use bulkhead_model::{Isa, IsaLevel, Llama, SeqInput, Sums};
use clap::Args;

use crate::ModelArgs;

mod spec;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt length for the prefill figure.
    #[arg(long, env = "BULKHEAD_BENCH_PROMPT_TOKENS", default_value_t = 512)]
    prompt_tokens: usize,
    /// Context already in each sequence before decode is timed.
    #[arg(long, env = "BULKHEAD_BENCH_DECODE_CONTEXT", default_value_t = 128)]
    decode_context: usize,
    /// Decode steps timed per batch size.
    #[arg(long, env = "BULKHEAD_BENCH_DECODE_STEPS", default_value_t = 64)]
    decode_steps: usize,
    /// Batch sizes for decode.
    #[arg(long, env = "BULKHEAD_BENCH_BATCHES", value_delimiter = ',', default_value = "1,4,16")]
    batches: Vec<usize>,
    /// Repetitions (the median is reported).
    #[arg(long, env = "BULKHEAD_BENCH_REPS", default_value_t = 3)]
    reps: usize,
    /// Print JSON instead of text.
    #[arg(long, env = "BULKHEAD_BENCH_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    json: bool,
    /// Instead of the usual figures, measure what the optional KV checks cost: decode with
    /// production checks (canaries) and with the auditor, each against a pool with every
    /// optional check off, in alternating repetitions; prints the throughput ratios.
    #[arg(long, env = "BULKHEAD_BENCH_COMPARE_CHECKS", value_parser = clap::builder::BoolishValueParser::new())]
    compare_checks: bool,
    /// Instead of the usual figures, measure the AVX-512 VNNI kernels against the AVX2 ones
    /// (the same model loaded twice, one per layout), prefill and decode in alternating
    /// repetitions; prints the throughput ratios. Needs a CPU with AVX-512 VNNI.
    #[arg(long, env = "BULKHEAD_BENCH_COMPARE_KERNELS", value_parser = clap::builder::BoolishValueParser::new())]
    compare_kernels: bool,
    /// Instead of the usual figures, measure the kernels with block sums against the same
    /// kernels with lane sums (`--kernel-sums`; the model loaded twice), prefill and decode in
    /// alternating repetitions; prints the throughput ratios.
    #[arg(long, env = "BULKHEAD_BENCH_COMPARE_SUMS", value_parser = clap::builder::BoolishValueParser::new(), conflicts_with = "compare_kernels")]
    compare_sums: bool,
    /// Instead of the usual figures, measure speculative decoding (n-gram, up to
    /// `--speculative-tokens` drafts): output tokens per second with it against without, per
    /// task (copying, code editing, quoting, free chat) at each of `--batches`, in alternating
    /// repetitions; fails if the two sides' texts differ.
    #[arg(long, env = "BULKHEAD_BENCH_COMPARE_SPECULATION", value_parser = clap::builder::BoolishValueParser::new())]
    compare_speculation: bool,
    /// Most drafts per sequence and step for `--compare-speculation`.
    #[arg(long, env = "BULKHEAD_BENCH_SPECULATIVE_TOKENS", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=16))]
    speculative_tokens: u32,
    /// Instead of the usual figures, measure constrained decoding: the engine's decode loop
    /// with every sequence under a ten-field JSON schema against none (at the largest batch
    /// size), and time to first token with and without it, in alternating repetitions.
    #[arg(long, env = "BULKHEAD_BENCH_COMPARE_GRAMMAR", value_parser = clap::builder::BoolishValueParser::new())]
    compare_grammar: bool,
}

/// Runs `a` and `b` alternately `reps` times, so that drift on a noisy machine hits both
/// sides: the medians of each and the median of the per-pair ratios a / b.
pub(crate) fn alternate(
    reps: usize,
    mut a: impl FnMut() -> anyhow::Result<f64>,
    mut b: impl FnMut() -> anyhow::Result<f64>,
) -> anyhow::Result<(f64, f64, f64)> {
    let (mut av, mut bv, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps.max(1) {
        let (x, y) = (a()?, b()?);
        av.push(x);
        bv.push(y);
        ratio.push(x / y);
    }
    Ok((median(av), median(bv), median(ratio)))
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
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
    m.forward(pool, &mut [SeqInput { kv: &mut kv, tokens: &prompt, logit_rows: 1 }])?;
    let s = t.elapsed().as_secs_f64();
    kv.release(pool)?;
    Ok(n as f64 / s)
}

/// Units of work per second `threads` threads do together, each running `work(thread)`,
/// which returns its units: best of three passes.
fn best_rate(threads: usize, work: impl Fn(usize) -> u64 + Sync) -> f64 {
    let pass = || {
        let t = Instant::now();
        let units: u64 = std::thread::scope(|sc| {
            let work = &work;
            let parts: Vec<_> = (0..threads.max(1)).map(|i| sc.spawn(move || work(i))).collect();
            parts.into_iter().map(|h| h.join().unwrap_or(0)).sum()
        });
        units as f64 / t.elapsed().as_secs_f64()
    };
    (0..3).map(|_| pass()).fold(0.0, f64::max)
}

/// Bytes read per second by `threads` threads each summing its share of a buffer far larger
/// than the caches (a plain read loop: the memory wall a batch-1 decode step, which reads
/// every weight once, runs into).
pub(crate) fn read_bandwidth(threads: usize) -> f64 {
    const BYTES: usize = 512 << 20;
    let words: Vec<u64> = (0..BYTES / 8).map(|i| i as u64).collect();
    let share = words.len().div_ceil(threads.max(1));
    best_rate(threads, |i| {
        let part = words.chunks(share).nth(i).unwrap_or_default();
        // Eight independent sums: the loads, not an add chain, set the pace.
        let mut acc = [0u64; 8];
        for c in part.chunks_exact(8) {
            for (a, x) in acc.iter_mut().zip(c) {
                *a = a.wrapping_add(*x);
            }
        }
        std::hint::black_box(acc);
        8 * part.len() as u64
    })
}

/// Integer multiply-adds per second `threads` threads do with the ISA's integer-dot
/// instruction alone (`kernels::int8_dot_chains`): the compute wall a prefill's quantised
/// matrices run into. `None` where the ISA has none.
fn int8_dot_peak(isa: Isa, threads: usize) -> Option<f64> {
    const ROUNDS: u64 = 20_000_000;
    int8_dot_chains(isa, 1)?;
    Some(best_rate(threads, |_| int8_dot_chains(isa, ROUNDS).unwrap_or(0)))
}

/// Bytes one decode step of `batch` sequences at `ctx` tokens of context reads: the
/// weights once, and every sequence's KV.
fn bytes_per_step(m: &Llama, kv_bytes_per_token: usize, batch: usize, ctx: usize) -> f64 {
    (m.weights.streamed_bytes_per_step() + batch * kv_bytes_read(m, kv_bytes_per_token, ctx)) as f64
}

/// Bytes of K and V one sequence's decode step reads at `ctx` tokens of context: each
/// layer's over the keys it sees (a sliding-window layer's window, not the context).
fn kv_bytes_read(m: &Llama, kv_bytes_per_token: usize, ctx: usize) -> usize {
    let c = &m.config;
    let per_layer = kv_bytes_per_token / c.layers.max(1);
    (0..c.layers).map(|l| c.window(l).map_or(ctx, |w| w.min(ctx)) * per_layer).sum()
}

fn decode_tps(m: &Llama, pool: &mut KvPool, batch: usize, ctx: usize, steps: usize) -> anyhow::Result<f64> {
    let vocab = m.config.vocab;
    let mut seqs: Vec<SequenceKv> = (0..batch).map(|i| SequenceKv::new(RequestId(i as u64 + 10))).collect();
    for s in &mut seqs {
        s.reserve(pool, ctx + steps)?;
    }
    let prompts: Vec<Vec<u32>> = (0..batch).map(|i| tokens(ctx, i + 1, vocab)).collect();
    let logits = {
        let mut inputs: Vec<SeqInput> = seqs.iter_mut().zip(&prompts).map(|(kv, p)| SeqInput { kv, tokens: p, logit_rows: 1 }).collect();
        m.forward(pool, &mut inputs)?
    };
    let mut next: Vec<[u32; 1]> = logits.chunks_exact(vocab).map(|l| [argmax(l)]).collect();
    let t = Instant::now();
    for _ in 0..steps {
        let logits = {
            let mut inputs: Vec<SeqInput> =
                seqs.iter_mut().zip(&next).map(|(kv, tok)| SeqInput { kv, tokens: tok, logit_rows: 1 }).collect();
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

/// Decode throughput with `checks` against all optional checks off, alternating so that
/// drift on a noisy machine hits both sides: medians and the median of per-pair ratios.
fn compare_checks(m: &Llama, a: &BenchArgs, pages: usize, checks: KvChecks) -> anyhow::Result<Vec<serde_json::Value>> {
    let layout = m.kv_layout(a.model.page_size as usize);
    let off = KvChecks { canaries: false, checksums: false, audit: false };
    let mut on_pool = KvPool::new(PoolConfig { layout, pages, checks })?;
    let mut off_pool = KvPool::new(PoolConfig { layout, pages, checks: off })?;
    let mut out = Vec::new();
    for &b in &a.batches {
        let (on, off, ratio) = alternate(
            a.reps,
            || decode_tps(m, &mut on_pool, b, a.decode_context, a.decode_steps),
            || decode_tps(m, &mut off_pool, b, a.decode_context, a.decode_steps),
        )?;
        out.push(serde_json::json!({ "batch": b, "checks_on_tok_s": on, "checks_off_tok_s": off, "ratio": ratio }));
    }
    Ok(out)
}

/// `--compare-kernels`: the detected VNNI kernels against the AVX2 ones, prefill and each
/// decode batch size in alternating repetitions.
fn compare_kernels(vnni: &Llama, a: &BenchArgs, pages: usize) -> anyhow::Result<()> {
    let Some(avx2) = Isa::get(IsaLevel::Avx2).filter(|_| vnni.isa().level() == IsaLevel::Avx512Vnni) else {
        println!("bulkhead bench-engine --compare-kernels: this CPU runs {}, not AVX-512 VNNI: nothing to compare", vnni.isa().name());
        return Ok(());
    };
    let avx2 = a.model.load()?.model.with_isa(avx2.with_sums(vnni.isa().sums()));
    compare(("compare-kernels", "vnni", "avx2"), vnni, &avx2, a, pages)
}

/// `--compare-sums`: the kernels with block sums against the same kernels with lane sums.
fn compare_sums(m: Llama, a: &BenchArgs, pages: usize) -> anyhow::Result<()> {
    let mut lanes = a.model.load()?.model;
    lanes.set_sums(Sums::Lanes);
    let mut blocks = m;
    blocks.set_sums(Sums::Blocks);
    compare(("compare-sums", "blocks", "lanes"), &blocks, &lanes, a, pages)
}

/// Model `x` against model `y` (same weights, other kernels), prefill and each decode batch
/// size in alternating repetitions; `names`: the flag, then `x`'s and `y`'s names.
fn compare(names: (&str, &str, &str), x: &Llama, y: &Llama, a: &BenchArgs, pages: usize) -> anyhow::Result<()> {
    let (flag, xn, yn) = names;
    let layout = x.kv_layout(a.model.page_size as usize);
    let mut pool = KvPool::new(PoolConfig { layout, pages, checks: KvChecks::default() })?;
    prefill_tps(x, &mut pool, a.prompt_tokens.min(64))?;
    prefill_tps(y, &mut pool, a.prompt_tokens.min(64))?;
    let mut pool2 = KvPool::new(PoolConfig { layout, pages, checks: KvChecks::default() })?;
    let mut rows = vec![(format!("prefill {:>5} tokens", a.prompt_tokens), {
        alternate(a.reps, || prefill_tps(x, &mut pool, a.prompt_tokens), || prefill_tps(y, &mut pool2, a.prompt_tokens))?
    })];
    for &b in &a.batches {
        let r = alternate(
            a.reps,
            || decode_tps(x, &mut pool, b, a.decode_context, a.decode_steps),
            || decode_tps(y, &mut pool2, b, a.decode_context, a.decode_steps),
        )?;
        rows.push((format!("decode  batch {b:>3} (ctx {:>4})", a.decode_context), r));
    }
    if a.json {
        let j: Vec<_> = rows
            .iter()
            .map(|(n, (p, q, r))| serde_json::json!({ "figure": n, format!("{xn}_tok_s"): p, format!("{yn}_tok_s"): q, "ratio": r }))
            .collect();
        println!("{}", serde_json::json!({ "threads": x.threads(), "kernels": j }));
    } else {
        println!("bulkhead bench-engine --{flag}: {} threads, median of {} alternating reps", x.threads(), a.reps.max(1));
        println!("{xn}: {}", x.kernels_line());
        println!("{yn}: {}", y.kernels_line());
        for (name, (p, q, r)) in rows {
            println!("{name:<30} {xn} {p:8.1} tok/s, {yn} {q:8.1} tok/s, ratio {xn}/{yn} {r:.2}");
        }
    }
    Ok(())
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    if a.compare_grammar {
        let batch = a.batches.iter().copied().max().unwrap_or(16);
        return crate::bench_grammar::run(a.model.load()?, a.model.page_size as usize, batch, a.decode_steps, a.reps, a.json);
    }
    if a.compare_speculation {
        return spec::run(a.model.load()?, a.model.page_size as usize, a.speculative_tokens as usize, &a.batches, a.reps, a.json);
    }
    let m = a.model.load()?.model;
    let layout = m.kv_layout(a.model.page_size as usize);
    let max_batch = a.batches.iter().copied().max().unwrap_or(1);
    let per_seq = layout.pages_for_tokens(a.decode_context + a.decode_steps);
    let pages = (per_seq * max_batch).max(layout.pages_for_tokens(a.prompt_tokens));
    if a.compare_kernels {
        return compare_kernels(&m, &a, pages);
    }
    if a.compare_sums {
        return compare_sums(m, &a, pages);
    }
    if a.compare_checks {
        // Warm-up, then production checks and the auditor, each against everything off.
        decode_tps(&m, &mut KvPool::new(PoolConfig { layout, pages, checks: KvChecks::default() })?, 1, 16, 4)?;
        let production = compare_checks(&m, &a, pages, KvChecks::default())?;
        let audit = compare_checks(&m, &a, pages, KvChecks::all())?;
        if a.json {
            println!(
                "{}",
                serde_json::json!({ "threads": m.threads(), "decode_context": a.decode_context, "production": production, "audit": audit })
            );
        } else {
            println!(
                "bulkhead bench-engine --compare-checks: {} threads, ctx {}, {} steps, median of {} alternating reps",
                m.threads(),
                a.decode_context,
                a.decode_steps,
                a.reps.max(1)
            );
            for (name, rows) in [("production checks (canaries)", &production), ("auditor + canaries", &audit)] {
                for r in rows {
                    println!(
                        "{name:<30} batch {:>3}: on {:8.1} tok/s, off {:8.1} tok/s, ratio on/off {:.3}",
                        r["batch"],
                        r["checks_on_tok_s"].as_f64().unwrap_or(0.0),
                        r["checks_off_tok_s"].as_f64().unwrap_or(0.0),
                        r["ratio"].as_f64().unwrap_or(0.0)
                    );
                }
            }
        }
        return Ok(());
    }
    let mut pool = KvPool::new(PoolConfig { layout, pages, checks: KvChecks::default() })?;
    let reps = a.reps.max(1);
    // One untimed warm-up pass brings weights into cache and threads up.
    prefill_tps(&m, &mut pool, a.prompt_tokens.min(64))?;
    let prefill = median((0..reps).map(|_| prefill_tps(&m, &mut pool, a.prompt_tokens)).collect::<Result<_, _>>()?);
    let mut decode = Vec::new();
    for &b in &a.batches {
        let v = median((0..reps).map(|_| decode_tps(&m, &mut pool, b, a.decode_context, a.decode_steps)).collect::<Result<_, _>>()?);
        decode.push((b, v));
    }
    // KV footprint: what the pool stores per token against the model's f16 figure, and the
    // slack of one decode sequence (its last page's unused slots).
    // The memory wall: what these threads can read, and what each decode figure reads.
    let wall = read_bandwidth(m.threads());
    // The compute wall: what the integer-dot instruction alone does, and what the prefill's
    // matrices did.
    let peak = int8_dot_peak(m.isa(), m.threads());
    let prefill_macs = m.weights.prefill_matrix_macs(a.prompt_tokens) as f64 * prefill / a.prompt_tokens as f64;
    // A decoded token runs every matrix and the head once.
    let token_macs = m.weights.prefill_matrix_macs(1) as f64;
    let read = |b: usize, v: f64| bytes_per_step(&m, layout.bytes_per_token(), b, a.decode_context + a.decode_steps / 2) * v / b as f64;
    let c = &m.config;
    let theoretical = 2 * c.layers * c.kv_heads * c.head_dim * 2;
    let seq_tokens = a.decode_context + a.decode_steps;
    let slack = layout.pages_for_tokens(seq_tokens) * layout.page_size - seq_tokens;
    if a.json {
        let j = serde_json::json!({
            "kv_bytes_per_token": layout.bytes_per_token(),
            "kv_bytes_per_token_theoretical_f16": theoretical,
            "kv_page_tokens": layout.page_size,
            "kv_slack_slots_per_sequence": slack,
            "isa": m.isa().name(),
            "weight_kernels": m.weights.kernels(m.isa()).into_iter().map(|(ty, k, n)| serde_json::json!({"type": ty.to_string(), "kernel": k, "params": n})).collect::<Vec<_>>(),
            "threads": m.threads(),
            "prompt_tokens": a.prompt_tokens,
            "prefill_tok_s": prefill,
            "int8_dot_peak_g_per_s": peak.map(|p| p / 1e9),
            "prefill_matrix_g_macs_per_s": prefill_macs / 1e9,
            "prefill_of_int8_peak": peak.map(|p| prefill_macs / p),
            "decode_context": a.decode_context,
            "decode_steps": a.decode_steps,
            "read_bandwidth_gb_s": wall / 1e9,
            "weight_bytes_per_step": m.weights.streamed_bytes_per_step(),
            "decode_tok_s": decode.iter().map(|&(b, v)| serde_json::json!({"batch": b, "tok_s": v, "read_gb_s": read(b, v) / 1e9, "of_bandwidth": read(b, v) / wall, "of_int8_peak": peak.map(|p| token_macs * v / p)})).collect::<Vec<_>>(),
        });
        println!("{j}");
    } else {
        println!("bulkhead bench-engine: {} threads, kernels {}", m.threads(), m.isa().name());
        println!("weights by type and kernel: {}", m.kernels_line());
        println!(
            "KV: {} bytes per token (model's f16 figure 2 x {} layers x {} kv heads x {} x 2 = {theoretical}); pages of {} tokens, \
             a {seq_tokens}-token sequence leaves {slack} slots unused (< 1 page)",
            layout.bytes_per_token(),
            c.layers,
            c.kv_heads,
            c.head_dim,
            layout.page_size
        );
        println!(
            "memory wall: {:.1} GB/s read by {} threads (a plain read loop); a step reads {:.1} MB of weights, and {:.1} MB of \
             K and V a sequence at {} tokens of context",
            wall / 1e9,
            m.threads(),
            m.weights.streamed_bytes_per_step() as f64 / 1e6,
            kv_bytes_read(&m, layout.bytes_per_token(), a.decode_context + a.decode_steps / 2) as f64 / 1e6,
            a.decode_context + a.decode_steps / 2
        );
        if let Some(p) = peak {
            println!(
                "compute wall: {:.1} G int8 multiply-adds a second by {} threads ({} chains alone)",
                p / 1e9,
                m.threads(),
                if m.isa().level() == IsaLevel::Avx512Vnni { "vpdpbusd" } else { "vpmaddubsw" }
            );
        }
        print!("prefill {:>5} tokens          {prefill:8.1} tok/s", a.prompt_tokens);
        match peak {
            Some(p) => println!(", matrices {:5.1} G multiply-adds/s = {:.2} of the compute wall", prefill_macs / 1e9, prefill_macs / p),
            None => println!(),
        }
        for (b, v) in decode {
            let r = read(b, v);
            print!(
                "decode  batch {b:>3} (ctx {:>4})   {v:8.1} tok/s aggregate, reads {:5.1} GB/s = {:.2} of the wall",
                a.decode_context,
                r / 1e9,
                r / wall
            );
            match peak {
                Some(p) => println!(", {:.2} of the compute wall", token_macs * v / p),
                None => println!(),
            }
        }
    }
    Ok(())
}
