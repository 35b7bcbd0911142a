//! Generation through the engine on the real default model: greedy agreement with
//! llama.cpp's recorded outputs, batching that does not change results, and the request
//! lifecycle (stop strings, max_tokens, abort, admission limits).

use std::sync::{Arc, OnceLock};

use bulkhead_engine::{
    DraftError, DraftModel, Engine, EngineConfig, EngineError, Event, FinishReason, GenRequest, Sampling, Speculation, load_model,
};
use bulkhead_kv::{KvChecks, KvPool, PoolConfig, RequestId, SequenceKv};
use bulkhead_model::{Llama, SeqInput, Sums};
use bulkhead_protocol::admission::Refusal;
use bulkhead_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};

struct Shared {
    model: Arc<Llama>,
    tok: Arc<Tokenizer>,
    chat: ChatTemplate,
}

fn shared() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| {
        let p = bulkhead_fetch::ensure_default_model(false).expect("default model");
        let m = load_model(&p, 2).expect("load");
        Shared { model: Arc::new(m.model), tok: Arc::new(m.tokenizer), chat: m.chat.expect("the default model has a chat template") }
    })
}

fn engine(pages: usize) -> Engine {
    speculating(pages, Speculation::Off)
}

fn speculating(pages: usize, speculation: Speculation) -> Engine {
    let s = shared();
    let pool = KvPool::new(PoolConfig { layout: s.model.kv_layout(16), pages, checks: KvChecks::all() }).unwrap();
    Engine::new(s.model.clone(), s.tok.clone(), pool, EngineConfig { speculation, ..EngineConfig::for_context(8192) })
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenRequest {
    GenRequest { prompt, max_tokens, sampling: Sampling::default(), stop: Vec::new() }
}

/// Runs until every request ends; returns (text, finish reason, completion tokens) per id.
fn run(e: &mut Engine, ids: &[RequestId]) -> Vec<(String, FinishReason, usize)> {
    let mut out: Vec<(String, Option<FinishReason>, usize)> = vec![(String::new(), None, 0); ids.len()];
    while e.active() > 0 {
        for ev in e.step().unwrap() {
            match ev {
                Event::Token { req, text, .. } => out[ids.iter().position(|&i| i == req).unwrap()].0.push_str(&text),
                Event::Finished { req, finish, text, completion_tokens, .. } => {
                    let o = &mut out[ids.iter().position(|&i| i == req).unwrap()];
                    o.0.push_str(&text);
                    o.1 = Some(finish);
                    o.2 = completion_tokens as usize;
                }
                Event::Failed { req, detail } => panic!("request {req:?} failed: {detail}"),
                Event::Retracted { req, .. } => panic!("request {req:?} was retracted, which only verified sequences are"),
            }
        }
    }
    out.into_iter().map(|(t, r, n)| (t, r.expect("finished"), n)).collect()
}

fn cases() -> Vec<(String, String, bool)> {
    let v: serde_json::Value = serde_json::from_str(include_str!("fixtures/greedy_cases.json")).unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["prompt"].as_str().unwrap().to_string(),
                c["greedy_32"].as_str().unwrap().to_string(),
                c["ended_with_eos"].as_bool().unwrap(),
            )
        })
        .collect()
}

/// Largest logit gap tolerated between our top token and the token llama.cpp chose. The two
/// engines round differently (llama.cpp accumulates attention in f16, we in f32; both
/// quantise activations to 8 bits), and this 135M model has near-ties: measured gaps at the
/// points where the greedy paths part are 0.06-0.17 logits on a scale of 15-30.
const NEAR_TIE: f32 = 0.25;

