//! Open-loop load against a scripted local server: a sweep whose every request meets the
//! SLOs, one that fails half its requests, and two tenants of which one is slow.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bulkhead_client::Api;
use bulkhead_client::loadgen::LoadgenConfig;
use bulkhead_client::openloop::{self, GoodputKind, OpenLoopConfig};
use bulkhead_client::report::Slo;
use support::{Script, client, error, serve, stream};

fn cfg(points: Vec<Vec<f64>>, max_requests: u64) -> OpenLoopConfig {
    OpenLoopConfig {
        requests: LoadgenConfig {
            api: Api::Completions,
            model: "m".into(),
            concurrency: 1,
            requests: None,
            duration: None,
            prompt_tokens: "8".parse().unwrap(),
            output_tokens: "4".parse().unwrap(),
            seed: 11,
            ignore_eos: true,
            stream: true,
            temperature: 0.0,
            warmup: 2,
        },
        points,
        max_requests: Some(max_requests),
        window: Some(Duration::from_secs(10)),
        min_requests: None,
        max_in_flight: 64,
        slos: vec![Slo { ttft_ms: 150.0, tpot_ms: 50.0 }, Slo { ttft_ms: 5.0, tpot_ms: 50.0 }],
        stop_below: None,
        label: "fake".into(),
    }
}

