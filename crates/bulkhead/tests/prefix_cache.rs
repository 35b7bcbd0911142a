//! Tenants and the prefix cache through `bulkhead serve` (design I7): API keys pick the
//! tenant, a prompt's cached prefix is reused only within one tenant and salt, reuse gives
//! the same greedy answer, and `cached_tokens` matches the prefill pool's own counters.

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{MODEL_ID, Server, polled_sum, rand_u64};

const KEY_A: &str = "sk-tenant-a";
const KEY_B: &str = "sk-tenant-b";

fn tenants_file() -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("bulkhead-tenants-{}-{}.toml", std::process::id(), rand_u64()));
    let b_digest = "2ba1d5ef9b9d8ad6d5e7d52d1e4ea6d0f1b5d2f1b5f8b1e8c0f7d3a8e9b1c2d3"; // a key nobody has
    let text = format!(
        "[[tenant]]\nname = \"alpha\"\napi_keys = [\"{KEY_A}\"]\n\n[[tenant]]\nname = \"beta\"\napi_keys = [\"{KEY_B}\"]\napi_key_sha256 = [\"{b_digest}\"]\n"
    );
    std::fs::write(&path, text).expect("tenants file");
    path
}

fn serve(args: &[&str]) -> Server {
    let s = Server::start(args, &[]);
    s.wait_ready();
    s
}

/// A system prompt of a few hundred tokens, so the prompt spans many 16-token pages.
fn system() -> String {
    let facts: Vec<String> =
        (0..40).map(|i| format!("Fact {i}: the {} lamp is in room {}.", ["red", "blue", "green", "amber"][i % 4], 100 + i * 7)).collect();
    format!("You answer questions about a building. {}", facts.join(" "))
}

