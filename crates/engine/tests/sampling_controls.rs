//! The request's sampling controls on the real default model: grammars (structured
//! outputs) on every token, the prefill worker's first one included, greedy staying greedy
//! under a grammar, log-probabilities equal to the model's log-softmax, penalties, logit
//! bias, `min_tokens` and `stop_token_ids`.

use std::sync::{Arc, OnceLock};

use bulkhead_engine::{Engine, EngineConfig, Event, FinishReason, GenRequest, Prefiller, Sampling, load_model};
use bulkhead_grammar::Grammars;
use bulkhead_kv::{KvChecks, KvPool, PoolConfig, RequestId, SequenceKv};
use bulkhead_model::{Llama, SeqInput};
use bulkhead_protocol::driver::prefill::{Chunk, FirstToken, PrefillCompute};
use bulkhead_protocol::{GrammarSpec, TokenLogprobs};
use bulkhead_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};

struct Shared {
    model: Arc<Llama>,
    tok: Arc<Tokenizer>,
    chat: ChatTemplate,
    grammars: Grammars,
}

fn shared() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| {
        let p = bulkhead_fetch::ensure_default_model(false).expect("default model");
        let m = load_model(&p, 2).expect("load");
        let tok = Arc::new(m.tokenizer);
        let grammars = Grammars::new(Arc::clone(&tok)).expect("grammar vocabulary");
        Shared { model: Arc::new(m.model), tok, chat: m.chat.expect("the default model has a chat template"), grammars }
    })
}

fn pool(pages: usize) -> KvPool {
    KvPool::new(PoolConfig { layout: shared().model.kv_layout(16), pages, checks: KvChecks::all() }).expect("pool")
}

fn chat_prompt(user: &str) -> Vec<u32> {
    let s = shared();
    let text = s.chat.render(&[ChatMessage::new("user", user)], true).expect("template");
    s.tok.encode(&text, true)
}

/// The model's logits after `tokens`, computed afresh.
fn logits_after(tokens: &[u32]) -> Vec<f32> {
    let s = shared();
    let mut p = pool(tokens.len().div_ceil(16) + 1);
    let mut seq = SequenceKv::new(RequestId(1));
    seq.reserve(&mut p, tokens.len()).expect("reserve");
    s.model.forward(&mut p, &mut [SeqInput { kv: &mut seq, tokens, logit_rows: 1 }]).expect("forward")
}

struct Out {
    tokens: Vec<u32>,
    logprobs: Vec<Option<TokenLogprobs>>,
    text: String,
    finish: FinishReason,
}

fn generate(prompt: Vec<u32>, max_tokens: usize, sampling: Sampling) -> Out {
    let s = shared();
    let mut e = Engine::new(s.model.clone(), s.tok.clone(), pool(64), EngineConfig::for_context(8192));
    let id = e.add(GenRequest { prompt, max_tokens, sampling, stop: Vec::new() }).expect("admitted");
    let mut out = Out { tokens: Vec::new(), logprobs: Vec::new(), text: String::new(), finish: FinishReason::Abort };
    while e.active() > 0 {
        for ev in e.step().expect("step") {
            match ev {
                Event::Token { req, token, text, logprobs } if req == id => {
                    out.tokens.push(token);
                    out.logprobs.push(logprobs);
                    out.text.push_str(&text);
                }
                Event::Finished { finish, text, .. } => {
                    out.text.push_str(&text);
                    out.finish = finish;
                }
                ev => panic!("unexpected {ev:?}"),
            }
        }
    }
    out
}

fn argmax_where(logits: &[f32], allowed: impl Fn(u32) -> bool) -> u32 {
    let mut best = (f32::NEG_INFINITY, 0);
    for (id, &l) in logits.iter().enumerate() {
        if allowed(id as u32) && l > best.0 {
            best = (l, id as u32);
        }
    }
    best.1
}

const PERSON: &str = r#"{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150}}, "required": ["name", "age"], "additionalProperties": false}"#;

#[test]
fn a_json_schema_holds_and_greedy_under_it_is_the_argmax_of_what_it_allows() {
    let prompt = chat_prompt("Describe a person as JSON.");
    let sampling = Sampling { grammar: Some(GrammarSpec::JsonSchema(PERSON.into())), ..Sampling::default() };
    let out = generate(prompt.clone(), 60, sampling);
    assert_eq!(out.finish, FinishReason::Stop, "{:?}", out.text);
    let v: serde_json::Value = serde_json::from_str(&out.text).unwrap_or_else(|e| panic!("{e}: {:?}", out.text));
    assert!(v["name"].is_string() && v["age"].is_u64(), "{v}");
    assert_eq!(v.as_object().map(|o| o.len()), Some(2), "{v}");
    // Every token was the most likely one the grammar allowed at its step.
    let s = shared();
    let mut m = s.grammars.matcher(&GrammarSpec::JsonSchema(PERSON.into())).expect("grammar");
    let mut ctx = prompt;
    for &tok in &out.tokens {
        let mask = m.mask().expect("mask");
        let want = argmax_where(&logits_after(&ctx), |t| mask.allows(t));
        assert_eq!(tok, want, "after {:?}", s.tok.decode(&ctx));
        m.consume(tok).expect("consume");
        ctx.push(tok);
    }
}

