//! `bulkhead serve` as users run it: real processes, real TCP, the OpenAI API over HTTP.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use support::{BIN, MODEL_ID, Server, model, rand_u64};

#[path = "../../model/tests/support/mod.rs"]
mod model_support;

fn serve(args: &[&str], env: &[(&str, &str)]) -> Server {
    serve_model(&model(), args, env)
}

fn serve_model(model: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Server {
    let s = Server::start_model(model, args, env);
    s.wait_ready();
    s
}

fn request(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let r = support::request(addr, method, path, &[], body);
    (r.status, r.body)
}

fn get(addr: &str, path: &str) -> (u16, String) {
    request(addr, "GET", path, "")
}

fn chat(addr: &str, system: &str, user: &str, max_tokens: usize) -> (u16, serde_json::Value) {
    let body = serde_json::json!({
        "model": MODEL_ID, "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    });
    let (status, b) = request(addr, "POST", "/v1/chat/completions", &body.to_string());
    (status, serde_json::from_str(&b).unwrap_or(serde_json::Value::String(b)))
}

fn content(v: &serde_json::Value) -> String {
    v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string()
}

const SYSTEM: &str = "You are a helpful assistant.";
/// The last one is copied: `serve` speculates by default and `generate` does not, so the
/// answers agreeing shows speculation changes no text.
const PROMPTS: [&str; 4] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Repeat exactly: the quick brown fox jumps over the lazy dog, and the lazy dog sleeps on.",
];

fn generate(user: &str) -> String {
    let out = Command::new(BIN)
        .args(["generate", "--threads", "1", "--max-tokens", "32", "--system", SYSTEM, "--prompt", user, "--model"])
        .arg(model())
        .output()
        .expect("generate");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim_end_matches('\n').to_string()
}

#[test]
fn greedy_output_through_serve_equals_generate_alone_and_while_sharing_the_batch() {
    let want: Vec<String> = PROMPTS.iter().map(|p| generate(p)).collect();
    let s = serve(&[], &[]);
    for (p, w) in PROMPTS.iter().zip(&want) {
        let (status, v) = chat(&s.http, SYSTEM, p, 32);
        assert_eq!(status, 200, "{v}");
        assert_eq!(&content(&v), w, "alone: {p}");
    }
    let accepted = support::sum(&support::scrape(&s.http), "bulkhead:spec_decode_num_accepted_tokens_total", &[]);
    assert!(accepted > 0.0, "the copied answer had no draft accepted: the comparison shows nothing about speculation");
    // All at once, plus unrelated load, so they share decode steps.
    let addr = s.http.clone();
    let load: Vec<_> = (0..3)
        .map(|i| {
            let a = addr.clone();
            std::thread::spawn(move || chat(&a, SYSTEM, &format!("Count to {}.", 10 + i), 40))
        })
        .collect();
    let mine: Vec<_> = PROMPTS
        .iter()
        .map(|p| {
            let a = addr.clone();
            let p = p.to_string();
            std::thread::spawn(move || chat(&a, SYSTEM, &p, 32))
        })
        .collect();
    for (h, w) in mine.into_iter().zip(&want) {
        let (status, v) = h.join().unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(&content(&v), w, "in a shared batch");
    }
    for h in load {
        assert_eq!(h.join().unwrap().0, 200);
    }
}

/// `--cluster-encryption on` encrypts even the loopback connections of role all: every
/// connection says so in its log line, and the answer is the same bits as in-process.
#[test]
fn forced_encryption_on_loopback_serves_the_same_greedy_answer() {
    let want = generate(PROMPTS[0]);
    let s = serve(&["--cluster-encryption", "on"], &[]);
    let (status, v) = chat(&s.http, SYSTEM, PROMPTS[0], 32);
    assert_eq!(status, 200, "{v}");
    assert_eq!(content(&v), want);
    let log = std::fs::read_to_string(&s.log).unwrap();
    for line in ["worker connection authenticated", "KV connection open", "KV connection from a prefill worker"] {
        let found: Vec<&str> = log.lines().filter(|l| l.contains(line)).collect();
        assert!(!found.is_empty() && found.iter().all(|l| l.contains("encrypted=true")), "{line}: {found:?}\n{log}");
    }
}

/// A man in the middle of the KV connection: forwards both directions, but flips the last
/// byte of the first `KvChunk` it sees (kind 9; after the two untagged handshake frames
/// from the prefill side, every frame carries a 16-byte tag). Returns its address.
fn tampering_proxy(to: std::net::SocketAddr) -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let tampered = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    std::thread::spawn(move || {
        for from_prefill in l.incoming().flatten() {
            let Ok(to_decode) = TcpStream::connect(to) else { continue };
            let (mut back_in, mut back_out) = (to_decode.try_clone().unwrap(), from_prefill.try_clone().unwrap());
            std::thread::spawn(move || std::io::copy(&mut back_in, &mut back_out));
            let tampered = tampered.clone();
            std::thread::spawn(move || {
                let (mut r, mut w) = (from_prefill, to_decode);
                for frame in 0.. {
                    let mut header = [0u8; 8];
                    if r.read_exact(&mut header).is_err() {
                        break;
                    }
                    let len = u32::from_le_bytes(header[4..8].try_into().unwrap()) as usize;
                    let mut rest = vec![0u8; len + if frame >= 2 { 16 } else { 0 }];
                    if r.read_exact(&mut rest).is_err() {
                        break;
                    }
                    if header[3] == 9 && !tampered.swap(true, std::sync::atomic::Ordering::SeqCst) {
                        rest[len - 1] ^= 0x01;
                    }
                    if w.write_all(&header).and_then(|()| w.write_all(&rest)).is_err() {
                        break;
                    }
                }
                let _ = w.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    addr
}

/// A KV chunk with one byte flipped on the way never lands: its connection closes and is
/// counted, the request ends with an error or (retried) with the right answer, never a
/// wrong one, and the cluster serves on with whole pools.
#[test]
fn a_chunk_altered_on_the_wire_is_refused_and_counted_and_never_answers_wrong() {
    let want = generate(PROMPTS[0]);
    let kv = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let proxy = tampering_proxy(kv);
    let (kv_s, proxy_s) = (kv.to_string(), proxy.to_string());
    // The proxy sits on TCP: the frames must take it (over UCX they would not pass it).
    let s = serve(&["--kv-transport", "tcp"], &[("BULKHEAD_KV_LISTEN", &kv_s), ("BULKHEAD_KV_ADVERTISE", &proxy_s)]);
    let (status, v) = chat(&s.http, SYSTEM, PROMPTS[0], 32);
    assert!(status == 200 && content(&v) == want || status >= 500 && v.get("error").is_some(), "{status} {v}");
    assert!(counter(&s, "bulkhead:bad_connections_total", &[], 1.0) >= 1.0);
    let log = std::fs::read_to_string(&s.log).unwrap();
    assert!(log.lines().any(|l| l.contains("bad frame on a KV connection") && l.contains("failed authentication")), "{log}");
    // The prefill worker rejoins under a new id; until it has, requests wait in the queue
    // (or, past the queue timeout, get a 503 that says so). Never a wrong answer.
    let mut served = 0;
    for _ in 0..150 {
        let (status, v) = chat(&s.http, SYSTEM, PROMPTS[0], 32);
        if status == 200 {
            assert_eq!(content(&v), want);
            served += 1;
            if served == 2 {
                break;
            }
        } else {
            assert!(status == 503 && v.get("error").is_some(), "{status} {v}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    assert_eq!(served, 2, "the cluster serves again after the tampered connection");
    for _ in 0..100 {
        if support::pools_idle(&support::scrape(&s.http)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("pools not whole after the tampered transfer:\n{}", get(&s.http, "/metrics").1);
}

/// The incident: a prefill pool smaller than the context, a decode pool larger; tenant A's
/// marker in decode pages; tenant B's prompt longer than the prefill pool. B gets 400 and
/// nobody ever sees A's marker. Then again with the gateway's own check switched off: the
/// workers' admission alone still ends B's request with 400.
#[test]
fn the_incident_replayed_gets_400_and_never_leaks_the_marker_with_or_without_the_gateway_check() {
    let marker = format!("CANARY-{:x}", rand_u64());
    for gateway_check in [true, false] {
        let env: &[(&str, &str)] = if gateway_check { &[] } else { &[("BULKHEAD_NO_GATEWAY_ADMISSION", "1")] };
        let s = serve(&["--prefill-kv-pool-tokens", "1024", "--clamp-context"], env);
        let (_, models) = get(&s.http, "/v1/models");
        let models: serde_json::Value = serde_json::from_str(&models).unwrap();
        assert_eq!(models["data"][0]["max_model_len"], 1024, "the served context is what the prefill pool holds");
        assert_eq!(models["data"][0]["id"], MODEL_ID, "the model is named by its file");
        let (status, a) = chat(&s.http, SYSTEM, &format!("Remember the code {marker}. Repeat it: {marker}"), 24);
        assert_eq!(status, 200, "{a}");
        let long = "hello ".repeat(1500);
        // Also with several choices and an output constraint: each choice is refused the same.
        let variants = [serde_json::json!({}), serde_json::json!({"n": 2, "guided_regex": "[a-z ]+"})];
        for (stream, extra) in [false, true].into_iter().flat_map(|s| variants.iter().map(move |v| (s, v))) {
            let mut body = serde_json::json!({"model": MODEL_ID, "prompt": long, "max_tokens": 16, "stream": stream});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            let (status, b) = request(&s.http, "POST", "/v1/completions", &body.to_string());
            assert_eq!(status, 400, "gateway check {gateway_check}, stream {stream}, {extra}: {b}");
            assert!(b.contains("context_length_exceeded"), "{b}");
            assert!(!b.contains(&marker));
        }
        // B's next ordinary request reuses freed decode pages: still no marker.
        let (status, b) = chat(&s.http, SYSTEM, "Say something.", 24);
        assert_eq!(status, 200);
        assert!(!b.to_string().contains(&marker), "tenant B saw tenant A's marker: {b}");
        let body = serde_json::json!({"model": MODEL_ID, "n": 3, "temperature": 1.0, "max_tokens": 24, "guided_regex": "[A-Za-z0-9 -]{1,40}",
            "messages": [{"role": "user", "content": "Say something."}]});
        let (status, b) = request(&s.http, "POST", "/v1/chat/completions", &body.to_string());
        assert_eq!(status, 200, "{b}");
        assert!(!b.contains(&marker), "tenant B saw tenant A's marker: {b}");
    }
}

/// The incident on every other architecture (qwen2, qwen3, llama 3, gemma3 with its
/// sliding window), on the tiny models held to llama.cpp's logits: base models, so the
/// marker goes in through `/v1/completions`; the prefill pool holds 64 tokens of their 256.
#[test]
fn the_incident_replayed_on_every_architecture_gets_400_and_never_leaks_the_marker() {
    let dir = std::env::temp_dir().join(format!("bulkhead-serve-tiny-{}-{}", std::process::id(), rand_u64()));
    std::fs::create_dir_all(&dir).unwrap();
    let marker = format!("CANARY-{:x}", rand_u64());
    let complete = |s: &Server, body: serde_json::Value| request(&s.http, "POST", "/v1/completions", &body.to_string());
    for (arch, window) in model_support::LLAMACPP_TINY {
        let path = dir.join(format!("{arch}.gguf"));
        std::fs::write(&path, model_support::llamacpp_tiny(arch, window).to_bytes()).unwrap();
        for gateway_check in [true, false] {
            let env: &[(&str, &str)] = if gateway_check { &[] } else { &[("BULKHEAD_NO_GATEWAY_ADMISSION", "1")] };
            let s = serve_model(&path, &["--prefill-kv-pool-tokens", "64", "--clamp-context"], env);
            let (status, a) = complete(&s, serde_json::json!({"model": arch, "prompt": format!("code {marker}"), "max_tokens": 8}));
            assert_eq!(status, 200, "{arch}: {a}");
            for (stream, n) in [(false, 1), (true, 1), (false, 2)] {
                let body = serde_json::json!({"model": arch, "prompt": "hello ".repeat(40), "max_tokens": 8, "stream": stream, "n": n});
                let (status, b) = complete(&s, body);
                assert_eq!(status, 400, "{arch}, gateway check {gateway_check}, stream {stream}, n {n}: {b}");
                assert!(b.contains("context_length_exceeded") && !b.contains(&marker), "{arch}: {b}");
            }
            let (status, b) =
                complete(&s, serde_json::json!({"model": arch, "prompt": "say", "max_tokens": 24, "n": 2, "temperature": 1.0}));
            assert_eq!(status, 200, "{arch}: {b}");
            assert!(!b.contains(&marker), "{arch}: tenant B saw tenant A's marker: {b}");
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A base model (no chat template in the file) answers chat requests with 400
/// `no_chat_template` and completions as usual; `--chat-template FILE` gives it one.
#[test]
fn a_base_model_refuses_chat_until_given_a_chat_template() {
    let dir = std::env::temp_dir().join(format!("bulkhead-serve-base-{}-{}", std::process::id(), rand_u64()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("qwen3.gguf");
    std::fs::write(&path, model_support::llamacpp_tiny("qwen3", None).to_bytes()).unwrap();
    let s = serve_model(&path, &["--model-id", MODEL_ID], &[]);
    let (status, b) = chat(&s.http, SYSTEM, "hello", 4);
    assert_eq!((status, b["error"]["code"].as_str()), (400, Some("no_chat_template")), "{b}");
    assert!(b["error"]["message"].as_str().unwrap().contains("/v1/completions"), "{b}");
    let (status, b) =
        request(&s.http, "POST", "/v1/completions", &format!(r#"{{"model": "{MODEL_ID}", "prompt": "hello", "max_tokens": 4}}"#));
    assert_eq!(status, 200, "{b}");
    drop(s);
    let template = dir.join("chat.jinja");
    std::fs::write(&template, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:").unwrap();
    let s = serve_model(&path, &["--model-id", MODEL_ID, "--chat-template", template.to_str().unwrap()], &[]);
    let (status, b) = chat(&s.http, SYSTEM, "hello", 4);
    assert_eq!(status, 200, "{b}");
    // The template's text is in the prompt (the tiny vocabulary spells it byte by byte).
    let rendered = format!("system: {SYSTEM}\nuser: hello\nassistant:");
    assert!(b["usage"]["prompt_tokens"].as_u64().unwrap() >= rendered.len() as u64 - 4, "{b}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_client_that_disconnects_mid_stream_does_not_hang_the_server() {
    let s = serve(&[], &[]);
    for _ in 0..3 {
        let body = serde_json::json!({"model": MODEL_ID, "stream": true, "max_tokens": 300,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]})
        .to_string();
        let mut c = TcpStream::connect(&s.http).unwrap();
        write!(
            c,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut buf = [0u8; 2048];
        let n = c.read(&mut buf).unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        drop(c);
    }
    let (status, v) = chat(&s.http, SYSTEM, "What is the capital of France?", 16);
    assert_eq!(status, 200, "{v}");
    assert!(content(&v).contains("Paris"));
}

#[test]
fn garbage_on_worker_ports_closes_that_connection_and_serving_goes_on() {
    let s = serve(&[], &[]);
    let kv = kv_addr(&s);
    for addr in [&s.workers, &kv] {
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(b"GET / HTTP/1.1\r\n\r\n\x00\xff garbage garbage").unwrap();
        let mut buf = [0u8; 64];
        // The worker closes the connection: EOF (or reset), never a hang.
        let r = c.read(&mut buf);
        assert!(matches!(r, Ok(0) | Err(_)), "{addr}: {r:?}");
    }
    let (status, v) = chat(&s.http, SYSTEM, "What is the capital of France?", 16);
    assert_eq!(status, 200, "{v}");
}

fn worker_pid(s: &Server, role: &str) -> u32 {
    let log = std::fs::read_to_string(&s.log).unwrap();
    log.lines()
        .filter(|l| l.contains(&format!("{role} worker registered")))
        .find_map(|l| l.split("pid=").nth(1))
        .and_then(|p| p.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .expect("worker logs its pid")
}

/// Starts a greedy stream of exactly `max_tokens` tokens and returns its connection once
/// the first content has arrived (what was read so far comes back too).
fn start_stream(s: &Server, max_tokens: usize) -> (TcpStream, String) {
    start_stream_at(&s.http, max_tokens)
}

/// [`start_stream`] at the gateway at `http`.
fn start_stream_at(http: &str, max_tokens: usize) -> (TcpStream, String) {
    let body = serde_json::json!({"model": MODEL_ID, "stream": true, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "Tell me a very long story."}]})
    .to_string();
    let mut c = TcpStream::connect(http).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while seen.matches("\"content\":\"").count() < 4 {
        let n = c.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
    (c, seen)
}

/// The text of an SSE stream's content deltas, and its last chunk with a finish reason.
fn streamed_text(sse: &str) -> (String, serde_json::Value) {
    let mut text = String::new();
    let mut last = serde_json::Value::Null;
    for v in sse.lines().filter_map(|l| l.strip_prefix("data: ")).filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok()) {
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
        if !v["choices"][0]["finish_reason"].is_null() || v["usage"].is_object() {
            last = v;
        }
    }
    (text, last)
}

/// Kills `s`'s decode worker with SIGKILL and reads the rest of the stream on `c` into
/// `seen`; the worker's pid comes back.
fn kill_decode_and_read(s: &Server, c: &mut TcpStream, seen: &mut String) -> u32 {
    let pid = worker_pid(s, "decode");
    assert!(Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap().success());
    let mut rest = String::new();
    c.read_to_string(&mut rest).expect("the stream ends instead of hanging");
    seen.push_str(&rest);
    pid
}

/// Waits for the killed decode worker's replacement: a second registration, the old
/// process reaped (not a zombie), the server ready.
fn replaced(s: &Server, pid: u32) {
    let registered = || std::fs::read_to_string(&s.log).unwrap().matches("decode worker registered").count();
    for _ in 0..300 {
        if registered() == 2 && get(&s.http, "/ready").0 == 200 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!((registered(), get(&s.http, "/ready").0), (2, 200), "{}", std::fs::read_to_string(&s.log).unwrap());
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    assert!(state.is_empty(), "the killed worker was not reaped: {state}");
    assert_eq!(get(&s.http, "/health").0, 200);
}

/// I11: a decode worker killed mid-stream costs the client nothing. `serve` replaces the
/// worker; the request waits for it, moves there as a new attempt whose prompt ends with
/// the tokens already streamed, and the stream goes on: no error event, no repeated or
/// missing token, the same text as an uninterrupted greedy run, usage counted once.
#[test]
fn a_decode_worker_killed_mid_stream_costs_the_stream_nothing() {
    let s = serve(&[], &[]);
    let (mut c, mut seen) = start_stream(&s, 96);
    let mut rest = String::new();
    c.read_to_string(&mut rest).expect("the uninterrupted stream ends");
    seen.push_str(&rest);
    let (want, _) = streamed_text(&seen);
    let (mut c, mut seen) = start_stream(&s, 96);
    let pid = kill_decode_and_read(&s, &mut c, &mut seen);
    let tail = &seen[seen.len().saturating_sub(600)..];
    assert!(!seen.contains("\"error\""), "no error event: {tail}");
    let (text, last) = streamed_text(&seen);
    assert_eq!(text, want, "the same text as the uninterrupted run");
    assert!(seen.contains("\"finish_reason\":\"length\""), "{tail}");
    assert_eq!(last["usage"]["completion_tokens"], 96, "completion tokens counted once: {last}");
    assert!(seen.contains("data: [DONE]"), "{tail}");
    replaced(&s, pid);
    let metrics = get(&s.http, "/metrics").1;
    assert!(metrics.contains("bulkhead:requeue_events_total{event=\"migrated\"} 1"), "the move is counted");
}

/// With `--migration-limit 0` a lost decode worker ends its streams as before: an error
/// chunk and `[DONE]` (no hang, no finish claiming success), and the worker is replaced.
#[test]
fn past_the_migration_limit_a_killed_decode_worker_ends_the_stream_with_an_error() {
    let s = serve(&["--migration-limit", "0"], &[]);
    let (mut c, mut seen) = start_stream(&s, 2000);
    let pid = kill_decode_and_read(&s, &mut c, &mut seen);
    let tail = &seen[seen.len().saturating_sub(600)..];
    let (error, done) = (seen.find("\"error\"").unwrap_or(usize::MAX), seen.find("data: [DONE]").unwrap_or(0));
    assert!(error < done && seen.contains("was lost"), "the stream ends with an error chunk, then [DONE]: {tail}");
    assert!(
        !seen.contains("\"finish_reason\":\"stop\"") && !seen.contains("\"finish_reason\":\"length\""),
        "no finish claims success: {tail}"
    );
    replaced(&s, pid);
    let (status, v) = chat(&s.http, SYSTEM, "Hi", 4);
    assert_eq!(status, 200, "{v}");
}

/// `serve` with `args` and `env`, its stderr to a file, until it exits by itself: its exit
/// status, its stderr, and how often `/health` answered 200 and 503 meanwhile.
fn serve_until_it_exits(args: &[&str], env: &[(&str, &str)]) -> (std::process::ExitStatus, String, u32, u32, Duration) {
    let start = std::time::Instant::now();
    let log = std::env::temp_dir().join(format!("bulkhead-exit-{}-{}.log", std::process::id(), rand_u64()));
    let mut cmd = Command::new(BIN);
    cmd.args(["serve", "--port", "0", "--threads", "1", "--model"]).arg(model()).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child =
        cmd.stdout(Stdio::piped()).stderr(std::fs::File::create(&log).expect("log file")).spawn().expect("spawn bulkhead serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("serve prints its address");
    let http = line.split("http://").nth(1).and_then(|r| r.split_whitespace().next()).expect("address").to_string();
    // A probe that tolerates the server going away under it.
    let health = || -> Option<u16> {
        let mut s = TcpStream::connect(&http).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
        let mut resp = String::new();
        s.read_to_string(&mut resp).ok()?;
        resp.split_whitespace().nth(1)?.parse().ok()
    };
    let (mut healthy, mut unhealthy) = (0, 0);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        match health() {
            Some(200) => healthy += 1,
            Some(503) => unhealthy += 1,
            _ => {}
        }
        assert!(start.elapsed() < Duration::from_secs(90), "serve never exited");
        std::thread::sleep(Duration::from_millis(200));
    };
    let err = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    (status, err, healthy, unhealthy, start.elapsed())
}

/// A worker that exits for a reason a restart may cure is restarted with backoff (liveness
/// stays 200 meanwhile), and after five exits within a minute `serve` exits non-zero, its
/// last line naming the worker's own reason, so that an outer supervisor takes over; until
/// it exits, `/health` answers 503 long enough for a supervisor's probe to see it.
#[test]
fn a_crash_looping_worker_makes_serve_exit_non_zero_with_the_reason() {
    // The decode worker's KV port is taken: it exits, and is restarted, until it is not.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").to_string();
    let (status, err, healthy, unhealthy, took) = serve_until_it_exits(&[], &[("BULKHEAD_KV_LISTEN", &port)]);
    assert!(!status.success());
    assert_ne!(status.code(), Some(78), "a busy port is no reason to stop at once");
    let last = err.lines().last().unwrap_or_default();
    assert!(last.contains("exited 5 times within 60 s") && last.contains("cannot listen for KV connections"), "{err}");
    assert!(healthy >= 1, "/health was never 200 while the worker was being restarted");
    assert!(unhealthy >= 5, "/health answered 503 only {unhealthy} times before serve exited");
    assert!(took < Duration::from_secs(60), "{took:?}");
}

/// A worker that cannot start for a reason a restart cannot change (here the capacity
/// check) exits with its own status, and `serve` stops at once, its last line naming the
/// reason and the fix, without spending its restart budget.
#[test]
fn a_worker_that_cannot_start_stops_serve_at_once_naming_the_reason() {
    let (status, err, _, unhealthy, took) = serve_until_it_exits(&["--kv-pool-tokens", "1000"], &[]);
    assert!(!status.success());
    let last = err.lines().last().unwrap_or_default();
    assert!(last.starts_with("error: ") && last.contains("cannot start"), "{err}");
    assert!(last.contains("--kv-pool-tokens") && last.contains("--clamp-context"), "the cause and its fix: {last}");
    assert!(!err.contains("restarting it"), "a worker that cannot start was restarted: {err}");
    assert!(unhealthy >= 5, "/health answered 503 only {unhealthy} times before serve exited");
    assert!(took < Duration::from_secs(20), "{took:?}");
}

#[test]
fn several_prefill_and_decode_workers_serve_concurrent_requests() {
    let want = generate(PROMPTS[0]);
    let s = serve(&["--prefill-workers", "2", "--decode-workers", "2", "--kv-pool-tokens", "8192"], &[]);
    // The gateway's line for each registration names the role.
    let registered =
        || std::fs::read_to_string(&s.log).unwrap().lines().filter(|l| l.contains("worker registered") && l.contains("role=")).count();
    for _ in 0..300 {
        if registered() == 4 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(registered(), 4, "four workers register");
    let handles: Vec<_> = (0..6)
        .map(|_| {
            let a = s.http.clone();
            std::thread::spawn(move || chat(&a, SYSTEM, PROMPTS[0], 32))
        })
        .collect();
    for h in handles {
        let (status, v) = h.join().unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(content(&v), want);
    }
}

fn alive(pid: u32) -> bool {
    Command::new("kill").args(["-0", &pid.to_string()]).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

#[test]
fn sigterm_drains_and_exits_and_the_workers_do_not_outlive_the_parent() {
    let mut s = serve(&["--drain-timeout-s", "5"], &[]);
    let workers = [worker_pid(&s, "prefill"), worker_pid(&s, "decode")];
    assert!(workers.iter().all(|&p| alive(p)));
    let (status, _) = chat(&s.http, SYSTEM, "Hi", 4);
    assert_eq!(status, 200);
    assert!(Command::new("kill").args(["-TERM", &s.child.id().to_string()]).status().unwrap().success());
    let start = std::time::Instant::now();
    loop {
        if s.child.try_wait().unwrap().is_some() {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "serve did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(500));
    for p in workers {
        // A zombie still answers kill -0 until reaped by init; check /proc state instead.
        let state = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
        assert!(state.is_empty() || state.contains(") Z "), "worker {p} outlived the parent: {state}");
    }
}

#[test]
fn a_worker_whose_pool_cannot_hold_the_context_refuses_to_start_and_names_the_fix() {
    let out = Command::new(BIN)
        .args(["serve", "--role", "decode", "--gateway", "127.0.0.1:9", "--kv-pool-tokens", "1000", "--threads", "1", "--model"])
        .arg(model())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78), "the status that tells a supervisor not to restart it");
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in ["1008", "8192", "--kv-pool-tokens", "--clamp-context"] {
        assert!(err.contains(needle), "missing {needle:?} in: {err}");
    }
}

/// A new cluster key file, made by `bulkhead keygen`.
fn key_file() -> String {
    let path = std::env::temp_dir().join(format!("bulkhead-key-{}-{}", std::process::id(), rand_u64()));
    let out = Command::new(BIN).arg("keygen").arg(&path).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    path.to_string_lossy().into_owned()
}

/// An internal connection to `addr`, authenticated with the key in `key` (if any) for
/// `purpose`, claiming identity `claim`.
fn internal(
    addr: &str,
    key: Option<&str>,
    purpose: bulkhead_protocol::Purpose,
    claim: u32,
) -> Result<(bulkhead_transport::wire::FrameReader, bulkhead_transport::wire::FrameWriter), bulkhead_transport::wire::WireError> {
    let c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = bulkhead_transport::wire::FrameReader::new(c.try_clone().unwrap());
    let mut w = bulkhead_transport::wire::FrameWriter::new(c);
    let key = key.map(|k| bulkhead_transport::trust::load_key_file(std::path::Path::new(k)).unwrap());
    let trust = bulkhead_transport::trust::Trust::new(key, false, bulkhead_transport::trust::Encryption::Auto).unwrap();
    bulkhead_transport::handshake::connect_handshake(&mut r, &mut w, &trust, purpose, claim)?;
    Ok((r, w))
}

/// The decode worker's KV address, from its start-up log line.
fn kv_addr(s: &Server) -> String {
    let log = std::fs::read_to_string(&s.log).unwrap();
    log.lines()
        .find_map(|l| l.split("kv_addr=").nth(1))
        .and_then(|a| a.split_whitespace().next())
        .map(|a| a.trim_matches('"').to_string())
        .expect("decode worker logs its KV address")
}

/// A counter's value at `/metrics` over the series with labels `want`, once the workers'
/// latest reports have arrived (polled for a few seconds until `enough`).
fn counter(s: &Server, name: &str, want: &[(&str, &str)], enough: f64) -> f64 {
    support::polled_sum(&s.http, name, want, enough)
}

#[test]
fn the_gateway_refuses_a_worker_with_another_model_or_kv_layout() {
    use bulkhead_protocol::{Hello, Message, Purpose, Role, WorkerId};
    let key = key_file();
    let s = serve(&["--cluster-key-file", &key], &[]);
    s.wait_ready();
    let digest = bulkhead_gguf::GgufFile::open(model()).unwrap().digest().unwrap();
    // The live decode worker's id, which a newcomer may not take.
    let taken = s
        .logs()
        .lines()
        .find(|l| l.contains("decode worker registered"))
        .and_then(|l| l.split("worker=worker-").nth(1))
        .and_then(|w| w.split_whitespace().next())
        .and_then(|w| w.parse().ok())
        .map(WorkerId)
        .expect("the decode worker logs its id");
    let right = Hello {
        role: Role::Decode,
        model_digest: digest,
        page_size: 16,
        kv_bytes_per_token: 23040,
        capacity_tokens: 16384,
        max_context: 8192,
        kv_addr: "127.0.0.1:9".into(),
        worker: WorkerId(77),
    };
    let other_model = Hello { model_digest: digest ^ 1, ..right.clone() };
    let other_layout = Hello { page_size: 32, ..right.clone() };
    let id_in_use = Hello { worker: taken, ..right };
    for hello in [other_model, other_layout, id_in_use] {
        let (mut r, mut w) = internal(&s.workers, Some(&key), Purpose::Control, 0).unwrap();
        w.send(&Message::Hello(hello)).unwrap();
        let reply = r.recv().unwrap();
        assert!(matches!(reply, Message::Refuse { .. }), "{reply:?}");
    }
    // The real workers are unaffected.
    assert_eq!(chat(&s.http, SYSTEM, "Hi", 4).0, 200);
}

#[test]
fn a_worker_without_the_cluster_key_or_with_a_wrong_one_cannot_join_and_exits_non_zero() {
    let key = key_file();
    let s = serve(&["--cluster-key-file", &key], &[]);
    let stranger = |extra: &[&str]| {
        let out = Command::new(BIN)
            .args(["serve", "--role", "decode", "--gateway", &s.workers, "--threads", "1", "--model"])
            .arg(model())
            .args(extra)
            .env_remove("BULKHEAD_CLUSTER_KEY_FILE")
            .output()
            .unwrap();
        assert!(!out.status.success(), "a stranger joined: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = stranger(&[]);
    assert!(err.contains("refused this worker") && err.contains("needs its key"), "{err}");
    let err = stranger(&["--cluster-key-file", &key_file()]);
    assert!(err.contains("the proof does not match") && err.contains("a different cluster key"), "{err}");
    assert!(counter(&s, "bulkhead:auth_refusals_total", &[("worker", "gateway")], 2.0) >= 2.0);
    // Counted as what they are: no key, and a failed proof (the worker with another key
    // refuses the gateway's challenge instead of sending its proof), never "unexpected".
    let gw = |reason, enough| counter(&s, "bulkhead:handshake_refusals_total", &[("role", "gateway"), ("reason", reason)], enough);
    assert!(gw("no_key", 1.0) >= 1.0 && gw("proof", 1.0) >= 1.0, "no_key {} proof {}", gw("no_key", 0.0), gw("proof", 0.0));
    assert_eq!(gw("unexpected", 0.0), 0.0);
    let (_, metrics) = get(&s.http, "/metrics");
    assert!(metrics.contains("bulkhead:workers{role=\"decode\"} 1"), "only the real decode worker: {metrics}");
    assert_eq!(chat(&s.http, SYSTEM, "Hi", 4).0, 200);
}

#[test]
fn a_kv_connection_must_prove_the_key_and_name_the_prefill_it_authenticated_as() {
    use bulkhead_protocol::{Message, Purpose, WorkerId};
    let key = key_file();
    let s = serve(&["--cluster-key-file", &key], &[]);
    let kv = kv_addr(&s);
    // Authenticated as worker 77, introduced as worker 1 (the real prefill's id).
    let (mut r, mut w) = internal(&kv, Some(&key), Purpose::Kv, 77).unwrap();
    w.send(&Message::KvHello { prefill: WorkerId(1) }).unwrap();
    let reply = r.recv();
    assert!(matches!(&reply, Ok(Message::AuthRefused { reason }) if reason.contains("worker-77")), "{reply:?}");
    assert!(r.recv().is_err(), "then closed");
    // A wrong key: the decode worker's proof does not match ours.
    let wrong = internal(&kv, Some(&key_file()), Purpose::Kv, 1);
    assert!(matches!(wrong, Err(bulkhead_transport::wire::WireError::Auth(_))), "{:?}", wrong.err());
    // No key at all: a plain KvHello.
    let (mut r, mut w) = internal(&kv, None, Purpose::Kv, 0).unwrap();
    w.send(&Message::KvHello { prefill: WorkerId(1) }).unwrap();
    assert!(matches!(r.recv(), Ok(Message::AuthRefused { .. })));
    // A control handshake replayed on the KV port.
    let control = internal(&kv, Some(&key), Purpose::Control, 0);
    assert!(control.is_err());
    assert!(counter(&s, "bulkhead:auth_refusals_total", &[("role", "decode")], 4.0) >= 4.0);
    assert_eq!(chat(&s.http, SYSTEM, "Hi", 4).0, 200);
}

/// Reads until the server closes the connection or `limit` passes; returns what arrived and
/// whether it closed.
fn read_until_closed(c: &mut TcpStream, limit: Duration) -> (String, bool) {
    c.set_read_timeout(Some(limit)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return (String::from_utf8_lossy(&got).into_owned(), true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            // A reset is a close too.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return (String::from_utf8_lossy(&got).into_owned(), true),
            Err(_) => return (String::from_utf8_lossy(&got).into_owned(), false),
        }
    }
}

/// Slow or idle clients cannot hold connections: headers must arrive within the header
/// timeout (which is also the keep-alive idle timeout), a body within the body timeout
/// (408), and at `--max-connections` a new connection takes an idle stranger's place.
#[test]
fn slow_headers_idle_keepalives_and_slow_bodies_are_cut_and_idle_strangers_make_room() {
    let s = serve(&["--http-header-timeout-ms", "700", "--http-body-timeout-ms", "700", "--max-connections", "2"], &[]);
    // Headers one byte at a time, too slowly.
    let mut slow = TcpStream::connect(&s.http).unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\nHo").unwrap();
    let (got, closed) = read_until_closed(&mut slow, Duration::from_secs(5));
    assert!(closed, "a connection that never finishes its headers is closed: {got:?}");
    // A keep-alive connection left idle after a response.
    let mut idle = TcpStream::connect(&s.http).unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let (got, closed) = read_until_closed(&mut idle, Duration::from_secs(5));
    assert!(got.starts_with("HTTP/1.1 200") && closed, "answered, then closed when idle: {got:?}");
    // A body that stops arriving.
    let mut body = TcpStream::connect(&s.http).unwrap();
    body.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"",
    )
    .unwrap();
    let (got, _) = read_until_closed(&mut body, Duration::from_secs(5));
    assert!(got.starts_with("HTTP/1.1 408") && got.contains("request_timeout"), "{got:?}");
    // Two silent connections take both slots: a third is answered at once, in the place of
    // one of them (connections that never authenticated cannot hold the server).
    let _a = TcpStream::connect(&s.http).unwrap();
    let _b = TcpStream::connect(&s.http).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let start = std::time::Instant::now();
    let mut third = TcpStream::connect(&s.http).unwrap();
    third.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let (got, _) = read_until_closed(&mut third, Duration::from_secs(5));
    assert!(got.starts_with("HTTP/1.1 200"), "{got:?}");
    assert!(start.elapsed() < Duration::from_millis(400), "waited for the silent connections: {:?}", start.elapsed());
}

/// The request's output constraint, log-probabilities, `n` and tools across the prefill →
/// decode handoff: the first token (the prefill worker's) obeys the grammar as the rest
/// do, greedy log-probabilities are the model's own (computed here in-process), and each
/// of `n` choices is sampled on its own.
#[test]
fn structured_outputs_logprobs_n_and_tools_hold_across_the_handoff() {
    let s = serve(&[], &[]);
    let post = |path: &str, body: serde_json::Value| {
        let (status, b) = request(&s.http, "POST", path, &body.to_string());
        assert_eq!(status, 200, "{body} -> {b}");
        serde_json::from_str::<serde_json::Value>(&b).expect("JSON")
    };
    let user = |text: &str| serde_json::json!([{"role": "user", "content": text}]);

    // A JSON schema, greedy: the answer parses and follows it.
    let schema = serde_json::json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": false});
    let v = post(
        "/v1/chat/completions",
        serde_json::json!({"model": MODEL_ID, "max_tokens": 64, "temperature": 0, "messages": user("Give a city and its population as JSON."),
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": true}}}),
    );
    let answer: serde_json::Value = serde_json::from_str(&content(&v)).unwrap_or_else(|e| panic!("{e}: {v}"));
    assert!(answer["city"].is_string() && answer["population"].is_i64(), "{answer}");

    // A regex whose first character the model would not pick: the prefill's token obeys it.
    for temperature in [0.0, 1.0] {
        let v = post(
            "/v1/chat/completions",
            serde_json::json!({"model": MODEL_ID, "max_tokens": 6, "temperature": temperature, "seed": 5,
            "messages": user("What is the capital of France?"), "guided_regex": "[0-9]{3}"}),
        );
        let c = content(&v);
        assert!(c.len() == 3 && c.bytes().all(|b| b.is_ascii_digit()), "{c:?}");
    }

    // Greedy log-probabilities against the model run here.
    let messages = user("Name a fruit.");
    let tokenized = post("/tokenize", serde_json::json!({"messages": messages}));
    let mut ctx: Vec<u32> = serde_json::from_value(tokenized["tokens"].clone()).expect("ids");
    let v = post(
        "/v1/chat/completions",
        serde_json::json!({"model": MODEL_ID, "max_tokens": 4, "temperature": 0, "messages": messages, "logprobs": true, "top_logprobs": 2}),
    );
    let served = v["choices"][0]["logprobs"]["content"].as_array().expect("logprobs").clone();
    assert!(!served.is_empty());
    let m = bulkhead_engine::load_model(&model(), 1).expect("model");
    for entry in &served {
        let mut pool = bulkhead_kv::KvPool::new(bulkhead_kv::PoolConfig {
            layout: m.model.kv_layout(16),
            pages: ctx.len().div_ceil(16) + 1,
            checks: bulkhead_kv::KvChecks::all(),
        })
        .expect("pool");
        let mut seq = bulkhead_kv::SequenceKv::new(bulkhead_kv::RequestId(1));
        seq.reserve(&mut pool, ctx.len()).expect("reserve");
        let logits =
            m.model.forward(&mut pool, &mut [bulkhead_model::SeqInput { kv: &mut seq, tokens: &ctx, logit_rows: 1 }]).expect("forward");
        let (best, max) = logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &l)| if l > b.1 { (i, l) } else { b });
        let z: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
        let want = -z.ln();
        assert!((entry["logprob"].as_f64().unwrap() - want).abs() < 1e-3, "{entry} vs {want}");
        let bytes: Vec<u8> = serde_json::from_value(entry["bytes"].clone()).expect("bytes");
        assert_eq!(bytes, m.tokenizer.token_bytes(best as u32).unwrap_or_default(), "{entry}");
        assert_eq!(entry["top_logprobs"][0]["logprob"], entry["logprob"]);
        ctx.push(best as u32);
    }

    // n = 3, sampled: three choices, by index, not all the same.
    let v = post(
        "/v1/chat/completions",
        serde_json::json!({"model": MODEL_ID, "max_tokens": 16, "temperature": 1.0, "seed": 9, "n": 3, "messages": user("Tell me a story.")}),
    );
    let texts: Vec<String> = (0..3)
        .map(|i| {
            assert_eq!(v["choices"][i]["index"], i);
            v["choices"][i]["message"]["content"].as_str().unwrap_or_default().to_string()
        })
        .collect();
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "{texts:?}");
    // The siblings share the prompt's full pages: the later two hit what the first one
    // published (its own scope: the same tenant and salt). Here the decode worker already
    // holds the chat template's first page, so the first sibling computes the rest there
    // and the others wait for its pages (before, each computed the whole rest itself).
    let before = support::sum(&support::scrape(&s.http), "bulkhead:prefix_cache_hits_total", &[]);
    let long = format!("Summarise this. {}", "The quick brown fox jumps over the lazy dog. ".repeat(12));
    post("/v1/chat/completions", serde_json::json!({"model": MODEL_ID, "max_tokens": 2, "n": 3, "messages": user(&long)}));
    let prompt = post("/tokenize", serde_json::json!({"messages": user(&long)}))["count"].as_u64().expect("count") as f64;
    let full_pages_tokens = ((prompt - 1.0) / 16.0).floor() * 16.0;
    let hits = counter(&s, "bulkhead:prefix_cache_hits_total", &[], before + 2.0 * full_pages_tokens) - before;
    assert!(hits >= 2.0 * full_pages_tokens, "siblings hit {hits} cached tokens of a {prompt}-token prompt");

    // tool_choice "required": the call parses and follows the function's schema.
    let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": false}}}]);
    let v = post(
        "/v1/chat/completions",
        serde_json::json!({"model": MODEL_ID, "max_tokens": 64, "temperature": 0, "messages": user("What is the weather in Paris?"), "tools": tools, "tool_choice": "required"}),
    );
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let call = &choice["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather");
    let args: serde_json::Value = serde_json::from_str(call["arguments"].as_str().expect("arguments")).expect("JSON arguments");
    assert!(args["city"].is_string(), "{args}");
}

/// The KV road (issue 19): `auto` takes UCX where it loads (`scripts/test.sh` installs it
/// as root), `--kv-transport tcp` keeps TCP, each connection is logged and counted by its
/// road, and the answers are the same greedy text either way, a multi-chunk prompt too.
#[test]
fn kv_frames_take_ucx_where_it_loads_and_tcp_when_asked_with_the_same_answers() {
    let want = generate(PROMPTS[0]);
    let ucx = bulkhead_ucx::version().is_ok();
    if !ucx {
        eprintln!("UCX is not usable here: checking only that auto keeps TCP");
    }
    let long = "Tell me everything you know about lighthouses and the sea. ".repeat(90);
    let mut long_answers = Vec::new();
    for (args, road) in [(&[][..], if ucx { "ucx" } else { "tcp" }), (&["--kv-transport", "tcp"][..], "tcp")] {
        let s = serve(args, &[]);
        let (status, v) = chat(&s.http, SYSTEM, PROMPTS[0], 32);
        assert_eq!(status, 200, "{v}");
        assert_eq!(content(&v), want, "over {road}");
        let (status, v) = chat(&s.http, SYSTEM, &long, 16);
        assert_eq!(status, 200, "{v}");
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 1024, "several prefill chunks: {v}");
        long_answers.push(content(&v));
        for role in ["prefill", "decode"] {
            assert_eq!(
                counter(&s, "bulkhead:kv_connections_total", &[("role", role), ("transport", road)], 1.0),
                1.0,
                "{role} over {road}"
            );
        }
        let other = if road == "ucx" { "tcp" } else { "ucx" };
        assert_eq!(support::sum(&support::scrape(&s.http), "bulkhead:kv_connections_total", &[("transport", other)]), 0.0);
        let log = std::fs::read_to_string(&s.log).unwrap();
        let open = format!("transport=\"{road}\"");
        assert!(log.lines().any(|l| l.contains("KV connection open") && l.contains(&open)), "{log}");
        assert!(log.lines().any(|l| l.contains("KV connection from a prefill worker") && l.contains(&open)), "{log}");
    }
    assert_eq!(long_answers[0], long_answers[1], "the same KV over either road");
}

/// A link cut mid-transfer over UCX (issue 19): shared memory cannot be unplugged, so the
/// prefill worker is stopped (SIGSTOP) between two chunks, the writer alive and silent. The
/// request fails at the transfer timeout, its decode pages stay quarantined while the
/// writer is not fenced, and once it runs again (any late chunk lands in a receive buffer
/// and is dropped unread) its `Done` or `Fenced` releases them, and serving goes on.
#[test]
fn a_prefill_worker_stalled_mid_transfer_over_ucx_keeps_its_pages_quarantined_until_it_is_fenced() {
    if let Err(e) = bulkhead_ucx::version() {
        eprintln!("skipped: UCX is not usable here ({e})");
        return;
    }
    let s = serve(&["--transfer-batch-pages", "8", "--transfer-timeout-ms", "2000"], &[]);
    let http = s.http.clone();
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(150);
    let victim = std::thread::spawn(move || chat(&http, SYSTEM, &long, 8));
    let decode = [("role", "decode")];
    let metric = |name: &str, labels: &[(&str, &str)]| support::sum(&support::scrape(&s.http), name, labels);
    let logs = [s.log.as_path()];
    support::wait_for("the first KV chunk at the decode worker", Duration::from_secs(120), &logs, || {
        metric("bulkhead:isolation_checks_total", &[("role", "decode"), ("check", "chunk_verified")]) > 0.0
    });
    assert_eq!(counter(&s, "bulkhead:kv_connections_total", &[("role", "decode"), ("transport", "ucx")], 1.0), 1.0, "the KV takes UCX");
    let prefill = worker_pid(&s, "prefill").to_string();
    assert!(Command::new("kill").args(["-STOP", &prefill]).status().unwrap().success());
    let (status, v) = victim.join().unwrap();
    assert!(status >= 500 && v["error"].is_object(), "the stalled request fails with an error body: {status} {v}");
    assert!(counter(&s, "bulkhead:kv_transfer_timeouts_total", &decode, 1.0) >= 1.0);
    // Well past the timeout, the pages are still held out: the writer could still write.
    std::thread::sleep(Duration::from_secs(1));
    let quarantined = metric("bulkhead:quarantined_pages", &decode);
    let fenced = metric("bulkhead:fenced_releases_total", &decode);
    assert!(Command::new("kill").args(["-CONT", &prefill]).status().unwrap().success());
    assert!(quarantined > 0.0, "pages freed before the writer was fenced");
    assert_eq!(fenced, 0.0, "nothing fenced the stopped writer");
    support::wait_for("the fence to release the quarantine", Duration::from_secs(120), &logs, || {
        let m = support::scrape(&s.http);
        support::sum(&m, "bulkhead:fenced_releases_total", &decode) > 0.0 && support::pools_idle(&m)
    });
    // Whether the resumed writer sends more chunks first or reads the abort first is up to it.
    eprintln!("resumed: late chunks {}", metric("bulkhead:late_chunks_total", &decode));
    let (status, v) = chat(&s.http, SYSTEM, "Hi", 4);
    assert_eq!(status, 200, "{v}");
}

/// Bytes that arrive over UCX meet the same MAC check as TCP's before anything reads them:
/// a frame with a tag never sealed under the session closes its connection, is counted,
/// and the cluster serves on.
#[test]
fn a_forged_frame_over_ucx_closes_its_connection_like_one_over_tcp() {
    use bulkhead_protocol::{Message, Purpose, WorkerId};
    if let Err(e) = bulkhead_ucx::version() {
        eprintln!("skipped: UCX is not usable here ({e})");
        return;
    }
    let key = key_file();
    let s = serve(&["--cluster-key-file", &key], &[]);
    let (mut r, mut w) = internal(&kv_addr(&s), Some(&key), Purpose::Kv, 77).unwrap();
    w.send(&Message::KvHello { prefill: WorkerId(77) }).unwrap();
    let address = match r.recv() {
        Ok(Message::KvUcxAddress { address }) => address,
        other => panic!("the decode worker answers KvHello with its UCX address: {other:?}"),
    };
    assert!(!address.is_empty(), "an authenticated session is offered UCX");
    let mut tx = bulkhead_ucx::Sender::connect(&address, bulkhead_ucx::Transports::Any, bulkhead_ucx::Peer::SameHost).unwrap();
    w.send(&Message::KvUcxUse { address: tx.address().to_vec() }).unwrap();
    let mut frame = Vec::new();
    bulkhead_protocol::encode(&Message::KvKeepalive, &mut frame);
    frame.extend_from_slice(&[0u8; 16]);
    let (_a, watch) = std::os::unix::net::UnixStream::pair().unwrap();
    tx.send(frame, std::os::fd::AsRawFd::as_raw_fd(&watch), Duration::from_secs(10)).unwrap();
    assert!(r.recv().is_err(), "the decode worker closes the connection");
    assert!(counter(&s, "bulkhead:bad_connections_total", &[("role", "decode")], 1.0) >= 1.0);
    let log = std::fs::read_to_string(&s.log).unwrap();
    assert!(log.lines().any(|l| l.contains("bad frame on a KV connection") && l.contains("failed authentication")), "{log}");
    assert_eq!(chat(&s.http, SYSTEM, "Hi", 4).0, 200);
}

/// Resident memory of process `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()?.parse().ok()).unwrap();
    kib * 1024
}

/// Before the handshake a port holds little (I9). 256 connections that trickle a frame
/// header a byte at a time cannot keep a real peer out: the oldest waiting connections are
/// closed to make room, and each is cut at the handshake deadline. 48 keyless connections
/// announcing 15 MiB frames are closed at their header, and the gateway does not grow.
#[test]
fn trickling_and_oversize_connections_before_the_handshake_hold_nothing() {
    use bulkhead_protocol::{Message, Purpose};
    let key = key_file();
    let s = serve(&["--cluster-key-file", &key], &[]);
    let kv = kv_addr(&s);
    // A well-formed AuthHello, sent a byte at a time: never complete, never wrong.
    let hello = Message::AuthHello { purpose: Purpose::Kv, claim: 9, nonce: [7; 32], encrypt: false };
    let mut frame = Vec::new();
    bulkhead_protocol::encode(&hello, &mut frame);
    let trickle: Vec<TcpStream> = (0..256)
        .map(|_| {
            let mut c = TcpStream::connect(&kv).unwrap();
            c.write_all(&frame[..1]).unwrap();
            c
        })
        .collect();
    let clones: Vec<TcpStream> = trickle.iter().map(|c| c.try_clone().unwrap()).collect();
    let trickler = std::thread::spawn(move || {
        for byte in &frame[1..9] {
            std::thread::sleep(Duration::from_millis(500));
            for mut c in &clones {
                let _ = c.write_all(std::slice::from_ref(byte));
            }
        }
    });
    // A real peer's handshake gets through the trickle at once.
    let started = std::time::Instant::now();
    let real = internal(&kv, Some(&key), Purpose::Kv, 9);
    assert!(real.is_ok(), "{:?}", real.err());
    assert!(started.elapsed() < Duration::from_secs(2), "the handshake took {:?}", started.elapsed());
    // Every trickle is closed: made room for a newer one, or cut at the deadline (3 s).
    for mut c in trickle {
        c.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
        let r = c.read(&mut [0u8; 16]);
        assert!(matches!(r, Ok(0)) || r.as_ref().is_err_and(|e| e.kind() != std::io::ErrorKind::WouldBlock), "{r:?}");
    }
    trickler.join().unwrap();
    let decode = [("role", "decode")];
    assert!(counter(&s, "bulkhead:handshake_refusals_total", &[decode[0], ("reason", "evicted")], 200.0) >= 200.0);
    assert!(counter(&s, "bulkhead:handshake_refusals_total", &[decode[0], ("reason", "deadline")], 1.0) >= 1.0);
    // Oversize first frames on the gateway's worker port.
    let gateway = s.child.id();
    let before = rss(gateway);
    let mut header = vec![b'B', b'H', bulkhead_protocol::VERSION, 1];
    header.extend_from_slice(&(15u32 << 20).to_le_bytes());
    let senders: Vec<_> = (0..48)
        .map(|_| {
            let (addr, header) = (s.workers.clone(), header.clone());
            std::thread::spawn(move || {
                let mut c = TcpStream::connect(addr).unwrap();
                let _ = c.write_all(&header);
                let chunk = vec![0x5a; 1 << 20];
                for _ in 0..15 {
                    if c.write_all(&chunk).is_err() {
                        break;
                    }
                }
            })
        })
        .collect();
    for t in senders {
        t.join().unwrap();
    }
    let grown = rss(gateway).saturating_sub(before);
    assert!(grown <= 16 << 20, "the gateway grew by {} MiB", grown >> 20);
    // Each closed at its header, or first made room for a newer one (16 wait per address).
    let gw = |reason| counter(&s, "bulkhead:handshake_refusals_total", &[("role", "gateway"), ("reason", reason)], 1.0);
    assert!(gw("malformed") >= 1.0 && gw("malformed") + gw("evicted") >= 48.0, "{} {}", gw("malformed"), gw("evicted"));
    assert_eq!(chat(&s.http, SYSTEM, "Hi", 4).0, 200);
}

/// The pid `serve` logged for its gateway `i` (`--gateways`), the latest one if restarted.
fn gateway_pid(s: &Server, i: u8) -> u32 {
    s.logs()
        .lines()
        .filter(|l| {
            (l.contains("gateway started") && l.contains(&format!("gateway={i} "))) || l.contains(&format!("gateway-{i} restarted"))
        })
        .filter_map(|l| l.split("pid=").nth(1))
        .filter_map(|p| p.split_whitespace().next().and_then(|p| p.parse().ok()))
        .next_back()
        .expect("serve logs each gateway's pid")
}

/// Several gateways over the same workers (I11's "no single gateway"): both answer, and
/// their request ids never meet on the shared workers; a gateway killed with SIGKILL ends
/// only its own streams (closed, not hung), while a stream on the other gateway goes on to
/// the same text as an uninterrupted run; `serve` restarts the dead gateway on its ports,
/// the workers register with it again, and it serves.
#[test]
fn two_gateways_share_the_workers_and_a_killed_one_leaves_the_other_serving() {
    let s = serve(&["--gateways", "2"], &[]);
    s.wait_ready();
    let other = s.gateways.first().cloned().expect("serve names its second gateway");
    let ready = |http: &str| get(http, "/ready").0 == 200;
    support::wait_for("the second gateway is ready", Duration::from_secs(30), &[&s.log], || ready(&other));
    let (mut c, mut seen) = start_stream(&s, 256);
    c.read_to_string(&mut seen).expect("the uninterrupted stream ends");
    let (want, _) = streamed_text(&seen);
    let (status, v) = chat(&other, SYSTEM, "What is the capital of France?", 8);
    assert_eq!(status, 200, "the second gateway answers through the same workers: {v}");

    let (mut mine, mut mine_seen) = start_stream(&s, 256);
    let (mut theirs, mut theirs_seen) = start_stream_at(&other, 2000);
    let pid = gateway_pid(&s, 1);
    assert!(Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap().success());
    let mut rest = String::new();
    theirs.read_to_string(&mut rest).expect("the dead gateway's stream is closed, not hung");
    theirs_seen.push_str(&rest);
    assert!(!theirs_seen.contains("data: [DONE]"), "a stream of the killed gateway cannot have finished");
    mine.read_to_string(&mut mine_seen).expect("the other gateway's stream ends");
    let tail = &mine_seen[mine_seen.len().saturating_sub(600)..];
    assert!(!mine_seen.contains("\"error\""), "no error on the gateway that lives: {tail}");
    assert_eq!(streamed_text(&mine_seen).0, want, "the same text as the uninterrupted run");

    support::wait_for("the killed gateway is restarted", Duration::from_secs(60), &[&s.log], || gateway_pid(&s, 1) != pid && ready(&other));
    let (status, v) = chat(&other, SYSTEM, "What is the capital of France?", 8);
    assert_eq!(status, 200, "the restarted gateway serves: {v}");
    let (status, v) = chat(&s.http, SYSTEM, "What is the capital of France?", 8);
    assert_eq!(status, 200, "{v}");
    assert_eq!(get(&s.http, "/health").0, 200);

    // SIGKILL leaves serve no chance to stop its children: the gateway child sees its
    // standard input close and exits, though its standard error (a pipe to serve) is gone.
    let pid = gateway_pid(&s, 1);
    assert!(Command::new("kill").args(["-9", &s.child.id().to_string()]).status().unwrap().success());
    support::wait_for("the gateway child exits once serve is killed", Duration::from_secs(10), &[&s.log], || {
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        state.is_empty() || state.contains(") Z ")
    });
}

/// Several gateways need the cluster key (each derives the prefix cache's secret from
/// it): a worker given several without one refuses to start and says why.
#[test]
fn a_worker_given_several_gateways_without_a_cluster_key_refuses_to_start() {
    let out = Command::new(BIN)
        .args(["serve", "--role", "decode", "--gateway", "127.0.0.1:9,127.0.0.1:10", "--threads", "1", "--model"])
        .arg(model())
        .env_remove("BULKHEAD_CLUSTER_KEY_FILE")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("several gateways need a cluster key"), "{stderr}");
}