fn chat(s: &Server, key: Option<&str>, extra: Value, user: &str) -> (u16, Value) {
    let mut body = json!({
        "model": MODEL_ID, "temperature": 0, "max_tokens": 12,
        "messages": [{"role": "system", "content": system()}, {"role": "user", "content": user}],
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
    let r = support::request(&s.http, "POST", "/v1/chat/completions", &headers, &body.to_string());
    (r.status, serde_json::from_str(&r.body).unwrap_or(Value::String(r.body)))
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("usage.prompt_tokens_details.cached_tokens")
}

#[test]
fn keys_pick_tenants_and_a_cached_prefix_is_reused_only_within_one_tenant_and_salt() {
    let tenants = tenants_file();
    // The prefill worker's cache: a repeated prompt is not computed on the decode worker.
    let s = serve(&["--tenants", tenants.to_str().unwrap(), "--max-local-prefill-tokens", "0"]);

    // No key, an unknown key: 401 with an OpenAI error body, before anything else.
    for key in [None, Some("sk-nobody"), Some("")] {
        let (status, v) = chat(&s, key, json!({}), "Where is the red lamp?");
        assert_eq!(status, 401, "{key:?}: {v}");
        assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
    }
    assert_eq!(support::request(&s.http, "GET", "/health", &[], "").status, 200, "liveness needs no key");
    assert_eq!(support::request(&s.http, "GET", "/metrics/tenants", &[], "").status, 401, "the operator's page needs its key");
    // A bad salt: 400 naming it.
    for salt in [json!("x".repeat(257)), json!(7), json!(["a"])] {
        let (status, v) = chat(&s, Some(KEY_A), json!({ "cache_salt": salt }), "Where is the red lamp?");
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], "cache_salt", "{v}");
    }

    let q = "Where is the green lamp?";
    let (status, first) = chat(&s, Some(KEY_A), json!({}), q);
    assert_eq!(status, 200, "{first}");
    let prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 200, "the prompt spans many pages: {prompt}");
    assert_eq!(cached(&first), 0, "nothing was cached yet");

    // The same tenant again: every full page but the last position's is reused, and the
    // answer is the same bits as computed from scratch.
    let (_, again) = chat(&s, Some(KEY_A), json!({}), q);
    let want = (prompt - 1) / 16 * 16;
    assert_eq!(cached(&again), want, "{again}");
    assert_eq!(again["choices"][0]["message"]["content"], first["choices"][0]["message"]["content"]);

    // Another tenant, the same prompt: no hit. A salt splits the tenant's own cache.
    let (_, other) = chat(&s, Some(KEY_B), json!({}), q);
    assert_eq!(cached(&other), 0, "another tenant never hits: {other}");
    assert_eq!(other["choices"][0]["message"]["content"], first["choices"][0]["message"]["content"]);
    let (_, salted) = chat(&s, Some(KEY_A), json!({ "cache_salt": "project-x" }), q);
    assert_eq!(cached(&salted), 0, "another salt never hits: {salted}");
    // A tenant cannot name another's salt or tenant in the body: B with A's (absent) salt,
    // or any salt, stays in B's cache, which holds this prompt once now.
    let (_, b_again) = chat(&s, Some(KEY_B), json!({}), q);
    assert_eq!(cached(&b_again), want, "B hits what B cached");

    // Streaming usage carries it too.
    let body = json!({
        "model": MODEL_ID, "temperature": 0, "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true},
        "messages": [{"role": "system", "content": system()}, {"role": "user", "content": q}],
    });
    let auth = format!("Bearer {KEY_A}");
    let r = support::request(&s.http, "POST", "/v1/chat/completions", &[("Authorization", &auth)], &body.to_string());
    let usage = r
        .body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|v| v["usage"].is_object());
    let usage = usage.expect("a usage chunk");
    assert_eq!(cached(&usage), want, "{usage}");

    // The pool's own counters agree with what the responses said.
    let total = (3 * want) as f64;
    let prefill = [("role", "prefill")];
    assert_eq!(polled_sum(&s.http, "bulkhead:prefix_cache_hits_total", &prefill, total), total);
    let fence = [("check", "tenant_fence")];
    assert!(polled_sum(&s.http, "bulkhead:isolation_checks_total", &fence, 1.0) >= 1.0, "fence checks ran");
    assert_eq!(polled_sum(&s.http, "bulkhead:isolation_failures_total", &fence, 0.0), 0.0);
    assert!(support::pools_idle(&support::scrape(&s.http)), "every pool idle: free or cached pages only");
    // The public page tells nobody that a tenant repeated a prompt, nor how much was
    // shared: none of the cache activity is there (the operator's page has it, above).
    let public = support::scrape_public(&s.http);
    let cache_activity = [
        "bulkhead:prefix_cache_queries_total",
        "bulkhead:prefix_cache_hits_total",
        "bulkhead:prefix_cache_pages",
        "bulkhead:prefix_cache_stored_pages_total",
        "bulkhead:prefix_cache_evictions_total",
        "bulkhead:kv_cached_pages",
        "bulkhead:kv_free_pages",
        "bulkhead:kv_shared_leases",
        "bulkhead:kv_held_tokens_total",
        "bulkhead:kv_held_bytes_total",
        "bulkhead:kv_transferred_tokens_total",
        "bulkhead:local_prefill_tokens_total",
        "bulkhead:prefill_routing_total",
        "bulkhead:decode_routing_total",
    ];
    for name in cache_activity {
        assert!(!public.iter().any(|x| x.name == name), "{name} is on the public /metrics");
    }
    // How often the fence ran counts shared pages; its failures (the alarm) stay public.
    let fence_ran =
        |x: &support::Sample| x.name == "bulkhead:isolation_checks_total" && x.labels.get("check").is_some_and(|c| c == "tenant_fence");
    assert!(!public.iter().any(fence_ran), "the tenant-fence count is public");
    assert!(public.iter().any(|x| x.name == "bulkhead:kv_pool_pages"), "the public page still has the pools");
    let log = std::fs::read_to_string(&s.log).unwrap();
    assert!(log.contains("tenant=alpha") && log.contains("tenant=beta"), "the tenant is on the request's log lines");
    assert!(log.contains("prefix cache on"), "the start-up line says the cache is on");
    let _ = std::fs::remove_file(tenants);
}

