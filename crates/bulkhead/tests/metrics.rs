//! `/metrics`, `traceparent`, `/health` and `/ready` on a real `bulkhead serve`: traffic
//! moves the evidence counters (I6), the exposition parses, and a request's trace id comes
//! back to the client and reaches the workers' log lines.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use support::{MODEL_ID, Server, parse, request, sum};
/// KV bytes per token of the default model in the transfer layout (f16).
const KV_BYTES_PER_TOKEN: f64 = 23_040.0;

/// A short context keeps the pools small and the over-context prompt cheap.
fn serve() -> Server {
    Server::start(&["--context-length", "512"], &[])
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

#[test]
fn traffic_moves_the_evidence_counters_and_the_trace_id_travels_to_the_workers() {
    let s = serve();
    // Liveness holds from the start; readiness once a prefill and a decode worker registered.
    let health = request(&s.http, "GET", "/health", &[], "");
    assert_eq!(health.status, 200, "{}", health.body);
    let deadline = Instant::now() + Duration::from_secs(30);
    while request(&s.http, "GET", "/ready", &[], "").status != 200 {
        assert!(Instant::now() < deadline, "never ready: {}", s.logs());
        std::thread::sleep(Duration::from_millis(50));
    }

    // One normal request inside the client's trace.
    let traceparent = format!("00-{TRACE}-00f067aa0ba902b7-01");
    let body = serde_json::json!({"model": MODEL_ID, "prompt": "The sea is", "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let r = request(
        &s.http,
        "POST",
        "/v1/completions",
        &[("traceparent", &traceparent), ("x-request-id", "metrics-test-1")],
        &body.to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers.get("x-request-id").map(String::as_str), Some("metrics-test-1"));
    let back = r.headers.get("traceparent").cloned().unwrap_or_default();
    assert!(back.starts_with(&format!("00-{TRACE}-")) && back.ends_with("-01"), "trace continued: {back:?}");
    assert_ne!(back, traceparent, "the gateway's own span id");

    // One request over the 512-token context: refused at the gateway.
    let long = "word ".repeat(600);
    let body = serde_json::json!({"model": MODEL_ID, "prompt": long, "max_tokens": 4});
    let r = request(&s.http, "POST", "/v1/completions", &[], &body.to_string());
    assert_eq!(r.status, 400, "{}", r.body);

    // A malformed traceparent is ignored (a new trace), never an error.
    let r = request(&s.http, "GET", "/v1/models", &[("traceparent", "00-not-a-trace")], "");
    assert_eq!(r.status, 200, "{}", r.body);
    let fresh = r.headers.get("traceparent").cloned().unwrap_or_default();
    assert!(fresh.len() == 55 && fresh.starts_with("00-") && !fresh.contains("not-a-trace"), "{fresh:?}");

    // Garbage on the gateway's worker port closes that connection, and is counted.
    let mut g = TcpStream::connect(&s.workers).expect("connect to the worker port");
    g.write_all(b"GET / HTTP/1.1\r\n\r\n").expect("send garbage");
    let _ = g.read_to_end(&mut Vec::new());
    let bad = [("worker", "gateway"), ("role", "gateway")];

    // Workers report every 500 ms and when a request ends on them; allow a few reports.
    let decode = [("worker", "decode-0"), ("role", "decode")];
    let prefill = [("worker", "prefill-0"), ("role", "prefill")];
    let deadline = Instant::now() + Duration::from_secs(5);
    let (m, samples) = loop {
        let m = request(&s.http, "GET", "/metrics", &[], "");
        assert_eq!(m.status, 200, "{}", m.body);
        let samples = parse(&m.body).unwrap_or_else(|e| panic!("not Prometheus text: {e}\n{}", m.body));
        let sent = sum(&samples, "bulkhead:kv_transfer_bytes_total", &prefill);
        let closed = sum(&samples, "bulkhead:bad_connections_total", &bad);
        if (sent > 0.0 && closed > 0.0) || Instant::now() > deadline {
            break (m, samples);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let text = &m.body;
    assert_eq!(m.headers.get("content-type").map(String::as_str), Some("text/plain; version=0.0.4; charset=utf-8"));
    let get = |name: &str, labels: &[(&str, &str)]| sum(&samples, name, labels);
    let checks = "bulkhead:isolation_checks_total";
    let failures = "bulkhead:isolation_failures_total";

    // The checks ran, on the worker that runs them, and none failed.
    for check in ["chunk_verified", "checksum", "coverage", "lease", "generation"] {
        assert!(get(checks, &[&decode[..], &[("check", check)]].concat()) > 0.0, "{check} ran on decode:\n{text}");
    }
    assert_eq!(get(checks, &[&decode[..], &[("check", "coverage")]].concat()), 1.0, "one transfer verified:\n{text}");
    assert_eq!(
        get(checks, &[&decode[..], &[("check", "checksum")]].concat()),
        get(checks, &[&decode[..], &[("check", "chunk_verified")]].concat()),
        "every verified chunk had its checksum checked"
    );
    assert!(get(checks, &[&prefill[..], &[("check", "lease")]].concat()) > 0.0, "{text}");
    assert_eq!(get(failures, &[]), 0.0, "{text}");

    // Admission: the over-context request was refused at the gateway.
    assert_eq!(get("bulkhead:rejected_admissions_total", &[("where", "gateway"), ("reason", "context_length")]), 1.0, "{text}");

    // Requests, tokens, latencies.
    let prompt_tokens = get("bulkhead:prompt_tokens_total", &[]);
    assert!(prompt_tokens > 0.0, "{text}");
    assert_eq!(get("bulkhead:generation_tokens_total", &[]), 6.0, "{text}");
    assert_eq!(get("bulkhead:request_success_total", &[("finished_reason", "length")]), 1.0, "{text}");
    assert_eq!(get("bulkhead:time_to_first_token_seconds_count", &[]), 1.0, "{text}");
    assert_eq!(get("bulkhead:time_to_first_token_seconds_bucket", &[("le", "+Inf")]), 1.0, "{text}");
    assert_eq!(get("bulkhead:inter_token_latency_seconds_count", &[]), 5.0, "{text}");
    // One request of six tokens: one time per output token, the mean of its five gaps.
    assert_eq!(get("bulkhead:time_per_output_token_seconds_count", &[]), 1.0, "{text}");
    let tpot = get("bulkhead:time_per_output_token_seconds_sum", &[]);
    let itl = get("bulkhead:inter_token_latency_seconds_sum", &[]);
    assert!(tpot > 0.0 && (tpot * 5.0 - itl).abs() <= 0.05 * itl + 0.001, "TPOT {tpot} s against gaps {itl} s: {text}");
    assert_eq!(get("bulkhead:e2e_request_latency_seconds_count", &[]), 1.0, "{text}");
    assert!(get("bulkhead:e2e_request_latency_seconds_sum", &[]) > 0.0, "{text}");
    assert_eq!(get("bulkhead:num_requests_running", &[]) + get("bulkhead:num_requests_waiting", &[]), 0.0, "{text}");

    // The KV handoff: what prefill sent is what decode received, the prompt's KV exactly.
    let received = get("bulkhead:kv_transfer_bytes_total", &decode);
    assert_eq!(received, prompt_tokens * KV_BYTES_PER_TOKEN, "{text}");
    assert_eq!(get("bulkhead:kv_transfer_bytes_total", &prefill), received, "{text}");
    assert!(get("bulkhead:kv_transfer_seconds_count", &prefill) >= 1.0, "{text}");

    // Pools: everything back, nothing quarantined, on both workers.
    for w in [&decode, &prefill] {
        assert!(get("bulkhead:kv_pool_pages", w) > 0.0, "{text}");
        assert_eq!(get("bulkhead:kv_cache_usage_perc", w), 0.0, "{text}");
        assert_eq!(get("bulkhead:quarantined_pages", w), 0.0, "{text}");
    }
    assert_eq!(get("bulkhead:workers", &[("role", "prefill")]), 1.0, "{text}");
    assert_eq!(get("bulkhead:workers", &[("role", "decode")]), 1.0, "{text}");
    assert_eq!(get("bulkhead:bad_connections_total", &bad), 1.0, "{text}");

    // The trace id is on the workers' log lines about the request.
    let logs = s.logs();
    for what in ["prefill done", "decode finished"] {
        let line = logs.lines().find(|l| l.contains(what)).unwrap_or_else(|| panic!("no {what:?} line:\n{logs}"));
        assert!(line.contains(TRACE) && line.contains("metrics-test-1"), "{line}");
    }
}

#[test]
fn the_parser_in_this_test_refuses_what_prometheus_would() {
    assert!(parse("# TYPE a counter\na 1\n").is_ok());
    for bad in [
        "a 1\n",                                               // no TYPE
        "# TYPE a counter\nb 1\n",                             // outside its family
        "# TYPE a counter\na{x=\"1} 1\n",                      // unterminated
        "# TYPE a counter\na{x=\"1\",x=\"2\"} 1\n",            // repeated label
        "# TYPE a counter\na one\n",                           // not a number
        "# TYPE a counter\n# TYPE a counter\n",                // declared twice
        "# TYPE a histogram\na_bucket{le=\"1\"} 1\nb_sum 1\n", // not the histogram's
    ] {
        assert!(parse(bad).is_err(), "{bad:?}");
    }
}