/// Teacher-forced along llama.cpp's own greedy path, in either arithmetic of the quantised
/// kernels: at every one of its 32 (or fewer) tokens, the token llama.cpp picked is our
/// argmax or within NEAR_TIE of it (block sums: 145 of 157 steps are our argmax, the largest
/// gap 0.24; lane sums: 143, 0.17). All seven prompts run as one batch through the paged
/// pass. Then free-running greedy decoding in this CPU's default arithmetic: the first token
/// agrees wherever llama.cpp's first choice is not a near-tie, and at least two
/// continuations agree exactly (block sums 2 of 7, lane sums 3: past one near-tie a 135M
/// model's continuation goes elsewhere; the
/// two arithmetics' perplexity on 1,500 tokens of this project's docs is 32.00 against 31.96).
#[test]
fn llama_cpp_greedy_choices_are_our_argmax_or_a_near_tie_at_every_step() {
    let s = shared();
    let cases = cases();
    let paths: Vec<(Vec<u32>, Vec<u32>)> = cases
        .iter()
        .map(|(p, want, eos)| {
            let mut cont = s.tok.encode(want, false);
            if *eos {
                cont.push(s.tok.eos_id());
            }
            (s.tok.encode(p, true), cont)
        })
        .collect();
    // The default arithmetic on this CPU, then the other one.
    let mut other = load_model(&bulkhead_fetch::ensure_default_model(false).unwrap(), 2).unwrap().model;
    other.set_sums(if s.model.isa().sums() == Sums::Blocks { Sums::Lanes } else { Sums::Blocks });
    for m in [&*s.model, &other] {
        let (exact_steps, steps, worst) = teacher_forced(m, &paths);
        let sums = m.isa().sums().name();
        eprintln!("{sums} sums, llama.cpp's path: {exact_steps}/{steps} steps are our argmax; largest gap {worst:.3} logits");
    }
    // Free-running greedy through the engine: the first token agrees wherever llama.cpp's
    // first choice is not a near-tie (all cases but the default-system-prompt one).
    let mut e = engine(256);
    let ids: Vec<RequestId> = cases.iter().map(|(p, _, _)| e.add(greedy(s.tok.encode(p, true), 32)).unwrap()).collect();
    let outs = run(&mut e, &ids);
    let agree = cases.iter().zip(&outs).filter(|((_, want, _), (got, _, _))| got == want).count();
    eprintln!("free-running greedy: {agree}/{} continuations identical to llama.cpp", cases.len());
    for (i, ((_, want, _), (got, _, _))) in cases.iter().zip(&outs).enumerate() {
        let first = |t: &str| s.tok.encode(t, false).first().copied();
        if i != 1 {
            assert_eq!(first(got), first(want), "case {i}: first token differs: {got:?} vs {want:?}");
        }
    }
    assert!(agree >= 2, "only {agree} of {} greedy continuations match llama.cpp", cases.len());
}

/// `m` teacher-forced along `paths` (prompt, llama.cpp's continuation), asserting llama.cpp's
/// choice is within NEAR_TIE of our best at every step: (steps where it is our argmax,
/// steps, largest gap).
fn teacher_forced(m: &Llama, paths: &[(Vec<u32>, Vec<u32>)]) -> (usize, usize, f32) {
    let tok = &shared().tok;
    let vocab = m.config.vocab;
    let mut pool = KvPool::new(PoolConfig { layout: m.kv_layout(16), pages: 256, checks: KvChecks::all() }).unwrap();
    let mut seqs: Vec<SequenceKv> = (0..paths.len()).map(|i| SequenceKv::new(RequestId(100 + i as u64))).collect();
    for (kv, (p, c)) in seqs.iter_mut().zip(paths) {
        kv.reserve(&mut pool, p.len() + c.len()).unwrap();
    }
    let mut logits = {
        let mut inputs: Vec<SeqInput> = seqs.iter_mut().zip(paths).map(|(kv, (p, _))| SeqInput { kv, tokens: p, logit_rows: 1 }).collect();
        m.forward(&mut pool, &mut inputs).unwrap()
    };
    let (mut worst, mut exact_steps, mut steps) = (0.0f32, 0, 0);
    let longest = paths.iter().map(|(_, c)| c.len()).max().unwrap();
    for step in 0..longest {
        let live: Vec<usize> = (0..paths.len()).filter(|&i| step < paths[i].1.len()).collect();
        for (row, &i) in live.iter().enumerate() {
            let l = &logits[row * vocab..(row + 1) * vocab];
            let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let theirs = paths[i].1[step];
            let gap = max - l[theirs as usize];
            assert!(gap <= NEAR_TIE, "case {i} step {step}: llama.cpp chose {:?}, {gap:.3} logits below our best", tok.decode(&[theirs]));
            worst = worst.max(gap);
            exact_steps += usize::from(gap == 0.0);
            steps += 1;
        }
        let feed: Vec<(usize, [u32; 1])> =
            live.iter().filter(|&&i| step + 1 < paths[i].1.len()).map(|&i| (i, [paths[i].1[step]])).collect();
        if feed.is_empty() {
            break;
        }
        let mut inputs = Vec::new();
        for (i, kv) in seqs.iter_mut().enumerate() {
            if let Some((_, t)) = feed.iter().find(|(j, _)| *j == i) {
                inputs.push(SeqInput { kv, tokens: t, logit_rows: 1 });
            }
        }
        logits = m.forward(&mut pool, &mut inputs).unwrap();
    }
    for kv in seqs {
        kv.release(&mut pool).unwrap();
    }
    (exact_steps, steps, worst)
}