#[test]
fn the_prefill_workers_first_token_obeys_the_grammar() {
    let s = shared();
    let prompt = chat_prompt("What is the capital of France?");
    let unconstrained = argmax_where(&logits_after(&prompt), |_| true);
    let digits = GrammarSpec::Regex("[0-9]{2,4}".into());
    let mut m = s.grammars.matcher(&digits).expect("grammar");
    assert!(!m.mask().expect("mask").allows(unconstrained), "the test needs a grammar that forbids the natural first token");
    for sampling in [
        Sampling { grammar: Some(digits.clone()), ..Sampling::default() },
        Sampling { grammar: Some(digits.clone()), temperature: 1.0, seed: Some(3), ..Sampling::default() },
    ] {
        let mut p = pool(8);
        let mut seq = SequenceKv::new(RequestId(2));
        seq.reserve(&mut p, prompt.len()).expect("reserve");
        let mut pre = Prefiller::new(s.model.clone(), s.tok.clone());
        let first = FirstToken { sampling: &sampling, skip_draws: 0 };
        let firsts =
            pre.compute(&mut p, &mut [Chunk { seq: &mut seq, tokens: &prompt, from: 0, to: prompt.len(), first }]).expect("compute");
        let Some((first, _)) = firsts[0] else { panic!("no first token") };
        let text = s.tok.decode(&[first]);
        assert!(!text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()), "first token {first} {text:?}");
    }
}

/// Batched prefill: prompts computed together in one pass (one of them only part of the
/// way, another under a grammar) get exactly the first tokens and log-probabilities each
/// gets alone, and the part-way one ends the same when its last chunk comes.
#[test]
fn prompts_prefilled_in_one_pass_get_what_each_gets_alone() {
    let s = shared();
    let prompts = [
        chat_prompt("What is the capital of France?"),
        chat_prompt("Name three colours of the rainbow, please."),
        chat_prompt("Count to ten."),
    ];
    let digits = Sampling { grammar: Some(GrammarSpec::Regex("[0-9]{2,4}".into())), logprobs: Some(3), ..Sampling::default() };
    let plain = Sampling { logprobs: Some(3), ..Sampling::default() };
    let samplings = [&plain, &digits, &plain];
    let mut pre = Prefiller::new(s.model.clone(), s.tok.clone());
    let alone: Vec<_> = prompts
        .iter()
        .zip(samplings)
        .map(|(prompt, sampling)| {
            let mut p = pool(8);
            let mut seq = SequenceKv::new(RequestId(1));
            seq.reserve(&mut p, prompt.len()).expect("reserve");
            let first = FirstToken { sampling, skip_draws: 0 };
            let mut out =
                pre.compute(&mut p, &mut [Chunk { seq: &mut seq, tokens: prompt, from: 0, to: prompt.len(), first }]).expect("compute");
            out.pop().flatten().expect("a first token")
        })
        .collect();
    let mut p = pool(24);
    let mut seqs: Vec<SequenceKv> = (0..3).map(|i| SequenceKv::new(RequestId(10 + i))).collect();
    for (seq, prompt) in seqs.iter_mut().zip(&prompts) {
        seq.reserve(&mut p, prompt.len()).expect("reserve");
    }
    // The middle prompt stops at its first page this pass.
    let ends = [prompts[0].len(), 16, prompts[2].len()];
    let mut chunks: Vec<Chunk<'_>> = seqs
        .iter_mut()
        .zip(&prompts)
        .zip(samplings.iter().zip(ends))
        .map(|((seq, tokens), (sampling, to))| Chunk { seq, tokens, from: 0, to, first: FirstToken { sampling, skip_draws: 0 } })
        .collect();
    let together = pre.compute(&mut p, &mut chunks).expect("compute");
    assert_eq!(together, vec![Some(alone[0].clone()), None, Some(alone[2].clone())]);
    let first = FirstToken { sampling: &digits, skip_draws: 0 };
    let rest = pre
        .compute(&mut p, &mut [Chunk { seq: &mut seqs[1], tokens: &prompts[1], from: 16, to: prompts[1].len(), first }])
        .expect("compute");
    assert_eq!(rest, vec![Some(alone[1].clone())]);
}

#[test]
fn a_choice_ends_on_one_of_its_strings_and_a_sampled_answer_stays_inside_it() {
    let prompt = chat_prompt("Is the sky blue? Answer yes or no.");
    let choices = vec!["maybe so".to_string(), "absolutely not".to_string()];
    for sampling in [Sampling::default(), Sampling { temperature: 1.5, seed: Some(11), ..Sampling::default() }] {
        let out = generate(prompt.clone(), 20, Sampling { grammar: Some(GrammarSpec::Choice(choices.clone())), ..sampling });
        assert!(choices.contains(&out.text), "{:?}", out.text);
        assert_eq!(out.finish, FinishReason::Stop);
    }
}

