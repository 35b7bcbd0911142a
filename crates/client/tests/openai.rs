//! The client against a scripted local HTTP server: streamed and whole answers, errors,
//! hang-ups, and a small load run.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bulkhead_client::http::{Timeouts, Url};
use bulkhead_client::loadgen::{self, LoadgenConfig};
use bulkhead_client::report::TokenSource;
use bulkhead_client::{Api, Client, ClientConfig, CompletionRequest, HangUp};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// One write of a scripted response, after a pause.
type Script = Vec<(Duration, Vec<u8>)>;

/// A server that answers every connection with `respond(request)` and records requests.
/// Returns its URL, the requests seen, and how many responses were cut by the client.
async fn server(respond: fn(&str) -> Script) -> (String, Arc<Mutex<Vec<String>>>, Arc<Mutex<usize>>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let cut = Arc::new(Mutex::new(0));
    let (seen2, cut2) = (seen.clone(), cut.clone());
    tokio::spawn(async move {
        loop {
            let (mut s, _) = l.accept().await.unwrap();
            let (seen, cut) = (seen2.clone(), cut2.clone());
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut tmp = [0u8; 4096];
                // Head, then Content-Length bytes of body.
                let req = loop {
                    let n = s.read(&mut tmp).await.unwrap();
                    buf.extend_from_slice(&tmp[..n]);
                    let text = String::from_utf8_lossy(&buf).to_string();
                    if let Some(i) = text.find("\r\n\r\n") {
                        let len: usize = text
                            .lines()
                            .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length: ").map(|v| v.trim().parse().unwrap()))
                            .unwrap_or(0);
                        if buf.len() >= i + 4 + len {
                            break text;
                        }
                    }
                    if n == 0 {
                        return;
                    }
                };
                seen.lock().unwrap().push(req.clone());
                for (pause, bytes) in respond(&req) {
                    tokio::time::sleep(pause).await;
                    if s.write_all(&bytes).await.is_err() || s.flush().await.is_err() {
                        *cut.lock().unwrap() += 1;
                        return;
                    }
                }
            });
        }
    });
    (url, seen, cut)
}

fn client(url: &str) -> Client {
    Client::new(ClientConfig {
        url: Url::parse(url).unwrap(),
        api_key: Some("sk-test".into()),
        headers: vec![("X-Tenant".into(), "a".into())],
        timeouts: Timeouts { connect: Duration::from_secs(5), read: Duration::from_secs(5) },
    })
}

fn chunk(payload: &str) -> Vec<u8> {
    let event = format!("data: {payload}\n\n");
    format!("{:x}\r\n{event}\r\n", event.len()).into_bytes()
}

const SSE_HEAD: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";

fn request(api: Api, stream: bool) -> CompletionRequest {
    CompletionRequest { api, model: "m".into(), prompt: "river stone".into(), max_tokens: 2, temperature: 0.0, ignore_eos: true, stream }
}