/// The same prompt alone and sharing its batch with others gives identical output.
#[test]
fn batching_does_not_change_a_sequence_s_output() {
    let tok = &shared().tok;
    let (p, _, _) = &cases()[2];
    let mut alone = engine(64);
    let id = alone.add(greedy(tok.encode(p, true), 24)).unwrap();
    let want = run(&mut alone, &[id]).remove(0);
    let mut busy = engine(256);
    let mut ids = Vec::new();
    for (q, _, _) in cases().iter().take(5) {
        ids.push(busy.add(greedy(tok.encode(q, true), 24)).unwrap());
    }
    let id = busy.add(greedy(tok.encode(p, true), 24)).unwrap();
    ids.push(id);
    assert_eq!(run(&mut busy, &ids).pop().unwrap(), want);
}

#[test]
fn the_chat_template_with_an_explicit_system_prompt_answers_sanely() {
    let s = shared();
    let text = s
        .chat
        .render(
            &[ChatMessage::new("system", "You are a helpful assistant."), ChatMessage::new("user", "What is the capital of France?")],
            true,
        )
        .unwrap();
    let mut e = engine(16);
    let id = e.add(greedy(s.tok.encode(&text, true), 32)).unwrap();
    let (out, reason, _) = run(&mut e, &[id]).remove(0);
    assert!(out.contains("Paris"), "{out}");
    assert_eq!(reason, FinishReason::Stop);
}

#[test]
fn ignore_eos_generates_past_the_end_token_until_max_tokens() {
    let s = shared();
    let text = s.chat.render(&[ChatMessage::new("user", "Name three primary colors.")], true).unwrap();
    let prompt = s.tok.encode(&text, true);
    let mut e = engine(16);
    let id = e.add(greedy(prompt.clone(), 64)).unwrap();
    let (short, reason, n) = run(&mut e, &[id]).remove(0);
    assert!(reason == FinishReason::Stop && n < 64, "the reply must end by itself for this test: {n} tokens, {short:?}");
    let mut req = greedy(prompt, 64);
    req.sampling.ignore_eos = true;
    let id = e.add(req).unwrap();
    let (long, reason, n) = run(&mut e, &[id]).remove(0);
    assert_eq!((reason, n), (FinishReason::Length, 64));
    assert!(long.starts_with(&short) && long.len() > short.len(), "{short:?} then {long:?}");
    assert!(!long.contains("<|im_end|>"), "the end token shows no text: {long:?}");
    assert!(!long.contains("<|im_start|>"), "nor other special tokens: {long:?}");
    // Asked for (vLLM's `skip_special_tokens: false`), the special tokens it made show.
    let mut req = greedy(s.tok.encode(&text, true), 64);
    req.sampling.ignore_eos = true;
    req.sampling.skip_special_tokens = false;
    let id = e.add(req).unwrap();
    let (raw, _, _) = run(&mut e, &[id]).remove(0);
    assert!(raw.contains("<|im_start|>") && raw.len() > long.len(), "{raw:?}");
}

