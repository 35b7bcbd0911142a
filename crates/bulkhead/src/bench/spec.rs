//! `bulkhead bench-engine --compare-speculation`: what n-gram speculative decoding buys,
//! through the engine's own decode loop: output tokens per second after the first token,
//! with speculation against without, per task (copying a passage, editing code, quoting an
//! answer, free-form chat, a later turn that repeats an earlier answer) and batch size, in alternating repetitions. Both sides must give
//! the same text: a run where they differ is an error, not a figure.

use std::sync::Arc;
use std::time::Instant;

use bulkhead_engine::{Engine, EngineConfig, Event, GenRequest, LoadedModel, Sampling, Speculation};
use bulkhead_kv::{KvChecks, KvPool, PoolConfig, RequestId, SequenceKv};
use bulkhead_model::{Llama, SeqInput};
use bulkhead_tokenizer::{ChatMessage, Tokenizer};

use super::alternate;

const PASSAGE: &str = "A key-value cache stores, for every token a model has read, the keys and values its \
attention layers computed, so that each new token attends to them without computing them again. In a \
disaggregated server one machine computes a prompt's cache and another generates from it; the cache moves \
between them in pages, and a page that changes hands must never show its earlier owner's values.";

const CODE: &str = "fn total_price(items: &[Item], tax: f64) -> f64 {\n    let mut total = 0.0;\n    for item in items {\n        \
total += item.price * item.quantity as f64;\n    }\n    let total = total * (1.0 + tax);\n    println!(\"total: {total}\");\n    \
total\n}\n";

/// The tasks: (name, the conversation's turns as (role, text), the last the user's).
fn tasks() -> Vec<(&'static str, Vec<(&'static str, String)>)> {
    let user = |t: String| vec![("user", t)];
    vec![
        ("copy a passage", user(format!("Repeat the following text exactly, word for word:\n\n{PASSAGE}"))),
        (
            "edit code",
            user(format!("Rename the variable `total` to `sum` in this Rust function and write out the whole function:\n\n{CODE}")),
        ),
        ("quote an answer", user(format!("{PASSAGE}\n\nQuoting the text above, what must a page that changes hands never show?"))),
        ("free chat", user("Write a short story about a lighthouse keeper who finds a message in a bottle.".to_string())),
        // A later turn that quotes an earlier answer (the passage, as the assistant's).
        (
            "later turn",
            vec![
                ("user", "Explain in one paragraph what a key-value cache is and how it moves in a disaggregated server.".to_string()),
                ("assistant", PASSAGE.to_string()),
                ("user", "Copy your last answer exactly.".to_string()),
            ],
        ),
    ]
}

struct Side {
    engine: Engine,
}

impl Side {
    /// Output tokens per second of `batch` copies of `prompt` after each has its first
    /// token, and their texts.
    fn run(&mut self, prompt: &[u32], batch: usize, max_tokens: usize) -> anyhow::Result<(f64, Vec<String>)> {
        let req = GenRequest { prompt: prompt.to_vec(), max_tokens, sampling: Sampling::default(), stop: Vec::new() };
        let ids: Vec<RequestId> = (0..batch).map(|_| self.engine.add(req.clone())).collect::<Result<_, _>>()?;
        let mut texts = vec![String::new(); batch];
        let mut started = 0;
        let (mut t, mut tokens) = (Instant::now(), 0usize);
        while self.engine.active() > 0 {
            for ev in self.engine.step()? {
                let i = ids.iter().position(|&id| id == ev.req()).unwrap_or(0);
                match ev {
                    Event::Token { text, .. } => {
                        texts[i].push_str(&text);
                        if started < batch {
                            started += 1;
                            if started == batch {
                                // Timed from here: every sequence decoding.
                                (t, tokens) = (Instant::now(), 0);
                            }
                        } else {
                            tokens += 1;
                        }
                    }
                    Event::Finished { text, .. } => texts[i].push_str(&text),
                    Event::Failed { detail, .. } => anyhow::bail!("a request failed: {detail}"),
                    Event::Retracted { .. } => anyhow::bail!("a request was retracted: the pool is too small for the bench"),
                }
            }
        }
        Ok((tokens as f64 / t.elapsed().as_secs_f64(), texts))
    }
}

fn engine(m: &Arc<Llama>, tok: &Arc<Tokenizer>, page_size: usize, pages: usize, speculation: Speculation) -> anyhow::Result<Side> {
    let pool = KvPool::new(PoolConfig { layout: m.kv_layout(page_size), pages, checks: KvChecks::default() })?;
    let cfg = EngineConfig { speculation, ..EngineConfig::for_context(m.config.context_length) };
    Ok(Side { engine: Engine::new(Arc::clone(m), Arc::clone(tok), pool, cfg) })
}