/// Four tokens, the first after `first`, then 5 ms apart.
fn answer(first: Duration) -> Script {
    let mut s = stream(first, false, &["a", "b", "c", "d"], serde_json::json!({"prompt_tokens": 8, "completion_tokens": 4}));
    for step in s.iter_mut().skip(2).take(3) {
        step.0 = Duration::from_millis(5);
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_that_meets_its_slos_reports_goodput_as_a_lower_bound() {
    let url = serve(|_| answer(Duration::from_millis(20))).await;
    let c = client(&url, "k");
    let mut seen = Vec::new();
    let r = openloop::run(&[c], &cfg(vec![vec![40.0], vec![80.0]], 20), |p| seen.push(p.rate)).await.unwrap();
    assert_eq!(seen, vec![40.0, 80.0], "progress sees each point in order");
    assert_eq!(r.points.len(), 2);
    assert_eq!(r.requests.len(), 40);
    for p in &r.points {
        assert_eq!((p.sent, p.tally.ok, p.tally.failed), (20, 20, 0));
        assert_eq!(p.tally.attainment[0].both, 1.0, "{p:?}");
        assert_eq!(p.tally.attainment[1].both, 0.0, "a 5 ms TTFT SLO is missed by every request");
        let tpot = p.tally.tpot_ms.unwrap();
        assert!(tpot.p50 >= 4.0 && tpot.p50 < 40.0, "{tpot:?}");
        assert!(p.tenants.is_empty());
    }
    assert_eq!(r.goodput[0].kind, GoodputKind::AtLeastHighestRate);
    assert_eq!(r.goodput[0].rate, 80.0);
    assert_eq!(r.goodput[1].kind, GoodputKind::BelowLowestRate);
    assert_eq!(r.goodput[1].rate, 0.0);
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["mode"], "open-loop");
    assert_eq!(json["requests"].as_array().unwrap().len(), 40);
    assert!(json["requests"][0]["tpot_ms"].is_number());
    let text = r.to_string();
    assert!(text.contains("goodput, SLO 1") && text.contains("at least 80 req/s"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_requests_meet_no_slo() {
    static N: AtomicU64 = AtomicU64::new(0);
    let url =
        serve(|_| if N.fetch_add(1, Ordering::Relaxed).is_multiple_of(2) { error(503, "busy") } else { answer(Duration::ZERO) }).await;
    let mut c = cfg(vec![vec![50.0]], 40);
    c.requests.warmup = 0;
    let r = openloop::run(&[client(&url, "k")], &c, |_| {}).await.unwrap();
    let p = &r.points[0];
    assert_eq!((p.tally.ok, p.tally.failed, p.tally.failures.errors.get("http_503")), (20, 20, Some(&20)));
    assert_eq!(p.tally.attainment[0].both, 0.5);
    assert_eq!(r.goodput[0].kind, GoodputKind::BelowLowestRate);
    assert!(r.goodput[0].note.contains("goodput 0"), "{}", r.goodput[0].note);
    // With a floor above every pair's attainment, a sweep ends after its first point.
    c.points = vec![vec![50.0], vec![60.0]];
    c.stop_below = Some(0.6);
    let r = openloop::run(&[client(&url, "k")], &c, |_| {}).await.unwrap();
    assert_eq!(r.points.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_judged_apart() {
    let url = serve(|req| {
        let slow = req.header("authorization").is_some_and(|a| a.ends_with("slow"));
        answer(Duration::from_millis(if slow { 300 } else { 10 }))
    })
    .await;
    let clients = [client(&url, "fast"), client(&url, "slow")];
    let mut c = cfg(vec![vec![60.0, 20.0]], 1000);
    c.window = Some(Duration::from_millis(700));
    let r = openloop::run(&clients, &c, |_| {}).await.unwrap();
    let p = &r.points[0];
    assert_eq!(p.rate, 80.0);
    assert_eq!(p.tenants.len(), 2);
    assert!(p.tenants[0].sent > p.tenants[1].sent && p.tenants[1].sent > 0, "{:?}", p.tenants);
    assert_eq!(p.tenants[0].tally.attainment[0].both, 1.0);
    assert_eq!(p.tenants[1].tally.attainment[0].both, 0.0, "300 ms TTFT misses 150 ms");
    assert!(r.goodput.is_empty(), "no goodput for a multi-tenant point");
    assert!(r.requests.iter().all(|q| q.arrival_s < 0.7));
    // What scripts/bench-noisy.sh reads of a point and its tenants.
    let json = serde_json::to_value(&r).unwrap();
    let t = &json["points"][0]["tenants"][1];
    assert!(t["sent"].is_number() && t["ok"].is_number() && t["attainment"][0]["tpot"].is_number(), "{t}");
}

#[tokio::test]
async fn bad_settings_are_refused_before_sending() {
    let c = client("http://127.0.0.1:9", "k");
    for broken in [
        OpenLoopConfig { points: vec![], ..cfg(vec![], 1) },
        OpenLoopConfig { points: vec![vec![0.0]], ..cfg(vec![], 1) },
        OpenLoopConfig { points: vec![vec![1.0, 1.0]], ..cfg(vec![], 1) },
        OpenLoopConfig { slos: vec![], ..cfg(vec![vec![1.0]], 1) },
        OpenLoopConfig { max_requests: None, window: None, ..cfg(vec![vec![1.0]], 1) },
        OpenLoopConfig { window: None, min_requests: Some(1), ..cfg(vec![vec![1.0]], 1) },
        OpenLoopConfig { min_requests: Some(2), ..cfg(vec![vec![1.0]], 1) },
        OpenLoopConfig { min_requests: Some(0), ..cfg(vec![vec![1.0]], 1) },
    ] {
        assert!(openloop::run(std::slice::from_ref(&c), &broken, |_| {}).await.is_err());
    }
    let mut no_stream = cfg(vec![vec![1.0]], 1);
    no_stream.requests.stream = false;
    assert!(openloop::run(&[c], &no_stream, |_| {}).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_least_count_holds_a_low_rates_window_open_and_the_drawn_rate_counts_its_time() {
    let url = serve(|_| answer(Duration::ZERO)).await;
    let mut c = cfg(vec![vec![40.0]], 1000);
    (c.window, c.min_requests, c.requests.warmup) = (Some(Duration::from_millis(20)), Some(12), 0);
    let r = openloop::run(&[client(&url, "k")], &c, |_| {}).await.unwrap();
    let p = &r.points[0];
    assert_eq!(p.sent, 12, "the window stayed open for the least count");
    let last = r.requests.iter().map(|q| q.arrival_s).fold(0.0, f64::max);
    assert!(last > 0.02, "{last}");
    // Over the time to the last arrival, not the 20 ms window the count outlasted.
    assert!((p.arrival_rate - 12.0 / last).abs() < 1e-6, "{} vs {}", p.arrival_rate, 12.0 / last);
}