#[test]
fn a_stop_string_ends_generation_before_it_and_max_tokens_ends_with_length() {
    let tok = &shared().tok;
    let (p, want, _) = &cases()[0]; // "The capital of France is Paris."
    let mut e = engine(16);
    let mut req = greedy(tok.encode(p, true), 32);
    req.stop = vec![" is".into()];
    let id = e.add(req).unwrap();
    let (out, reason, _) = run(&mut e, &[id]).remove(0);
    assert_eq!((out.as_str(), reason), ("The capital of France", FinishReason::Stop));
    let id = e.add(greedy(tok.encode(p, true), 3)).unwrap();
    let (out, reason, n) = run(&mut e, &[id]).remove(0);
    assert_eq!((reason, n), (FinishReason::Length, 3));
    assert!(want.starts_with(&out) && !out.is_empty(), "{out:?}");
    assert_eq!(e.pool().stats().free_pages, 16);
}

#[test]
fn a_seed_makes_sampling_reproducible() {
    let tok = &shared().tok;
    let (p, _, _) = &cases()[2];
    let sampled = |seed| {
        let mut e = engine(16);
        let sampling = Sampling { temperature: 1.0, top_k: 40, top_p: 0.95, seed: Some(seed), ..Sampling::default() };
        let id = e.add(GenRequest { prompt: tok.encode(p, true), max_tokens: 16, sampling, stop: vec![] }).unwrap();
        run(&mut e, &[id]).remove(0).0
    };
    assert_eq!(sampled(7), sampled(7));
    assert!((1..6).any(|s| sampled(s) != sampled(7)), "different seeds never differ");
}

#[test]
fn admission_refuses_what_cannot_fit_and_abort_returns_every_page() {
    let tok = &shared().tok;
    let mut e = engine(8); // 128 tokens
    let prompt = tok.encode(&cases()[0].0, true);
    // KV on demand: a request is admitted if it fits the pool alone, and must.
    let over_pool = e.add(greedy(prompt.clone(), 128 - prompt.len() + 1)).unwrap_err();
    assert!(matches!(over_pool, EngineError::Refused(Refusal::ContextLength { limit: 128, .. })), "{over_pool}");
    assert!(matches!(e.add(greedy(Vec::new(), 4)), Err(EngineError::Refused(Refusal::EmptyPrompt))));
    assert_eq!(e.pool().stats().free_pages, 8, "a refused request holds no page");
    let id = e.add(greedy(prompt, 64)).unwrap();
    e.step().unwrap();
    e.step().unwrap();
    assert!(e.abort(id).unwrap());
    assert!(!e.abort(id).unwrap());
    assert_eq!((e.active(), e.pool().stats().free_pages), (0, 8));
}

/// A sequence whose pages changed hands mid-generation fails its read check before the next
/// step computes anything: it alone is failed, and the sequence beside it in the batch
/// finishes exactly as it does alone.
#[test]
fn a_sequence_failing_its_read_check_is_failed_alone_and_the_batch_goes_on() {
    let s = shared();
    let text = s.chat.render(&[ChatMessage::new("user", "What is the capital of France?")], true).unwrap();
    let prompt = s.tok.encode(&text, true);
    let mut alone = engine(16);
    let id = alone.add(greedy(prompt.clone(), 12)).unwrap();
    let (expected, _, _) = run(&mut alone, &[id]).remove(0);

    let mut e = engine(16);
    let victim = e.add(greedy(prompt.clone(), 12)).unwrap();
    let other = e.add(greedy(prompt, 12)).unwrap();
    e.step().unwrap();
    // The victim's leases go stale, as if its pages were taken back and re-leased.
    for q in e.pool_mut().revoke_owner(victim) {
        e.pool_mut().release_quarantined(q).unwrap();
    }
    let mut failed = Vec::new();
    let mut text = String::new();
    while e.active() > 0 {
        for ev in e.step().unwrap() {
            match ev {
                Event::Failed { req, detail } => failed.push((req, detail)),
                Event::Token { req, text: t, .. } if req == other => text.push_str(&t),
                Event::Finished { req, text: t, .. } if req == other => text.push_str(&t),
                ev => panic!("the victim produced {ev:?} after its pages were revoked"),
            }
        }
    }
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].0, victim);
    assert!(failed[0].1.starts_with("KV read check failed: stale lease"), "{failed:?}");
    assert!(e.pool().stats().generation_checks > 0);
    assert_eq!(e.pool().stats().free_pages, e.pool().stats().total_pages, "every page is back");
    // The survivor's first token came from the shared first step.
    assert!(expected.ends_with(&text) && !text.is_empty(), "{expected:?} vs {text:?}");
}

