//! The multi-turn scenario against a fake chat server that answers first turns slowly and
//! later turns at once, and reports a share of each prompt as cached.

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bulkhead_client::multiturn::{self, MultiTurnConfig};
use serde_json::{Value, json};
use support::{client, serve, stream};

/// The requests the fake server saw: the `Authorization` header and the messages.
type Seen = Arc<Mutex<Vec<(String, Vec<Value>)>>>;

/// The first turn's wait for its first token.
const FIRST_TURN: Duration = Duration::from_millis(40);

fn words(messages: &[Value]) -> u64 {
    messages.iter().map(|m| m["content"].as_str().unwrap_or("").split(' ').count() as u64).sum()
}

#[tokio::test]
async fn conversations_grow_turn_by_turn_and_cached_tokens_are_summed() {
    let seen: Seen = Arc::default();
    let seen2 = seen.clone();
    let url = serve(move |req| {
        assert_eq!(req.path(), "/v1/chat/completions");
        assert_eq!(req.body["stream_options"]["include_usage"], true);
        let messages = req.body["messages"].as_array().cloned().unwrap_or_default();
        seen2.lock().unwrap().push((req.header("authorization").unwrap_or_default(), messages.clone()));
        // Prompt tokens: the words; cached: all but the new user message, reported from
        // the second turn on (first turns leave the field out: it counts as 0).
        let first = messages.len() == 2;
        let mut usage = json!({"prompt_tokens": words(&messages), "completion_tokens": 2});
        if !first {
            usage["prompt_tokens_details"] = json!({"cached_tokens": words(&messages[..messages.len() - 1])});
        }
        stream(if first { FIRST_TURN } else { Duration::ZERO }, true, &["o", "k"], usage)
    })
    .await;
    let cfg = MultiTurnConfig {
        model: "m".into(),
        tenants: 2,
        conversations: 3,
        turns: 3,
        system_prompt_words: 40,
        output_tokens: "2".parse().unwrap(),
        concurrency: None,
        seed: 5,
        ignore_eos: true,
        stream: true,
        temperature: 0.0,
    };
    let clients = [client(&url, "sk-0"), client(&url, "sk-1")];
    let r = multiturn::run(&clients, &cfg).await.unwrap();
    assert_eq!((r.requests, r.tally.ok, r.tally.failed, r.skipped_turns), (18, 18, 0, 0), "{r}");
    assert_eq!((r.concurrency, r.tally.output_tokens), (6, 36));

    let seen = seen.lock().unwrap();
    let mut systems: HashMap<String, Vec<String>> = HashMap::new();
    let (mut prompt, mut cached) = (0, 0);
    for (auth, messages) in seen.iter() {
        assert!(matches!(auth.as_str(), "Bearer sk-0" | "Bearer sk-1"), "{auth}");
        assert_eq!(messages.len() % 2, 0, "system, then user/assistant pairs, ending with a user message");
        let roles: Vec<&str> = messages.iter().map(|m| m["role"].as_str().unwrap_or("")).collect();
        assert_eq!(roles[0], "system");
        for (i, role) in roles.iter().enumerate().skip(1) {
            assert_eq!(*role, if i % 2 == 1 { "user" } else { "assistant" }, "{roles:?}");
            if *role == "assistant" {
                assert_eq!(messages[i]["content"], "ok", "the previous answer is sent back");
            }
        }
        systems.entry(auth.clone()).or_default().push(messages[0]["content"].as_str().unwrap_or("").to_string());
        prompt += words(messages);
        if messages.len() > 2 {
            cached += words(&messages[..messages.len() - 1]);
        }
    }
    let per_turn = |t: usize| seen.iter().filter(|(_, m)| m.len() == 2 * t).count();
    assert_eq!((per_turn(1), per_turn(2), per_turn(3)), (6, 6, 6));
    let (a, b) = (&systems["Bearer sk-0"], &systems["Bearer sk-1"]);
    assert!(a.iter().all(|s| s == &a[0]) && b.iter().all(|s| s == &b[0]), "one system prompt per tenant");
    assert_ne!(a[0], b[0], "tenants have different system prompts");

    assert_eq!((r.tally.prompt_tokens, r.cached_tokens), (prompt, cached));
    assert_eq!((r.tally.responses_with_usage, r.responses_with_cached_tokens), (18, 12));
    assert!(r.cached_share.is_some_and(|s| s > 0.0 && s < 1.0), "{r}");
    let turns: Vec<(usize, usize)> = r.ttft_by_turn.iter().map(|t| (t.turn, t.n)).collect();
    assert_eq!(turns, [(1, 6), (2, 6), (3, 6)]);
    let (first, later) = (r.ttft_first_turn_p50_ms.unwrap(), r.ttft_later_turns_p50_ms.unwrap());
    assert!(first >= FIRST_TURN.as_secs_f64() * 1e3 && later < first, "{r}");
    assert_eq!(r.tally.ttft_ms.map(|s| s.count), Some(18));
    let json = serde_json::to_value(&r).unwrap();
    assert!(json["itl_ms"]["p99"].is_number() && json["ttft_ms"]["p90"].is_number() && json["cached_tokens"].is_number(), "{json}");
    // What scripts/bench-multiturn.sh reads, at the top level.
    for key in ["ok", "requests", "output_tokens_per_s", "ttft_first_turn_p50_ms", "ttft_later_turns_p50_ms", "cached_share"] {
        assert!(json[key].is_number(), "{key} in {json}");
    }
}

#[tokio::test]
async fn a_failed_turn_ends_its_conversation_and_the_rest_are_skipped() {
    // Second turns fail: each conversation sends two requests and skips its third turn.
    let url = serve(|req| {
        let n = req.body["messages"].as_array().map_or(0, Vec::len);
        if n == 4 {
            return support::error(503, "overloaded");
        }
        stream(Duration::ZERO, true, &["hi"], json!({"prompt_tokens": 10, "completion_tokens": 1}))
    })
    .await;
    let cfg = MultiTurnConfig {
        model: "m".into(),
        tenants: 1,
        conversations: 2,
        turns: 3,
        system_prompt_words: 10,
        output_tokens: "1".parse().unwrap(),
        concurrency: Some(1),
        seed: 1,
        ignore_eos: true,
        stream: true,
        temperature: 0.0,
    };
    let r = multiturn::run(&[client(&url, "k")], &cfg).await.unwrap();
    assert_eq!((r.requests, r.tally.ok, r.tally.failed, r.skipped_turns, r.concurrency), (4, 2, 2, 2, 1), "{r}");
    assert_eq!(r.tally.failures.errors.get("http_503"), Some(&2));
    assert_eq!(r.cached_tokens, 0, "absent cached_tokens count as 0");
    assert!(r.tally.failures.error_examples.iter().all(|e| e == "overloaded"), "{r}");
}