fn conversation(s: &Server, key: &str, extra: Value, turns: &[(&str, Option<&str>)]) -> (u16, Value) {
    let mut messages = vec![json!({"role": "system", "content": system()})];
    for (user, answer) in turns {
        messages.push(json!({"role": "user", "content": user}));
        if let Some(a) = answer {
            messages.push(json!({"role": "assistant", "content": a}));
        }
    }
    let mut body = json!({ "model": MODEL_ID, "temperature": 0, "max_tokens": 24, "messages": messages });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    let auth = format!("Bearer {key}");
    let r = support::request(&s.http, "POST", "/v1/chat/completions", &[("Authorization", &auth)], &body.to_string());
    (r.status, serde_json::from_str(&r.body).unwrap_or(Value::String(r.body)))
}

/// A conversation's next turn: the decode worker kept the last turn's pages (prompt and
/// answer), so only the new part crosses from the prefill worker (the decode worker does
/// not compute it itself here: `--max-local-prefill-tokens 0`); the answer is the same
/// bits as a cold run's (another salt: nothing cached); another tenant's identical turn
/// holds nothing.
#[test]
fn a_conversations_next_turn_sends_only_what_is_new_and_answers_as_a_cold_run() {
    let tenants = tenants_file();
    let s = serve(&["--tenants", tenants.to_str().unwrap(), "--max-local-prefill-tokens", "0"]);
    let sum = |name: &str| support::sum(&support::scrape(&s.http), name, &[]);
    let q1 = "Where is the green lamp?";
    let (status, first) = conversation(&s, KEY_A, json!({}), &[(q1, None)]);
    assert_eq!(status, 200, "{first}");
    let a1 = first["choices"][0]["message"]["content"].as_str().expect("an answer").to_string();
    let p1 = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let sent_before = polled_sum(&s.http, "bulkhead:kv_transferred_tokens_total", &[], p1 as f64);
    assert_eq!(sent_before, p1 as f64, "the first turn sends its whole prompt");
    assert_eq!(sum("bulkhead:kv_held_tokens_total"), 0.0);
    // The decode worker published the first turn's full pages.
    assert!(polled_sum(&s.http, "bulkhead:prefix_cache_pages", &[("role", "decode")], 1.0) >= (p1 / 16) as f64);

    let turns = [(q1, Some(a1.as_str())), ("And the red one?", None)];
    let (status, second) = conversation(&s, KEY_A, json!({}), &turns);
    assert_eq!(status, 200, "{second}");
    let p2 = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let held = polled_sum(&s.http, "bulkhead:kv_held_tokens_total", &[], 1.0);
    assert!(held >= (p1 / 16 * 16) as f64, "the decode worker held at least the first turn's full prompt pages: {held} of {p2}");
    let sent = polled_sum(&s.http, "bulkhead:kv_transferred_tokens_total", &[], sent_before + 1.0) - sent_before;
    assert_eq!(held + sent, p2 as f64, "held and sent cover the prompt exactly once");
    let new = p2 - p1 - 24; // the new part: past the first turn's prompt and at most 24 answer tokens
    assert!(sent <= (new + 16 + 24) as f64, "only the new part crossed: {sent} of {p2} tokens (new: about {new})");
    assert_eq!(polled_sum(&s.http, "bulkhead:decode_routing_total", &[("by", "cache")], 1.0), 1.0);

    // The same turn cold (another salt: neither side holds anything): the same answer.
    let (_, cold) = conversation(&s, KEY_A, json!({ "cache_salt": "cold" }), &turns);
    assert_eq!(cold["choices"][0]["message"]["content"], second["choices"][0]["message"]["content"], "{cold}\n{second}");
    // Another tenant's identical conversation holds nothing of A's.
    let held_before = sum("bulkhead:kv_held_tokens_total");
    let (_, other) = conversation(&s, KEY_B, json!({}), &turns);
    assert_eq!(other["choices"][0]["message"]["content"], second["choices"][0]["message"]["content"]);
    assert_eq!(sum("bulkhead:kv_held_tokens_total"), held_before, "another tenant never holds A's pages");
    let fence = [("check", "tenant_fence")];
    assert_eq!(polled_sum(&s.http, "bulkhead:isolation_failures_total", &fence, 0.0), 0.0);
    assert!(support::pools_idle(&support::scrape(&s.http)), "every pool idle: free or cached pages only");
    let _ = std::fs::remove_file(tenants);
}