/// KV on demand: two requests that each fit the pool alone but not together. The newer one
/// is retracted when the older needs a page (its pages go back through the release path),
/// recomputed from its prompt and what it generated when room comes back, and both end
/// with exactly the text each makes alone.
#[test]
fn a_sequence_retracted_for_room_resumes_and_ends_with_the_text_it_makes_alone() {
    let s = shared();
    let text = s.chat.render(&[ChatMessage::new("user", "What is the capital of France?")], true).unwrap();
    let prompt = s.tok.encode(&text, true);
    let long = |prompt: Vec<u32>| GenRequest {
        prompt,
        max_tokens: 40,
        sampling: Sampling { ignore_eos: true, ..Sampling::default() },
        stop: Vec::new(),
    };
    let pages = (prompt.len() + 40).div_ceil(16) + 1;
    let mut alone = engine(pages);
    let id = alone.add(long(prompt.clone())).unwrap();
    let expected = run(&mut alone, &[id]).remove(0);
    assert_eq!(alone.retractions(), 0);

    let mut e = engine(pages);
    let a = e.add(long(prompt.clone())).unwrap();
    let b = e.add(long(prompt)).unwrap();
    let both = run(&mut e, &[a, b]);
    assert!(e.retractions() > 0, "the pool was big enough for both: the test shows nothing");
    assert_eq!(both, vec![expected.clone(), expected]);
    assert_eq!((e.active(), e.pool().stats().free_pages), (0, pages));
}

/// Prompts where n-gram drafts are right (copying a passage, a list that repeats) and
/// where they mostly are not (a free answer), as chat turns.
fn speculation_prompts() -> Vec<Vec<u32>> {
    let s = shared();
    let passage = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again, \
                   and then the lazy dog sleeps while the quick brown fox runs into the forest.";
    let turns = [
        format!("Repeat this text exactly, word for word: {passage}"),
        "Count from one to twenty in words, separated by commas.".to_string(),
        "What is the capital of France?".to_string(),
        format!("Fix the spelling in this sentence and write it out again: {}", passage.replace("quick", "quikc")),
    ];
    turns.iter().map(|t| s.tok.encode(&s.chat.render(&[ChatMessage::new("user", t)], true).unwrap(), true)).collect()
}

#[test]
fn speculation_gives_the_text_of_one_token_per_step_greedy_or_seeded_alone_or_batched() {
    let prompts = speculation_prompts();
    let seeded = Sampling { temperature: 0.7, top_k: 40, seed: Some(11), ..Sampling::default() };
    let requests: Vec<GenRequest> =
        prompts.iter().flat_map(|p| [greedy(p.clone(), 64), GenRequest { sampling: seeded.clone(), ..greedy(p.clone(), 48) }]).collect();
    let alone = |speculation| {
        let mut e = speculating(64, speculation);
        let out: Vec<_> = requests
            .iter()
            .map(|r| {
                let id = e.add(r.clone()).unwrap();
                run(&mut e, &[id]).remove(0)
            })
            .collect();
        assert_eq!(e.pool().stats().free_pages, 64);
        e.pool().check_invariants();
        (out, e.spec_counters().totals())
    };
    let (want, (drafted, _, _)) = alone(Speculation::Off);
    assert_eq!(drafted, 0);
    let (got, (drafted, accepted, verifications)) = alone(Speculation::Ngram { tokens: 4 });
    assert_eq!(got, want);
    // The copying prompts must have had drafts accepted, or this shows nothing.
    assert!(accepted >= 20 && drafted > accepted && verifications > 0, "drafted {drafted}, accepted {accepted}");
    // Batched (as many as speculation runs for), with a pool that retracts.
    let mut e = speculating(48, Speculation::Ngram { tokens: 4 });
    let ids: Vec<_> = requests[..4].iter().map(|r| e.add(r.clone()).unwrap()).collect();
    assert_eq!(run(&mut e, &ids), want[..4].to_vec());
    assert_eq!(e.pool().stats().free_pages, 48);
}