/// Seconds of one forward step of `batch` sequences at `ctx` tokens of context, each
/// feeding `rows` tokens with a logit row each (a verification of `rows - 1` drafts);
/// the median of 16 steps.
fn step_seconds(m: &Llama, page_size: usize, batch: usize, rows: usize, ctx: usize) -> anyhow::Result<f64> {
    const STEPS: usize = 16;
    let layout = m.kv_layout(page_size);
    let mut pool =
        KvPool::new(PoolConfig { layout, pages: batch * layout.pages_for_tokens(ctx + rows * STEPS), checks: KvChecks::default() })?;
    let mut seqs: Vec<SequenceKv> = (0..batch).map(|i| SequenceKv::new(RequestId(i as u64 + 1))).collect();
    let prompt: Vec<u32> = (0..ctx).map(|i| 100 + (i * 7919 % 20_000) as u32).collect();
    for s in &mut seqs {
        s.reserve(&mut pool, ctx + rows * STEPS)?;
    }
    let mut inputs: Vec<SeqInput> = seqs.iter_mut().map(|kv| SeqInput { kv, tokens: &prompt, logit_rows: 1 }).collect();
    m.forward(&mut pool, &mut inputs)?;
    let fed: Vec<u32> = prompt[..rows].to_vec();
    let mut times = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        let mut inputs: Vec<SeqInput> = seqs.iter_mut().map(|kv| SeqInput { kv, tokens: &fed, logit_rows: rows }).collect();
        let t = Instant::now();
        m.forward(&mut pool, &mut inputs)?;
        times.push(t.elapsed().as_secs_f64());
    }
    for s in seqs {
        s.release(&mut pool)?;
    }
    Ok(super::median(times))
}

/// Runs the comparison: `tokens` drafts per step at most, each batch size in `batches`.
pub fn run(loaded: LoadedModel, page_size: usize, tokens: usize, batches: &[usize], reps: usize, json: bool) -> anyhow::Result<()> {
    let (m, tok) = (Arc::new(loaded.model), Arc::new(loaded.tokenizer));
    const MAX_TOKENS: usize = 128;
    // What a verification costs: a step feeding 1 + k rows per sequence against one row.
    let mut costs = Vec::new();
    for &batch in batches {
        for rows in [2, 3, tokens + 1] {
            let (one, more) = (step_seconds(&m, page_size, batch, 1, 256)?, step_seconds(&m, page_size, batch, rows, 256)?);
            costs.push(serde_json::json!({ "batch": batch, "rows": rows, "one_row_ms": one * 1e3, "ratio": more / one }));
        }
    }
    let mut rows = Vec::new();
    for (name, turns) in tasks() {
        let text = match &loaded.chat {
            Some(chat) => chat.render(&turns.iter().map(|(role, t)| ChatMessage::new(*role, t.as_str())).collect::<Vec<_>>(), true)?,
            None => turns.iter().map(|(_, t)| t.as_str()).collect::<Vec<_>>().join("\n\n"),
        };
        let prompt = tok.encode(&text, true);
        for &batch in batches {
            let pages = batch * m.kv_layout(page_size).pages_for_tokens(prompt.len() + MAX_TOKENS + 32);
            let mut on = engine(&m, &tok, page_size, pages, Speculation::Ngram { tokens })?;
            let mut off = engine(&m, &tok, page_size, pages, Speculation::Off)?;
            let counters = on.engine.spec_counters();
            let (mut on_text, mut off_text) = (Vec::new(), Vec::new());
            let (on_tps, off_tps, ratio) = alternate(
                reps,
                || {
                    let (v, t) = on.run(&prompt, batch, MAX_TOKENS)?;
                    on_text = t;
                    Ok(v)
                },
                || {
                    let (v, t) = off.run(&prompt, batch, MAX_TOKENS)?;
                    off_text = t;
                    Ok(v)
                },
            )?;
            anyhow::ensure!(on_text == off_text, "{name}, batch {batch}: the text differs with speculation on");
            let (drafted, accepted, verifications) = counters.totals();
            rows.push(serde_json::json!({
                "task": name, "batch": batch, "on_tok_s": on_tps, "off_tok_s": off_tps, "ratio": ratio,
                "drafted": drafted, "accepted": accepted, "verifications": verifications,
                "acceptance": if drafted > 0 { accepted as f64 / drafted as f64 } else { 0.0 },
            }));
        }
    }
    if json {
        println!(
            "{}",
            serde_json::json!({ "threads": m.threads(), "isa": m.isa().name(), "speculative_tokens": tokens, "max_tokens": MAX_TOKENS, "rows": rows })
        );
        return Ok(());
    }
    println!(
        "bulkhead bench-engine --compare-speculation: {} threads, kernels {}, up to {tokens} drafts, greedy, {MAX_TOKENS} tokens, median of {} alternating reps",
        m.threads(),
        m.isa().name(),
        reps.max(1)
    );
    for c in costs {
        println!(
            "a step of {} rows per sequence, batch {:>2}: {:.2}x a one-row step ({:.2} ms)",
            c["rows"],
            c["batch"],
            c["ratio"].as_f64().unwrap_or(0.0),
            c["one_row_ms"].as_f64().unwrap_or(0.0)
        );
    }
    for r in rows {
        println!(
            "{:<16} batch {:>2}: on {:7.1} tok/s, off {:7.1} tok/s, ratio {:.2}; drafts accepted {}/{} ({:.0}%) over {} verifications",
            r["task"].as_str().unwrap_or(""),
            r["batch"],
            r["on_tok_s"].as_f64().unwrap_or(0.0),
            r["off_tok_s"].as_f64().unwrap_or(0.0),
            r["ratio"].as_f64().unwrap_or(0.0),
            r["accepted"],
            r["drafted"],
            100.0 * r["acceptance"].as_f64().unwrap_or(0.0),
            r["verifications"]
        );
    }
    Ok(())
}
