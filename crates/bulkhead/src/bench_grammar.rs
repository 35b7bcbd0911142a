//! `bulkhead bench-engine --compare-grammar`: what constrained decoding costs, through the
//! engine's own decode loop (the chooser computes llguidance's mask at every token): decode
//! throughput of a batch constrained by a typical ten-field JSON schema against the same
//! batch unconstrained, and time to first token of one request with and without it, in
//! alternating repetitions.

use std::sync::Arc;
use std::time::Instant;

use bulkhead_engine::{Engine, EngineConfig, Event, GenRequest, LoadedModel, Sampling, Vocabulary};
use bulkhead_kv::{KvChecks, KvPool, PoolConfig, RequestId};
use bulkhead_protocol::GrammarSpec;
use bulkhead_tokenizer::ChatMessage;

use crate::bench::alternate;

/// A typical ten-field object: strings, numbers, a boolean, an enum and an array.
pub const TEN_FIELDS: &str = r#"{"type": "object", "properties": {
  "id": {"type": "integer"}, "name": {"type": "string"}, "email": {"type": "string"},
  "age": {"type": "integer", "minimum": 0, "maximum": 150}, "city": {"type": "string"},
  "country": {"type": "string"}, "active": {"type": "boolean"}, "score": {"type": "number"},
  "role": {"enum": ["admin", "user", "guest"]}, "tags": {"type": "array", "items": {"type": "string"}}},
  "required": ["id", "name", "email", "age", "city", "country", "active", "score", "role", "tags"],
  "additionalProperties": false}"#;

struct Bench {
    engine: Engine,
    prompts: Vec<Vec<u32>>,
}

impl Bench {
    fn sampling(grammar: bool) -> Sampling {
        let grammar = grammar.then(|| GrammarSpec::JsonSchema(TEN_FIELDS.into()));
        Sampling { ignore_eos: true, grammar, ..Sampling::default() }
    }

    /// Decode tokens per second of `batch` sequences over `steps` steps, timed after every
    /// sequence has its first token.
    fn decode(&mut self, batch: usize, steps: usize, grammar: bool) -> anyhow::Result<f64> {
        let ids: Vec<RequestId> = (0..batch)
            .map(|i| {
                self.engine.add(GenRequest {
                    prompt: self.prompts[i % self.prompts.len()].clone(),
                    max_tokens: steps + 8,
                    sampling: Self::sampling(grammar),
                    stop: Vec::new(),
                })
            })
            .collect::<Result<_, _>>()?;
        let mut started = 0;
        while started < batch {
            started += self.engine.step()?.iter().filter(|e| matches!(e, Event::Token { .. })).count();
        }
        let (t, mut tokens) = (Instant::now(), 0usize);
        for _ in 0..steps {
            tokens += self.engine.step()?.iter().filter(|e| matches!(e, Event::Token { .. })).count();
        }
        let s = t.elapsed().as_secs_f64();
        for id in ids {
            self.engine.abort(id)?;
        }
        Ok(tokens as f64 / s)
    }

    /// Seconds from admission to the first token of one request (the grammar compiled at
    /// admission, the prompt prefilled, the first token masked and picked).
    fn ttft(&mut self, grammar: bool) -> anyhow::Result<f64> {
        let t = Instant::now();
        let id = self.engine.add(GenRequest {
            prompt: self.prompts[0].clone(),
            max_tokens: 4,
            sampling: Self::sampling(grammar),
            stop: Vec::new(),
        })?;
        while !self.engine.step()?.iter().any(|e| matches!(e, Event::Token { .. })) {}
        let s = t.elapsed().as_secs_f64();
        self.engine.abort(id)?;
        Ok(s)
    }
}

/// Runs the comparison on `m`'s model with `threads` compute threads.
pub fn run(m: LoadedModel, page_size: usize, batch: usize, steps: usize, reps: usize, json: bool) -> anyhow::Result<()> {
    let tokenizer = Arc::new(m.tokenizer);
    let prompts: Vec<Vec<u32>> = (0..batch.max(1))
        .map(|i| {
            let user =
                format!("Make up user number {i} as a JSON object with id, name, email, age, city, country, active, score, role and tags.");
            let text = match &m.chat {
                Some(chat) => chat.render(&[ChatMessage::new("user", user)], true)?,
                None => user,
            };
            Ok::<_, anyhow::Error>(tokenizer.encode(&text, true))
        })
        .collect::<Result<_, _>>()?;
    // The grammar vocabulary is built once per process, before the first constrained request.
    let t = Instant::now();
    let vocab = Vocabulary::new(Arc::clone(&tokenizer));
    let grammars = vocab.grammars()?;
    let vocabulary_ms = t.elapsed().as_secs_f64() * 1e3;
    // What the gateway's check and each worker's matcher cost per request.
    let spec = GrammarSpec::JsonSchema(TEN_FIELDS.into());
    let compile_ms = crate::bench::median(
        (0..reps.max(1) * 5)
            .map(|_| {
                let t = Instant::now();
                grammars.matcher(&spec).map(|_| t.elapsed().as_secs_f64() * 1e3)
            })
            .collect::<Result<_, _>>()?,
    );
    let model = Arc::new(m.model);
    let layout = model.kv_layout(page_size);
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) + steps + 16;
    let pool = KvPool::new(PoolConfig { layout, pages: layout.pages_for_tokens(longest) * batch.max(1) + 4, checks: KvChecks::default() })?;
    let engine = Engine::new(Arc::clone(&model), tokenizer, pool, EngineConfig::for_context(longest));
    let mut b = Bench { engine, prompts };
    // Warm-up: weights in cache, threads up, the engine's grammar vocabulary built.
    b.ttft(true)?;
    b.ttft(false)?;
    let bench = std::cell::RefCell::new(b);
    let (dg, du, dr) =
        alternate(reps, || bench.borrow_mut().decode(batch, steps, true), || bench.borrow_mut().decode(batch, steps, false))?;
    let (tg, tu, tr) = alternate(reps, || bench.borrow_mut().ttft(true), || bench.borrow_mut().ttft(false))?;
    if json {
        println!(
            "{}",
            serde_json::json!({ "threads": model.threads(), "batch": batch, "steps": steps, "vocabulary_build_ms": vocabulary_ms, "schema_compile_ms": compile_ms,
                "decode_grammar_tok_s": dg, "decode_plain_tok_s": du, "decode_ratio": dr,
                "ttft_grammar_ms": tg * 1e3, "ttft_plain_ms": tu * 1e3, "ttft_ratio": tr })
        );
    } else {
        println!(
            "bulkhead bench-engine --compare-grammar: {} threads, a ten-field JSON schema, median of {} alternating reps",
            model.threads(),
            reps.max(1)
        );
        println!("grammar vocabulary (once per process): {vocabulary_ms:.1} ms; the schema's matcher (per request): {compile_ms:.2} ms");
        println!("decode batch {batch:>3}, {steps} steps: schema {dg:8.1} tok/s, none {du:8.1} tok/s, ratio schema/none {dr:.3}");
        println!("time to first token:        schema {:8.1} ms,   none {:8.1} ms,   ratio schema/none {tr:.3}", tg * 1e3, tu * 1e3);
    }
    Ok(())
}