/// A draft model sharing the target's weights: its greedy drafts are the target's greedy
/// picks, so the plumbing (catch-up, rounds, roll-back of the draft KV, release) is tested
/// against a known answer without a second model.
fn self_drafting(pages: usize) -> Engine {
    let s = shared();
    let mut e = speculating(pages, Speculation::Draft { tokens: 4 });
    let draft = DraftModel::new(s.model.clone(), &s.tok, &s.tok, 16, pages * 16, 512, KvChecks::all()).unwrap();
    e.set_draft_model(draft);
    e
}

#[test]
fn a_draft_model_gives_the_text_of_one_token_per_step_and_gives_its_kv_back() {
    let prompts = speculation_prompts();
    let seeded = Sampling { temperature: 0.7, top_k: 40, seed: Some(11), ..Sampling::default() };
    let requests: Vec<GenRequest> =
        prompts.iter().flat_map(|p| [greedy(p.clone(), 40), GenRequest { sampling: seeded.clone(), ..greedy(p.clone(), 32) }]).collect();
    let mut off = speculating(64, Speculation::Off);
    let want: Vec<_> = requests.iter().map(|r| run_one(&mut off, r)).collect();
    let mut e = self_drafting(64);
    let got: Vec<_> = requests.iter().map(|r| run_one(&mut e, r)).collect();
    assert_eq!(got, want);
    let (drafted, accepted, _) = e.spec_counters().totals();
    // Greedy requests accept every draft the end of generation does not cut.
    assert!(drafted > 0 && accepted > 0, "drafted {drafted}, accepted {accepted}");
    let greedy_only = {
        let mut g = self_drafting(64);
        for r in requests.iter().step_by(2) {
            run_one(&mut g, r);
        }
        g.spec_counters().totals()
    };
    assert!(greedy_only.1 * 10 >= greedy_only.0 * 9, "greedy self-drafts rejected: {greedy_only:?}");
    // Batched: every draft sequence's KV went back with its request.
    let ids: Vec<_> = requests[..4].iter().map(|r| e.add(r.clone()).unwrap()).collect();
    assert_eq!(run(&mut e, &ids), want[..4].to_vec());
    let draft_pool = e.draft_model().unwrap().pool();
    assert_eq!(draft_pool.stats().free_pages, draft_pool.total_pages());
    draft_pool.check_invariants();
    assert_eq!(e.pool().stats().free_pages, 64);
}

fn run_one(e: &mut Engine, r: &GenRequest) -> (String, FinishReason, usize) {
    let id = e.add(r.clone()).unwrap();
    run(e, &[id]).remove(0)
}

#[test]
fn a_draft_model_of_another_tokenizer_is_refused_naming_the_difference() {
    let s = shared();
    let gemma = bulkhead_fetch::ensure(&bulkhead_fetch::GEMMA3_270M, false).expect("Gemma 3 270M");
    let f = bulkhead_gguf::GgufFile::open_metadata(&gemma).unwrap();
    let other = Tokenizer::from_gguf(&f).unwrap();
    let err = DraftModel::new(s.model.clone(), &other, &s.tok, 16, 1024, 512, KvChecks::all()).err().expect("refused");
    assert!(matches!(err, DraftError::VocabularySize { draft: 262_144, target: 49_152 }), "{err}");
    assert!(err.to_string().contains("262144 tokens"), "{err}");
    // A pool that cannot hold one request of the context is refused too (I5).
    let err = DraftModel::new(s.model.clone(), &s.tok, &s.tok, 16, 256, 512, KvChecks::all()).err().expect("refused");
    assert!(matches!(err, DraftError::Capacity { capacity: 256, context: 512 }), "{err}");
}