/// With the default `--max-local-prefill-tokens`, a conversation's next turn is computed by
/// the decode worker that holds the conversation: nothing crosses from a prefill worker,
/// held and computed tokens cover the prompt exactly once, `cached_tokens` counts what was
/// held, and the answer is the same bits as a cold run's (computed on the prefill worker,
/// transferred and verified). A miss, and another tenant's identical turn, still go
/// through a prefill worker.
#[test]
fn a_conversations_short_next_turn_is_computed_on_the_decode_worker_and_answers_as_a_cold_run() {
    let tenants = tenants_file();
    let s = serve(&["--tenants", tenants.to_str().unwrap()]);
    let sum = |name: &str| support::sum(&support::scrape(&s.http), name, &[]);
    let q1 = "Where is the blue lamp?";
    let (status, first) = conversation(&s, KEY_A, json!({}), &[(q1, None)]);
    assert_eq!(status, 200, "{first}");
    let a1 = first["choices"][0]["message"]["content"].as_str().expect("an answer").to_string();
    let p1 = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let sent_before = polled_sum(&s.http, "bulkhead:kv_transferred_tokens_total", &[], p1 as f64);
    assert_eq!(sent_before, p1 as f64, "a miss goes through the prefill worker");
    assert_eq!(sum("bulkhead:local_prefills_total"), 0.0);

    let turns = [(q1, Some(a1.as_str())), ("And the amber one?", None)];
    let (status, second) = conversation(&s, KEY_A, json!({}), &turns);
    assert_eq!(status, 200, "{second}");
    let p2 = second["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(polled_sum(&s.http, "bulkhead:local_prefills_total", &[], 1.0), 1.0, "the next turn was computed here");
    let held = sum("bulkhead:kv_held_tokens_total");
    let computed = sum("bulkhead:local_prefill_tokens_total");
    assert_eq!(sum("bulkhead:kv_transferred_tokens_total"), sent_before, "nothing crossed for the next turn");
    assert_eq!(held + computed, p2 as f64, "held and computed cover the prompt exactly once");
    assert!((1.0..=256.0).contains(&computed), "a short rest: {computed} of {p2}");
    assert_eq!(cached(&second), held as u64, "cached_tokens: what was not computed for it");

    // The same turn cold (another salt): computed by the prefill worker and sent.
    let (_, cold) = conversation(&s, KEY_A, json!({ "cache_salt": "cold" }), &turns);
    assert_eq!(cold["choices"][0]["message"]["content"], second["choices"][0]["message"]["content"], "{cold}\n{second}");
    assert_eq!(cached(&cold), 0);
    // Another tenant's identical conversation holds nothing of A's, so it is not computed there.
    let (_, other) = conversation(&s, KEY_B, json!({}), &turns);
    assert_eq!(other["choices"][0]["message"]["content"], second["choices"][0]["message"]["content"]);
    assert_eq!(sum("bulkhead:local_prefills_total"), 1.0, "another tenant's turn is never computed on A's prefix");
    let fence = [("check", "tenant_fence")];
    assert_eq!(polled_sum(&s.http, "bulkhead:isolation_failures_total", &fence, 0.0), 0.0);
    assert!(support::pools_idle(&support::scrape(&s.http)), "every pool idle: free or cached pages only");
    let _ = std::fs::remove_file(tenants);
}

#[test]
fn without_the_prefix_cache_nothing_is_reused_and_one_api_key_guards_the_api() {
    let s = serve(&["--no-prefix-cache", "--api-key", KEY_A]);
    let (status, v) = chat(&s, None, json!({}), "Where is the blue lamp?");
    assert_eq!((status, &v["error"]["code"]), (401, &json!("invalid_api_key")), "{v}");
    for _ in 0..2 {
        let (status, v) = chat(&s, Some(KEY_A), json!({}), "Where is the blue lamp?");
        assert_eq!(status, 200, "{v}");
        assert_eq!(cached(&v), 0, "{v}");
    }
    assert!(std::fs::read_to_string(&s.log).unwrap().contains("prefix cache off"));
}

/// A tenant's `max_concurrent_requests` and `tokens_per_minute` from the tenants file:
/// over them a request gets 429 with `Retry-After` and an error body naming the limit;
/// another tenant is served meanwhile; `priority` is accepted (an integer) or refused
/// naming it.
#[test]
fn a_tenant_over_its_limits_gets_429_naming_the_limit_and_another_tenant_is_served() {
    let path = std::env::temp_dir().join(format!("bulkhead-limits-{}-{}.toml", std::process::id(), rand_u64()));
    let text = format!(
        "[[tenant]]\nname = \"alpha\"\napi_keys = [\"{KEY_A}\"]\nmax_concurrent_requests = 1\ntokens_per_minute = 600\n\n\
         [[tenant]]\nname = \"beta\"\napi_keys = [\"{KEY_B}\"]\nweight = 2\n"
    );
    std::fs::write(&path, text).expect("tenants file");
    let s = serve(&["--tenants", path.to_str().unwrap(), "--admin-key", "op-key"]);
    let auth_a = format!("Bearer {KEY_A}");
    // A long answer keeps alpha's one slot busy.
    let long = json!({"model": MODEL_ID, "max_tokens": 200, "ignore_eos": true, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me a long story."}]});
    let http = s.http.clone();
    let (a, b) = (auth_a.clone(), long.to_string());
    let slow = std::thread::spawn(move || support::request(&http, "POST", "/v1/chat/completions", &[("Authorization", &a)], &b));
    std::thread::sleep(Duration::from_millis(300));
    let short = |key: &str, extra: Value| {
        let mut body = json!({"model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        let auth = format!("Bearer {key}");
        support::request(&s.http, "POST", "/v1/chat/completions", &[("Authorization", &auth)], &body.to_string())
    };
    let r = short(KEY_A, json!({}));
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(r.body.contains("concurrency_limit_exceeded") && r.body.contains("max_concurrent_requests is 1"), "{}", r.body);
    assert_eq!(r.headers.get("retry-after").map(String::as_str), Some("1"));
    let r = short(KEY_B, json!({ "priority": -5 }));
    assert_eq!(r.status, 200, "another tenant is served meanwhile: {}", r.body);
    let r = short(KEY_B, json!({ "priority": "high" }));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("\"param\":\"priority\""), "{}", r.body);
    assert_eq!(slow.join().expect("the long request").status, 200);
    // The long request was charged its prompt and 200 tokens, and used them: what is left
    // of 600 a minute does not cover another long one.
    let auth_a = format!("Bearer {KEY_A}");
    let r = support::request(&s.http, "POST", "/v1/chat/completions", &[("Authorization", &auth_a)], &long.to_string());
    let r = if r.status == 200 {
        support::request(&s.http, "POST", "/v1/chat/completions", &[("Authorization", &auth_a)], &long.to_string())
    } else {
        r
    };
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(r.body.contains("tokens_per_minute_exceeded"), "{}", r.body);
    let wait: u32 = r.headers.get("retry-after").and_then(|v| v.parse().ok()).expect("Retry-After");
    assert!(wait >= 1, "{wait}");
    // The per-tenant series are the operator's: its key only; tenant names, never keys.
    for key in [None, Some(KEY_A), Some("op-ke")] {
        let auth = key.map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
        assert_eq!(support::request(&s.http, "GET", "/metrics/tenants", &headers, "").status, 401, "{key:?}");
    }
    let page = support::request(&s.http, "GET", "/metrics/tenants", &[("Authorization", "Bearer op-key")], "");
    assert_eq!(page.status, 200, "{}", page.body);
    let samples = support::parse(&page.body).expect("the per-tenant page parses as Prometheus text");
    let refused = |code: &str| support::sum(&samples, "bulkhead:tenant_refusals_total", &[("tenant", "alpha"), ("code", code)]);
    assert_eq!(refused("concurrency_limit_exceeded"), 1.0, "{}", page.body);
    assert!(refused("tokens_per_minute_exceeded") >= 1.0, "{}", page.body);
    assert!(support::sum(&samples, "bulkhead:request_success_total", &[("tenant", "beta")]) >= 1.0, "{}", page.body);
    assert!(!page.body.contains(KEY_A) && !page.body.contains(KEY_B) && !page.body.contains("op-key"));
    assert!(!support::request(&s.http, "GET", "/metrics", &[], "").body.contains("tenant=\""), "/metrics stays cluster-wide");
    let _ = std::fs::remove_file(path);
}

/// `n = 4` on the decode side: the first sibling's prompt crosses once, its full pages are
/// published as soon as they are verified, and the three others, held back until then,
/// share them and compute only their partial last page on the decode worker. One copy of
/// the prompt's full pages in the decode pool, not four; the answers are the seeded ones.
#[test]
fn the_siblings_of_n_4_share_one_copy_of_their_prompt_on_the_decode_worker() {
    let tenants = tenants_file();
    let s = serve(&["--tenants", tenants.to_str().unwrap()]);
    let sum = |name: &str| support::sum(&support::scrape(&s.http), name, &[]);
    let extra = json!({ "n": 4, "temperature": 0.8, "seed": 7, "max_tokens": 16 });
    let (status, v) = chat(&s, Some(KEY_A), extra.clone(), "Where is the amber lamp?");
    assert_eq!(status, 200, "{v}");
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap() as f64;
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 4);
    let full = (prompt as u64 / 16 * 16) as f64;
    assert_eq!(polled_sum(&s.http, "bulkhead:kv_transferred_tokens_total", &[], prompt), prompt, "the prompt crossed once");
    assert_eq!(sum("bulkhead:kv_held_tokens_total"), 3.0 * full, "three siblings held its full pages");
    assert_eq!(sum("bulkhead:local_prefills_total"), 3.0);
    assert_eq!(sum("bulkhead:local_prefill_tokens_total"), 3.0 * (prompt - full), "and computed only their partial pages");
    let fence = [("check", "tenant_fence")];
    assert_eq!(polled_sum(&s.http, "bulkhead:isolation_failures_total", &fence, 0.0), 0.0);
    assert!(support::pools_idle(&support::scrape(&s.http)), "every pool idle: free or cached pages only");
    drop(s);
    // Without caches every sibling computes and receives the whole prompt: the same seeded
    // answers.
    let cold = serve(&["--tenants", tenants.to_str().unwrap(), "--no-prefix-cache"]);
    let (_, w) = chat(&cold, Some(KEY_A), extra, "Where is the amber lamp?");
    for i in 0..4 {
        assert_eq!(w["choices"][i]["message"]["content"], choices[i]["message"]["content"], "choice {i}");
    }
    let _ = std::fs::remove_file(tenants);
}
