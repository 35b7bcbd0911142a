//! `bulkhead probe` end to end: clean against `bulkhead serve` (exit 0), and exit 2 with
//! findings against a server that answers everything with 200, as the incident's did.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use support::{BIN, model, request};

/// A running `bulkhead serve`, killed (with its workers) on drop.
struct Server {
    child: Child,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `bulkhead serve` on a free port with a small context, ready for requests.
fn serve(context: &str) -> Server {
    let mut child = Command::new(BIN)
        // A pool of several contexts, so eight requests at once are not shed for capacity.
        .args(["serve", "--port", "0", "--threads", "1", "--context-length", context, "--kv-pool-tokens", "6144", "--model"])
        .arg(model())
        .env("BULKHEAD_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn bulkhead serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("serve prints its address");
    let addr = line.split("http://").nth(1).and_then(|r| r.split_whitespace().next()).map(str::to_string);
    let Some(addr) = addr else {
        let _ = child.kill();
        panic!("serve did not start: {line:?}");
    };
    let s = Server { child, url: format!("http://{addr}") };
    for _ in 0..300 {
        if request(&addr, "GET", "/ready", &[], "").status == 200 {
            return s;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("server never became ready");
}

fn probe(url: &str, extra: &[&str]) -> (Option<i32>, Value, String) {
    let out = Command::new(BIN)
        .args(["probe", url, "--json", "--rounds", "1", "--long-words", "250", "--short-words", "12", "--seed", "7"])
        .args(["--disconnect-max-ms", "300", "--read-timeout-s", "60"])
        .args(extra)
        .env("BULKHEAD_LOG", "warn")
        .output()
        .expect("run bulkhead probe");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let report = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("no JSON report ({e}): {stderr}"));
    (out.status.code(), report, stderr)
}

#[test]
fn the_probe_finds_nothing_against_bulkhead_serve_and_exits_0() {
    let s = serve("640");
    let (code, r, stderr) = probe(&s.url, &[]);
    assert_eq!(r["findings"], serde_json::json!([]), "{r:#}\n{stderr}");
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!((r["context"].as_u64(), r["context_source"].as_str()), (Some(640), Some("/v1/models")));
    assert_eq!(r["requests"]["over-context"]["statuses"]["400"], 1, "{r:#}");
    assert!(r["codes_planted"]["A"].as_u64() >= Some(3) && r["codes_planted"]["B"].as_u64() >= Some(3), "{r:#}");
    let fc = &r["fact_check"];
    assert!(fc["samples"].as_u64() == Some(2) && fc["passed"] == fc["samples"], "both long prompts repeat their code: {fc}");
}

/// A server that answers every completion with 200 and the same text, and says its context
/// is 256 tokens: over-context prompts accepted, long inputs ignored.
fn yes_server() -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { continue };
            std::thread::spawn(move || {
                let mut req = Vec::new();
                let mut buf = [0u8; 8192];
                // Read the head and the whole body (Content-Length), then answer.
                loop {
                    let n = c.read(&mut buf).unwrap_or(0);
                    req.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&req);
                    let Some(i) = text.find("\r\n\r\n") else { if n == 0 { return } else { continue } };
                    let len: usize = text
                        .lines()
                        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").and_then(|v| v.trim().parse().ok()))
                        .unwrap_or(0);
                    if req.len() >= i + 4 + len || n == 0 {
                        break;
                    }
                }
                let answer = if req.starts_with(b"GET /v1/models") {
                    let body = r#"{"object":"list","data":[{"id":"yes","object":"model","max_model_len":256}]}"#;
                    format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len())
                } else {
                    let chunk = r#"{"choices":[{"index":0,"text":" the sea is calm","finish_reason":"stop"}]}"#;
                    format!("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: {chunk}\n\ndata: [DONE]\n\n")
                };
                let _ = c.write_all(answer.as_bytes());
            });
        }
    });
    url
}

#[test]
fn a_server_that_accepts_over_context_prompts_and_ignores_long_inputs_fails_the_probe_with_exit_2() {
    let (code, r, stderr) = probe(&yes_server(), &[]);
    assert_eq!(code, Some(2), "{r:#}\n{stderr}");
    let kinds: Vec<&str> = r["findings"].as_array().expect("findings").iter().filter_map(|f| f["finding"].as_str()).collect();
    assert!(kinds.contains(&"over-context-not-rejected"), "{kinds:?}");
    assert!(kinds.contains(&"fact-ignored"), "{kinds:?}");
    assert!(!kinds.contains(&"leak"), "{kinds:?}");
}