/// "Hel" + "lo" as text-completion chunks 30 ms apart, a usage chunk, [DONE].
fn hello_stream(_: &str) -> Script {
    let ms = Duration::from_millis;
    vec![
        (ms(0), SSE_HEAD.to_vec()),
        (ms(20), chunk(r#"{"choices":[{"index":0,"text":"Hel","finish_reason":null}]}"#)),
        (ms(30), chunk(r#"{"choices":[{"index":0,"text":"lo","finish_reason":"length"}]}"#)),
        (ms(0), chunk(r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#)),
        (ms(0), chunk("[DONE]")),
        (ms(0), b"0\r\n\r\n".to_vec()),
    ]
}

#[tokio::test]
async fn a_streamed_completion_is_timed_per_chunk_and_counted_from_usage() {
    let (url, seen, _) = server(hello_stream).await;
    let o = client(&url).complete(&request(Api::Completions, true), HangUp::Never).await.unwrap();
    assert!(o.ok(true), "{o:?}");
    assert_eq!((o.text.as_str(), o.finish_reason.as_deref(), o.content_chunks, o.output_tokens()), ("Hello", Some("length"), 2, 2));
    assert!(o.ttft.unwrap() >= Duration::from_millis(15), "{:?}", o.ttft);
    assert_eq!(o.itl.len(), 1);
    assert!(o.itl[0] >= Duration::from_millis(20), "{:?}", o.itl);
    let req = seen.lock().unwrap()[0].clone();
    assert!(req.starts_with("POST /v1/completions HTTP/1.1\r\n"), "{req}");
    assert!(req.contains("Authorization: Bearer sk-test\r\n") && req.contains("X-Tenant: a\r\n"), "{req}");
    let body: serde_json::Value = serde_json::from_str(req.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(body["stream_options"]["include_usage"], true);
    assert_eq!((body["ignore_eos"].clone(), body["prompt"].clone()), (serde_json::json!(true), serde_json::json!("river stone")));
}

#[tokio::test]
async fn hanging_up_after_one_chunk_closes_the_connection_early() {
    fn slow(_: &str) -> Script {
        let mut s = hello_stream("");
        s[2].0 = Duration::from_millis(300);
        s
    }
    let (url, _, cut) = server(slow).await;
    let o = client(&url).complete(&request(Api::Completions, true), HangUp::AfterChunks(1)).await.unwrap();
    assert!(o.hung_up && !o.done && o.ok(true), "{o:?}");
    assert_eq!(o.text, "Hel");
    assert!(o.latency < Duration::from_millis(250), "did not wait for the rest: {:?}", o.latency);
    // The server's next writes fail once it notices the closed connection.
    for _ in 0..50 {
        if *cut.lock().unwrap() > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the server never saw the connection close");
}

#[tokio::test]
async fn error_statuses_and_error_events_are_failed_outcomes_with_their_message() {
    fn bad_request(_: &str) -> Script {
        let body =
            r#"{"error":{"message":"prompt is too long","type":"invalid_request_error","param":null,"code":"context_length_exceeded"}}"#;
        vec![(Duration::ZERO, format!("HTTP/1.1 400 Bad Request\r\ncontent-length: {}\r\n\r\n{body}", body.len()).into_bytes())]
    }
    let (url, _, _) = server(bad_request).await;
    let o = client(&url).complete(&request(Api::Chat, true), HangUp::Never).await.unwrap();
    assert_eq!((o.status, o.error.as_deref(), o.ok(true)), (400, Some("prompt is too long"), false));

    fn error_event(_: &str) -> Script {
        vec![
            (Duration::ZERO, SSE_HEAD.to_vec()),
            (Duration::ZERO, chunk(r#"{"choices":[{"index":0,"delta":{"role":"assistant"}}]}"#)),
            (Duration::ZERO, chunk(r#"{"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#)),
            (Duration::ZERO, chunk(r#"{"error":{"message":"worker lost"}}"#)),
            (Duration::ZERO, b"0\r\n\r\n".to_vec()),
        ]
    }
    let (url, _, _) = server(error_event).await;
    let o = client(&url).complete(&request(Api::Chat, true), HangUp::Never).await.unwrap();
    assert_eq!((o.text.as_str(), o.content_chunks, o.error.as_deref(), o.ok(true)), ("Hi", 1, Some("worker lost"), false));
    assert_eq!(o.output_tokens(), 1, "no usage: counted from chunks");

    fn no_done(_: &str) -> Script {
        let mut s = hello_stream("");
        s.remove(4);
        s
    }
    let (url, _, _) = server(no_done).await;
    let o = client(&url).complete(&request(Api::Completions, true), HangUp::Never).await.unwrap();
    assert!(!o.ok(true), "a stream without [DONE] is incomplete: {o:?}");
}

#[tokio::test]
async fn whole_answers_and_the_model_list_are_read() {
    fn whole(req: &str) -> Script {
        let body = if req.starts_with("GET /v1/models") {
            r#"{"object":"list","data":[{"id":"bulkhead","object":"model","max_model_len":8192},{"id":"other"}]}"#
        } else {
            r#"{"choices":[{"index":0,"message":{"role":"assistant","content":"Paris."},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":3}}"#
        };
        vec![(
            Duration::ZERO,
            format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()).into_bytes(),
        )]
    }
    let (url, _, _) = server(whole).await;
    let c = client(&format!("{url}/v1"));
    let models = c.models().await.unwrap();
    assert_eq!(models.len(), 2);
    assert_eq!((models[0].id.as_str(), models[0].context, models[1].context), ("bulkhead", Some(8192), None));
    let o = c.complete(&request(Api::Chat, false), HangUp::Never).await.unwrap();
    assert!(o.ok(false));
    assert_eq!((o.text.as_str(), o.output_tokens(), o.ttft), ("Paris.", 3, None));
}

#[tokio::test]
async fn a_load_run_counts_every_request_once() {
    fn mixed(req: &str) -> Script {
        // Prompts of 2 or 3 words fail, so the error path is counted too.
        if words(req) <= 3 {
            let body = r#"{"error":{"message":"too short"}}"#;
            return vec![(
                Duration::ZERO,
                format!("HTTP/1.1 503 Service Unavailable\r\ncontent-length: {}\r\n\r\n{body}", body.len()).into_bytes(),
            )];
        }
        hello_stream(req)
    }
    fn words(req: &str) -> usize {
        let body: serde_json::Value = serde_json::from_str(req.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        body["prompt"].as_str().unwrap().split(' ').count()
    }
    let (url, seen, _) = server(mixed).await;
    let cfg = LoadgenConfig {
        api: Api::Completions,
        model: "m".into(),
        concurrency: 3,
        requests: Some(12),
        duration: None,
        prompt_tokens: "uniform:2:6".parse().unwrap(),
        output_tokens: "2".parse().unwrap(),
        seed: 11,
        ignore_eos: true,
        stream: true,
        temperature: 0.0,
        warmup: 1,
    };
    let failing = (1..13).filter(|&i| cfg.request(i).prompt.split(' ').count() <= 3).count() as u64;
    assert!(failing > 0 && failing < 12, "the seed must give both outcomes: {failing} failing");
    let r = loadgen::run(&client(&url), &cfg).await.unwrap();
    assert_eq!(seen.lock().unwrap().len(), 13, "12 measured + 1 warm-up");
    let t = &r.tally;
    assert_eq!((r.requests, t.ok + t.failed, t.failed), (12, 12, failing));
    assert_eq!(t.failures.errors.get("http_503").copied().unwrap_or(0), failing);
    assert_eq!(t.output_tokens, 2 * t.ok);
    if t.ok > 0 {
        assert_eq!(t.output_tokens_from, TokenSource::Usage);
        assert_eq!(t.ttft_ms.unwrap().count as u64, t.ok);
        assert_eq!(t.short_outputs, 0);
    }
    let json = serde_json::to_value(&r).unwrap();
    assert!(json["itl_ms"]["p99"].is_number() || t.ok == 0);
    // What scripts/bench-vs-llamacpp.sh reads, at the top level.
    for key in ["output_tokens_per_s", "failed", "short_outputs", "requests"] {
        assert!(json[key].is_number(), "{key} in {json}");
    }
    assert!(json["ttft_ms"]["p99"].is_number() && json["prompt_tokens_mean"].is_number() || t.ok == 0, "{json}");
}
