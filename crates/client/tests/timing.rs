//! The prompt-cache timing audit against fake servers with a prefix cache: one shared by
//! every tenant (a leaky cache: a miss costs 30 ms, a hit nothing) and one keyed by the
//! API key (so tenant B never hits what tenant A sent).

mod support;

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bulkhead_client::timing::{self, TimingConfig, TimingMode};
use bulkhead_client::{Api, ClientError};
use support::{client, serve, stream};

/// What a cache miss costs the fake server: always exactly this, so two groups of misses
/// share one distribution and differ only by scheduling noise.
const MISS: Duration = Duration::from_millis(30);

/// A server whose prefix cache is keyed by the prompt alone (`keyed_by_tenant: false`) or
/// by the `Authorization` header and the prompt. Returns its URL and a count of cache hits.
async fn cache_server(keyed_by_tenant: bool) -> (String, Arc<AtomicUsize>) {
    let seen = Mutex::new(HashSet::new());
    let hits = Arc::new(AtomicUsize::new(0));
    let hits2 = hits.clone();
    let url = serve(move |req| {
        let prompt = req.body["prompt"].as_str().map_or_else(|| req.body["messages"].to_string(), str::to_string);
        let tenant = if keyed_by_tenant { req.header("authorization").unwrap_or_default() } else { String::new() };
        let hit = !seen.lock().unwrap().insert((tenant, prompt));
        if hit {
            hits2.fetch_add(1, Ordering::Relaxed);
        }
        let delay = if hit { Duration::ZERO } else { MISS };
        stream(delay, false, &["x"], serde_json::json!({"prompt_tokens": 300, "completion_tokens": 1}))
    })
    .await;
    (url, hits)
}

fn cfg(samples: usize, alpha: f64, same_tenant: bool) -> TimingConfig {
    TimingConfig { api: Api::Completions, model: Some("m".into()), samples, prompt_words: 300, alpha, same_tenant, seed: 17 }
}

#[tokio::test]
async fn a_prefix_cache_shared_across_tenants_is_distinguishable() {
    let (url, hits) = cache_server(false).await;
    let r = timing::run(&client(&url, "sk-a"), &client(&url, "sk-b"), &cfg(30, 0.01, false)).await.unwrap();
    assert!(r.distinguishable, "{r}");
    assert!(r.verdict.starts_with("DISTINGUISHABLE: cached prompts of the other tenant are measurably faster (p="), "{r}");
    assert_eq!((r.mode, r.cached.n, r.fresh.n, r.failed_requests), (TimingMode::CrossTenant, 30, 30, 0));
    assert_eq!(hits.load(Ordering::Relaxed), 30, "each of B's repeats hit A's entry");
    assert!(r.fresh.median_ms >= MISS.as_secs_f64() * 1e3, "{r}");
    assert!(r.cached.median_ms < r.fresh.median_ms && r.p_value < 1e-6, "{r}");
    assert!(r.warning.is_some(), "30 samples is below the recommended 100");
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["mode"], "cross-tenant");
    assert!(json["ks_d"].is_number() && json["p_value"].is_number() && json["cached"]["p90_ms"].is_number(), "{json}");
}

#[tokio::test]
async fn a_prefix_cache_keyed_by_tenant_is_not_distinguishable_across_tenants() {
    let (url, hits) = cache_server(true).await;
    // Both groups are misses of exactly MISS: one distribution. The samples of a pair are
    // taken back to back in random order, so whatever else slows the machine slows both
    // groups alike; under that null hypothesis p is (about) uniform, so a false
    // "distinguishable" at alpha 0.001 (which also needs the cached median lower) comes
    // about once in 2,000 runs.
    let r = timing::run(&client(&url, "sk-a"), &client(&url, "sk-b"), &cfg(30, 0.001, false)).await.unwrap();
    assert_eq!(hits.load(Ordering::Relaxed), 0, "B never reads A's entries");
    assert!(!r.distinguishable, "{r}");
    assert!(r.verdict.starts_with("not distinguishable at alpha=0.001"), "{r}");
    assert!(r.cached.median_ms >= MISS.as_secs_f64() * 1e3, "{r}");
    assert!(r.to_string().contains("mode cross-tenant"), "{r}");
}

#[tokio::test]
async fn the_same_tenant_control_sees_a_cache_keyed_by_tenant() {
    let (url, hits) = cache_server(true).await;
    let r = timing::run(&client(&url, "sk-a"), &client(&url, "sk-b"), &cfg(30, 0.01, true)).await.unwrap();
    assert_eq!(r.mode, TimingMode::SameTenant);
    assert_eq!(hits.load(Ordering::Relaxed), 30);
    assert!(r.distinguishable, "{r}");
    assert!(r.verdict.contains("of the same tenant"), "{r}");
    assert!(r.to_string().contains("mode same-tenant"), "{r}");
}

#[tokio::test]
async fn failing_requests_stop_the_audit_with_an_error() {
    let url = serve(|_| support::error(500, "engine down")).await;
    match timing::run(&client(&url, "sk-a"), &client(&url, "sk-b"), &cfg(30, 0.01, false)).await {
        Err(ClientError::TooManyFailures { failed, last }) => {
            assert_eq!(failed, timing::MAX_FAILURES);
            assert!(last.contains("HTTP 500") && last.contains("engine down"), "{last}");
        }
        other => panic!("expected TooManyFailures, got {other:?}"),
    }
}