#[test]
fn log_probabilities_are_the_models_log_softmax_before_any_change() {
    let prompt = chat_prompt("Name a colour.");
    // A bias that changes the choice must not change the reported log-probabilities.
    let natural = argmax_where(&logits_after(&prompt), |_| true);
    let sampling = Sampling { logprobs: Some(5), logit_bias: vec![(natural, -100.0)], ..Sampling::default() };
    let out = generate(prompt.clone(), 4, sampling);
    assert_ne!(out.tokens[0], natural, "the bias moved the choice");
    let mut ctx = prompt;
    for (tok, lp) in out.tokens.iter().zip(&out.logprobs) {
        let lp = lp.as_ref().expect("asked for");
        let logits = logits_after(&ctx);
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let z: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
        let direct = |id: u32| logits[id as usize] as f64 - max - z.ln();
        assert!((lp.logprob as f64 - direct(*tok)).abs() < 1e-3, "{} vs {}", lp.logprob, direct(*tok));
        assert_eq!(lp.top.len(), 5);
        assert_eq!(lp.top[0].0, argmax_where(&logits, |_| true), "the most likely first");
        for w in lp.top.windows(2) {
            assert!(w[0].1 >= w[1].1);
        }
        for &(id, l) in &lp.top {
            assert!((l as f64 - direct(id)).abs() < 1e-3);
        }
        ctx.push(*tok);
    }
}

#[test]
fn penalties_bias_min_tokens_and_stop_token_ids_change_what_is_picked() {
    let s = shared();
    let prompt = s.tok.encode("cat cat cat cat cat cat cat cat cat cat cat cat", true);
    let plain = generate(prompt.clone(), 30, Sampling::default());
    let repeats = |t: &[u32]| t.len() - t.iter().collect::<std::collections::BTreeSet<_>>().len();
    assert!(repeats(&plain.tokens) > 10, "the prompt makes the model repeat: {:?}", plain.text);
    let penalised = generate(prompt.clone(), 30, Sampling { frequency_penalty: 2.0, presence_penalty: 2.0, ..Sampling::default() });
    assert!(repeats(&penalised.tokens) < repeats(&plain.tokens), "{:?} vs {:?}", penalised.text, plain.text);
    let rep = generate(prompt.clone(), 30, Sampling { repetition_penalty: 2.0, ..Sampling::default() });
    assert_ne!(rep.tokens, plain.tokens, "the repetition penalty changes the answer");
    // min_tokens holds the end back: a one-word answer runs on.
    let short = chat_prompt("Say only: ok");
    let ended = generate(short.clone(), 40, Sampling::default());
    assert_eq!(ended.finish, FinishReason::Stop);
    let held = generate(short.clone(), 40, Sampling { min_tokens: (ended.tokens.len() + 5) as u32, ..Sampling::default() });
    assert!(held.tokens.len() >= ended.tokens.len() + 5, "{} tokens", held.tokens.len());
    assert!(held.tokens[..held.tokens.len() - 1].iter().all(|&t| !s.tok.is_eog(t)));
    // A stop token id ends the answer where it is picked, showing no text.
    let k = (1..plain.tokens.len()).find(|&k| !plain.tokens[..k].contains(&plain.tokens[k])).expect("a token new at its step");
    let stopped = generate(prompt, 30, Sampling { stop_token_ids: vec![plain.tokens[k]], ..Sampling::default() });
    assert_eq!(stopped.tokens, plain.tokens[..=k].to_vec());
    assert_eq!(stopped.finish, FinishReason::Stop);
    assert_eq!(stopped.text, s.tok.decode(&plain.tokens[..k]));
}

#[test]
fn a_retracted_or_handed_over_request_replays_its_tokens_into_the_grammar() {
    // What the decode worker does after a handoff: the prefill's first token (and a
    // retracted request's earlier tokens) are replayed into a fresh chooser, so the grammar
    // goes on from where it was.
    let s = shared();
    let prompt = chat_prompt("Describe a person as JSON.");
    let spec = GrammarSpec::JsonSchema(PERSON.into());
    let whole = generate(prompt.clone(), 60, Sampling { grammar: Some(spec.clone()), ..Sampling::default() });
    let vocab = bulkhead_engine::Vocabulary::new(s.tok.clone());
    for cut in [1, 5] {
        let mut c = vocab.chooser(Sampling { grammar: Some(spec.clone()), ..Sampling::default() }, &[]).expect("chooser");
        let mut ctx = prompt.clone();
        for &t in &whole.tokens[..cut] {
            c.replay(t).expect("replay");
            ctx.push(t);
        }
        let next = c.choose(&logits_after(&ctx)).expect("choose");
        assert_eq!(next.token, whole.tokens[cut], "cut at {cut}");
    }
}
