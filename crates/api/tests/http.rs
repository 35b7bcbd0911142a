//! Every endpoint of the router, driven in-process against a scripted mock backend.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode, header};
use bulkhead_api::testing::byte_level_encoder;
use bulkhead_api::{ApiError, Backend, FinishReason, GenEvent, GenerationRequest, ModelCard, Prompt, PromptEncoder, router};
use bulkhead_tokenizer::ChatMessage;
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tower::ServiceExt;

const MODEL: &str = "mock-model";
const MAX_LEN: usize = 2048;

/// A backend that answers every request with a scripted list of events.
struct Mock {
    script: Mutex<Vec<GenEvent>>,
    /// Scripts for the next calls, one each, before `script` is used again.
    next_scripts: Mutex<std::collections::VecDeque<Vec<GenEvent>>>,
    /// Keep the sender after the script (the stream stays open until Finished or a drop).
    keep_open: AtomicBool,
    admit_error: Mutex<Option<ApiError>>,
    senders: Mutex<Vec<mpsc::Sender<GenEvent>>>,
    requests: Mutex<Vec<GenerationRequest>>,
    ready: AtomicBool,
    encoder: PromptEncoder,
}

impl Mock {
    fn new(script: Vec<GenEvent>) -> Arc<Mock> {
        Arc::new(Mock {
            script: Mutex::new(script),
            next_scripts: Mutex::new(Default::default()),
            keep_open: AtomicBool::new(true),
            admit_error: Mutex::new(None),
            senders: Mutex::new(Vec::new()),
            requests: Mutex::new(Vec::new()),
            ready: AtomicBool::new(true),
            encoder: byte_level_encoder(),
        })
    }

    /// "Hello" + ", world", finished by length after 7 prompt and 2 completion tokens.
    fn hello() -> Arc<Mock> {
        Mock::new(vec![
            GenEvent::Text { text: "Hello".into(), logprobs: None },
            GenEvent::Text { text: String::new(), logprobs: None },
            GenEvent::Text { text: ", world".into(), logprobs: None },
            GenEvent::Finished { reason: FinishReason::Length, prompt_tokens: 7, completion_tokens: 2, cached_tokens: 4 },
        ])
    }

    fn last_request(&self) -> GenerationRequest {
        self.requests.lock().unwrap().last().cloned().expect("the backend saw no request")
    }

    fn last_sender(&self) -> mpsc::Sender<GenEvent> {
        self.senders.lock().unwrap().last().cloned().expect("the backend opened no stream")
    }
}

impl Backend for Mock {
    fn models(&self) -> Vec<ModelCard> {
        vec![
            ModelCard { id: MODEL.into(), max_model_len: MAX_LEN, created: 1_700_000_000, owned_by: "test".into() },
            ModelCard { id: "org/with-slash".into(), max_model_len: 512, created: 1, owned_by: "test".into() },
        ]
    }

    fn encoder(&self) -> &PromptEncoder {
        &self.encoder
    }

    fn generate(&self, req: GenerationRequest) -> Result<mpsc::Receiver<GenEvent>, ApiError> {
        self.requests.lock().unwrap().push(req);
        if let Some(e) = self.admit_error.lock().unwrap().take() {
            return Err(e);
        }
        let (tx, rx) = mpsc::channel(64);
        let script = self.next_scripts.lock().unwrap().pop_front().unwrap_or_else(|| self.script.lock().unwrap().clone());
        for ev in script {
            tx.try_send(ev).expect("script fits the channel");
        }
        if self.keep_open.load(Ordering::SeqCst) {
            self.senders.lock().unwrap().push(tx);
        }
        Ok(rx)
    }

    fn ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
}

fn app(mock: &Arc<Mock>) -> Router {
    router(Arc::clone(mock) as Arc<dyn Backend>)
}

fn post(path: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post(path).header(header::CONTENT_TYPE, "application/json").body(body.into()).unwrap()
}

fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

async fn send(app: Router, req: Request<Body>) -> (StatusCode, HeaderMap, Bytes) {
    let resp = app.oneshot(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    (parts.status, parts.headers, axum::body::to_bytes(body, usize::MAX).await.unwrap())
}

async fn send_json(app: Router, req: Request<Body>) -> (StatusCode, Value) {
    let (status, headers, body) = send(app, req).await;
    let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    assert!(ct.starts_with("application/json"), "content-type {ct:?} for body {body:?}");
    (status, serde_json::from_slice(&body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}")))
}

/// Asserts the OpenAI error shape `{"error": {"message", "type", "param", "code"}}`.
fn assert_error(body: &Value, kind: &str, param: Option<&str>) {
    let e = body.get("error").unwrap_or_else(|| panic!("no `error` in {body}"));
    let obj = e.as_object().unwrap_or_else(|| panic!("`error` is not an object: {body}"));
    assert_eq!(obj.len(), 4, "error has exactly message/type/param/code: {body}");
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    assert_eq!(e["type"], kind, "{body}");
    assert!(e["code"].is_null() || e["code"].is_string(), "{body}");
    match param {
        Some(p) => assert_eq!(e["param"], p, "{body}"),
        None => assert!(e["param"].is_null(), "{body}"),
    }
}

async fn expect_error(mock: &Arc<Mock>, path: &str, body: Value, status: StatusCode, param: Option<&str>) -> Value {
    let (s, v) = send_json(app(mock), post(path, body.to_string())).await;
    assert_eq!(s, status, "{body} -> {v}");
    let kind = match status {
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        StatusCode::INTERNAL_SERVER_ERROR => "server_error",
        _ => "invalid_request_error",
    };
    assert_error(&v, kind, param);
    v
}

fn chat(extra: Value) -> Value {
    let mut body = json!({ "model": MODEL, "messages": [{ "role": "user", "content": "Hi" }] });
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    body
}

fn completion(extra: Value) -> Value {
    let mut body = json!({ "model": MODEL, "prompt": "Once upon" });
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    body
}

/// The `data: ` payloads of an SSE body, checking the framing on the way.
fn sse_payloads(body: &[u8]) -> Vec<String> {
    let text = std::str::from_utf8(body).unwrap();
    assert!(text.ends_with("\n\n"), "SSE body ends with a blank line: {text:?}");
    text.trim_end_matches("\n\n")
        .split("\n\n")
        .map(|frame| {
            assert!(!frame.contains('\n'), "one line per event: {frame:?}");
            frame.strip_prefix("data: ").unwrap_or_else(|| panic!("frame without `data: `: {frame:?}")).to_string()
        })
        .collect()
}

fn parse(payload: &str) -> Value {
    serde_json::from_str(payload).unwrap_or_else(|e| panic!("chunk is not JSON ({e}): {payload}"))
}

#[tokio::test]
async fn a_chat_completion_returns_the_backend_text_with_usage() {
    let mock = Mock::hello();
    let (status, v) = send_json(app(&mock), post("/v1/chat/completions", chat(json!({})).to_string())).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"), "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(v["model"], MODEL);
    assert_eq!(v["choices"].as_array().unwrap().len(), 1);
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["choices"][0]["message"], json!({ "role": "assistant", "content": "Hello, world" }));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(
        v["usage"],
        json!({ "prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9, "prompt_tokens_details": { "cached_tokens": 4 } })
    );
    let req = mock.last_request();
    assert_eq!(req.prompt, Prompt::Chat { messages: vec![ChatMessage::new("user", "Hi")], tools: None });
    assert_eq!(req.max_tokens, None);
    // OpenAI's default temperature, and a seed drawn by the server (a migrated stream
    // resumes the same text).
    assert!(req.sampling.seed.is_some(), "a request without a seed gets one");
    assert_eq!(req.sampling, bulkhead_protocol::Sampling { temperature: 1.0, seed: req.sampling.seed, ..Default::default() });
}

#[tokio::test]
async fn a_text_completion_returns_a_text_completion_object() {
    let mock = Mock::new(vec![
        GenEvent::Text { text: " a time".into(), logprobs: None },
        GenEvent::Finished { reason: FinishReason::Stop, prompt_tokens: 2, completion_tokens: 3, cached_tokens: 0 },
    ]);
    let (status, v) = send_json(app(&mock), post("/v1/completions", completion(json!({})).to_string())).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"), "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], " a time");
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        v["usage"],
        json!({ "prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5, "prompt_tokens_details": { "cached_tokens": 0 } })
    );
    assert_eq!(mock.last_request().prompt, Prompt::Text("Once upon".into()));
}

#[tokio::test]
async fn a_chat_stream_sends_role_then_content_then_finish_reason_then_done() {
    let mock = Mock::hello();
    let req = post("/v1/chat/completions", chat(json!({ "stream": true })).to_string());
    let (status, headers, body) = send(app(&mock), req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers[header::CONTENT_TYPE], "text/event-stream");
    let payloads = sse_payloads(&body);
    assert_eq!(payloads.len(), 5, "{payloads:?}");
    assert_eq!(payloads.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = payloads[..4].iter().map(|p| parse(p)).collect();
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for c in &chunks {
        assert_eq!(c["id"], id);
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], MODEL);
        assert_eq!(c["created"], chunks[0]["created"]);
        assert!(c.get("usage").is_none(), "no usage field unless asked: {c}");
        assert_eq!(c["choices"].as_array().unwrap().len(), 1);
    }
    assert_eq!(chunks[0]["choices"][0]["delta"], json!({ "role": "assistant", "content": "" }));
    assert!(chunks[0]["choices"][0]["finish_reason"].is_null());
    assert_eq!(chunks[1]["choices"][0]["delta"], json!({ "content": "Hello" }));
    assert_eq!(chunks[2]["choices"][0]["delta"], json!({ "content": ", world" }));
    assert!(chunks[2]["choices"][0]["finish_reason"].is_null());
    assert_eq!(chunks[3]["choices"][0]["delta"], json!({}));
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn a_stream_sends_a_usage_chunk_before_done_only_when_include_usage_is_set() {
    let mock = Mock::hello();
    let body = chat(json!({ "stream": true, "stream_options": { "include_usage": true } }));
    let (_, _, raw) = send(app(&mock), post("/v1/chat/completions", body.to_string())).await;
    let payloads = sse_payloads(&raw);
    assert_eq!(payloads.len(), 6, "{payloads:?}");
    assert_eq!(payloads[5], "[DONE]");
    let usage = parse(&payloads[4]);
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(
        usage["usage"],
        json!({ "prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9, "prompt_tokens_details": { "cached_tokens": 4 } })
    );
    for p in &payloads[..4] {
        let c = parse(p);
        assert!(c["usage"].is_null() && c.get("usage").is_some(), "usage: null on other chunks: {c}");
    }

    let body = chat(json!({ "stream": true, "stream_options": { "include_usage": false } }));
    let (_, _, raw) = send(app(&mock), post("/v1/chat/completions", body.to_string())).await;
    let payloads = sse_payloads(&raw);
    assert_eq!(payloads.len(), 5);
    assert!(payloads[..4].iter().all(|p| parse(p).get("usage").is_none()));
}

#[tokio::test]
async fn a_text_completion_stream_sends_text_chunks_then_usage_then_done() {
    let mock = Mock::hello();
    let body = completion(json!({ "stream": true, "stream_options": { "include_usage": true } }));
    let (status, _, raw) = send(app(&mock), post("/v1/completions", body.to_string())).await;
    assert_eq!(status, StatusCode::OK);
    let payloads = sse_payloads(&raw);
    assert_eq!(payloads.len(), 5, "{payloads:?}");
    let texts: Vec<Value> = payloads[..3].iter().map(|p| parse(p)).collect();
    for c in &texts {
        assert_eq!(c["object"], "text_completion");
        assert!(c["id"].as_str().unwrap().starts_with("cmpl-"));
    }
    assert_eq!(texts[0]["choices"][0]["text"], "Hello");
    assert_eq!(texts[1]["choices"][0]["text"], ", world");
    assert_eq!(texts[2]["choices"][0]["text"], "");
    assert_eq!(texts[2]["choices"][0]["finish_reason"], "length");
    assert_eq!(parse(&payloads[3])["usage"]["total_tokens"], 9);
    assert_eq!(payloads[4], "[DONE]");
}

#[tokio::test]
async fn a_backend_failure_mid_stream_sends_an_error_chunk_then_done() {
    let mock = Mock::new(vec![
        GenEvent::Text { text: "partial".into(), logprobs: None },
        GenEvent::Failed(ApiError::internal("engine fell over")),
    ]);
    let (status, _, raw) = send(app(&mock), post("/v1/chat/completions", chat(json!({ "stream": true })).to_string())).await;
    assert_eq!(status, StatusCode::OK);
    let payloads = sse_payloads(&raw);
    assert_eq!(payloads.len(), 4, "{payloads:?}");
    assert_eq!(payloads[3], "[DONE]", "clients stop reading at [DONE]; the error chunk says it failed");
    let err = parse(&payloads[2]);
    assert_error(&err, "server_error", None);
    assert_eq!(err["error"]["message"], "engine fell over");
}

#[tokio::test]
async fn a_stream_whose_backend_vanishes_without_finishing_ends_with_an_error_chunk_then_done() {
    let mock = Mock::new(vec![GenEvent::Text { text: "partial".into(), logprobs: None }]);
    mock.keep_open.store(false, Ordering::SeqCst);
    let (_, _, raw) = send(app(&mock), post("/v1/chat/completions", chat(json!({ "stream": true })).to_string())).await;
    let payloads = sse_payloads(&raw);
    assert_eq!(payloads.len(), 4, "{payloads:?}");
    assert_error(&parse(&payloads[2]), "server_error", None);
    assert_eq!(payloads[3], "[DONE]");

    let (status, v) = send_json(app(&mock), post("/v1/chat/completions", chat(json!({})).to_string())).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_error(&v, "server_error", None);
}

#[tokio::test]
async fn a_backend_failure_in_a_non_streaming_request_is_its_error_response() {
    let mock = Mock::new(vec![GenEvent::Failed(ApiError::internal("boom"))]);
    let v = expect_error(&mock, "/v1/chat/completions", chat(json!({})), StatusCode::INTERNAL_SERVER_ERROR, None).await;
    assert_eq!(v["error"]["message"], "boom");
}

#[tokio::test]
async fn admission_errors_come_back_before_any_stream_with_their_status() {
    let mock = Mock::hello();
    *mock.admit_error.lock().unwrap() = Some(ApiError::context_length_exceeded(9000, 100, 8192, "messages"));
    let v = expect_error(&mock, "/v1/chat/completions", chat(json!({ "stream": true })), StatusCode::BAD_REQUEST, Some("messages")).await;
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert_eq!(
        v["error"]["message"],
        "This model's maximum context length is 8192 tokens. However, you requested 9100 tokens \
         (9000 in the messages, 100 in the completion). Please reduce the length of the messages or completion."
    );

    // The completions endpoint's error talks about its prompt.
    *mock.admit_error.lock().unwrap() = Some(ApiError::context_length_exceeded(9000, 100, 8192, "prompt"));
    let v = expect_error(&mock, "/v1/completions", completion(json!({})), StatusCode::BAD_REQUEST, Some("prompt")).await;
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert!(v["error"]["message"].as_str().unwrap().contains("(9000 in the prompt,"), "{v}");

    *mock.admit_error.lock().unwrap() = Some(ApiError::overloaded("full"));
    let resp = app(&mock).oneshot(post("/v1/chat/completions", chat(json!({})).to_string())).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
    let v: Value = serde_json::from_slice(&axum::body::to_bytes(resp.into_body(), usize::MAX).await.unwrap()).unwrap();
    assert_error(&v, "overloaded_error", None);
    assert_eq!(v["error"]["code"], "overloaded");
}

#[tokio::test]
async fn malformed_json_is_a_400_with_an_openai_error_body() {
    let mock = Mock::hello();
    for body in ["{", "{\"model\": ", "not json", "{\"model\": \"x\",}", "[1, 2", "\u{0}"] {
        for path in ["/v1/chat/completions", "/v1/completions"] {
            let (status, v) = send_json(app(&mock), post(path, body)).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{body:?} -> {v}");
            assert_error(&v, "invalid_request_error", None);
        }
    }
    // Valid JSON that is not an object.
    for body in ["[]", "42", "\"text\"", "null"] {
        let (status, v) = send_json(app(&mock), post("/v1/chat/completions", body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body:?} -> {v}");
        assert_error(&v, "invalid_request_error", None);
    }
    assert!(mock.requests.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_missing_body_is_a_400_with_an_openai_error_body() {
    let mock = Mock::hello();
    for body in ["", "  \n"] {
        let (status, v) = send_json(app(&mock), post("/v1/chat/completions", body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_error(&v, "invalid_request_error", None);
    }
}

#[tokio::test]
async fn a_wrong_or_missing_content_type_is_a_400_with_an_openai_error_body() {
    let mock = Mock::hello();
    let body = chat(json!({})).to_string();
    for ct in [Some("text/plain"), Some("application/x-www-form-urlencoded"), Some("multipart/form-data"), None] {
        let mut req = Request::post("/v1/chat/completions");
        if let Some(ct) = ct {
            req = req.header(header::CONTENT_TYPE, ct);
        }
        let (status, v) = send_json(app(&mock), req.body(Body::from(body.clone())).unwrap()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{ct:?} -> {v}");
        assert_error(&v, "invalid_request_error", None);
    }
    // Parameters and case do not matter.
    let req = Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "Application/JSON; charset=utf-8")
        .body(Body::from(body))
        .unwrap();
    let (status, _) = send_json(app(&mock), req).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn wrong_types_of_known_fields_are_400s_that_name_the_field() {
    let mock = Mock::hello();
    let chat_cases = [
        (json!({ "model": 5 }), "model"),
        (json!({ "messages": "Hi" }), "messages"),
        (json!({ "messages": ["Hi"] }), "messages[0]"),
        (json!({ "messages": [{ "role": "user", "content": 5 }] }), "messages[0].content"),
        (json!({ "messages": [{ "role": 1, "content": "Hi" }] }), "messages[0].role"),
        (json!({ "messages": [{ "role": "wizard", "content": "Hi" }] }), "messages[0].role"),
        (json!({ "messages": [{ "role": "user" }] }), "messages[0].content"),
        (json!({ "messages": [{ "role": "user", "content": [{ "type": "text", "text": 3 }] }] }), "messages[0].content[0].text"),
        (json!({ "messages": [{ "role": "user", "content": [{ "type": "image_url", "image_url": {} }] }] }), "messages[0].content[0].type"),
        (json!({ "max_tokens": "10" }), "max_tokens"),
        (json!({ "max_tokens": 10.5 }), "max_tokens"),
        (json!({ "max_completion_tokens": true }), "max_completion_tokens"),
        (json!({ "temperature": "hot" }), "temperature"),
        (json!({ "top_p": true }), "top_p"),
        (json!({ "top_k": 2.5 }), "top_k"),
        (json!({ "seed": "1" }), "seed"),
        (json!({ "seed": 1.5 }), "seed"),
        (json!({ "n": "2" }), "n"),
        (json!({ "stream": "yes" }), "stream"),
        (json!({ "stream_options": true }), "stream_options"),
        (json!({ "stream_options": { "include_usage": "x" } }), "stream_options.include_usage"),
        (json!({ "stop": 5 }), "stop"),
        (json!({ "stop": ["a", 5] }), "stop[1]"),
    ];
    for (extra, param) in chat_cases {
        expect_error(&mock, "/v1/chat/completions", chat(extra), StatusCode::BAD_REQUEST, Some(param)).await;
    }
    let text_cases = [
        (json!({ "prompt": 5 }), "prompt"),
        (json!({ "prompt": [true] }), "prompt[0]"),
        (json!({ "prompt": [[1, -2]] }), "prompt[0][1]"),
        (json!({ "prompt": [] }), "prompt"),
        (json!({ "max_tokens": [] }), "max_tokens"),
    ];
    for (extra, param) in text_cases {
        expect_error(&mock, "/v1/completions", completion(extra), StatusCode::BAD_REQUEST, Some(param)).await;
    }
    expect_error(&mock, "/v1/completions", json!({ "model": MODEL }), StatusCode::BAD_REQUEST, Some("prompt")).await;
    expect_error(&mock, "/v1/chat/completions", json!({ "model": MODEL }), StatusCode::BAD_REQUEST, Some("messages")).await;
    let no_model = json!({ "messages": [{ "role": "user", "content": "Hi" }] });
    expect_error(&mock, "/v1/chat/completions", no_model, StatusCode::BAD_REQUEST, Some("model")).await;
    assert!(mock.requests.lock().unwrap().is_empty(), "no bad request reached the backend");
}

#[tokio::test]
async fn n_outside_one_to_sixteen_is_rejected() {
    let mock = Mock::hello();
    for n in [json!(0), json!(-1), json!(17), json!(100)] {
        expect_error(&mock, "/v1/chat/completions", chat(json!({ "n": n })), StatusCode::BAD_REQUEST, Some("n")).await;
        expect_error(&mock, "/v1/completions", completion(json!({ "n": n })), StatusCode::BAD_REQUEST, Some("n")).await;
    }
    let (status, _) = send_json(app(&mock), post("/v1/chat/completions", chat(json!({ "n": 1 })).to_string())).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn negative_zero_and_huge_numbers_are_rejected() {
    let mock = Mock::hello();
    let cases = [
        (json!({ "max_tokens": -1 }), "max_tokens"),
        (json!({ "max_tokens": 0 }), "max_tokens"),
        (json!({ "max_tokens": 1e30 }), "max_tokens"),
        (json!({ "max_tokens": 1_000_000_000_000_000u64 }), "max_tokens"),
        (json!({ "max_tokens": MAX_LEN + 1 }), "max_tokens"),
        (json!({ "max_completion_tokens": -5 }), "max_completion_tokens"),
        (json!({ "temperature": -0.1 }), "temperature"),
        (json!({ "temperature": 2.5 }), "temperature"),
        (json!({ "temperature": 1e300 }), "temperature"),
        (json!({ "top_p": 0 }), "top_p"),
        (json!({ "top_p": 1.5 }), "top_p"),
        (json!({ "top_p": -1 }), "top_p"),
        (json!({ "top_k": -2 }), "top_k"),
        (json!({ "seed": -1 }), "seed"),
        (json!({ "seed": -1e30 }), "seed"),
        (json!({ "stop": ["a", "b", "c", "d", "e"] }), "stop"),
    ];
    for (extra, param) in cases {
        expect_error(&mock, "/v1/chat/completions", chat(extra), StatusCode::BAD_REQUEST, Some(param)).await;
    }
    // Raw text, so that numbers serde_json would not print can be sent too.
    for raw in [
        r#"{"model":"mock-model","prompt":"x","max_tokens":100000000000000000000000000000000000000}"#,
        r#"{"model":"mock-model","prompt":"x","max_tokens":-100000000000000000000000000000000000000}"#,
        r#"{"model":"mock-model","prompt":"x","temperature":1e999}"#,
    ] {
        let (status, v) = send_json(app(&mock), post("/v1/completions", raw)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{raw} -> {v}");
        assert_error(&v, "invalid_request_error", v["error"]["param"].as_str());
    }
    assert!(mock.requests.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_seed_may_be_any_non_negative_integer() {
    let mock = Mock::hello();
    for raw in ["0", "7", "18446744073709551615", "100000000000000000000000"] {
        let body = format!(r#"{{"model":"mock-model","messages":[{{"role":"user","content":"Hi"}}],"seed":{raw}}}"#);
        let (status, v) = send_json(app(&mock), post("/v1/chat/completions", body)).await;
        assert_eq!(status, StatusCode::OK, "seed {raw} -> {v}");
        assert!(mock.last_request().sampling.seed.is_some());
    }
    assert_eq!(mock.requests.lock().unwrap()[2].sampling.seed, Some(u64::MAX));
}

#[tokio::test]
async fn request_fields_reach_the_backend() {
    let mock = Mock::hello();
    let body = json!({
        "model": MODEL,
        "messages": [
            { "role": "developer", "content": "Be brief." },
            { "role": "user", "content": [{ "type": "text", "text": "one" }, { "type": "text", "text": "two" }] },
            { "role": "assistant", "content": null },
        ],
        "max_tokens": 10,
        "max_completion_tokens": 20,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 3,
        "stop": ["\n\n", "", "END"],
        "n": 1,
        "user": "someone",
    });
    let req = Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .header("x-request-id", "req-abc")
        .body(Body::from(body.to_string()))
        .unwrap();
    let (status, v) = send_json(app(&mock), req).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let r = mock.last_request();
    assert_eq!(r.request_id, "req-abc");
    assert_eq!(r.model, MODEL);
    assert_eq!(
        r.prompt,
        Prompt::Chat {
            messages: vec![
                ChatMessage::new("system", "Be brief."),
                ChatMessage::new("user", "one\ntwo"),
                ChatMessage::new("assistant", ""),
            ],
            tools: None
        }
    );
    assert_eq!(r.max_tokens, Some(20), "max_completion_tokens wins over max_tokens");
    assert_eq!(r.sampling.temperature, 0.7);
    assert_eq!(r.sampling.top_p, 0.9);
    assert_eq!(r.sampling.top_k, 40);
    assert_eq!(r.sampling.seed, Some(3));
    assert_eq!(r.stop, vec!["\n\n".to_string(), "END".to_string()], "empty stop strings are dropped");

    let body = completion(json!({ "prompt": ["only one"], "stop": "x", "max_tokens": 5, "top_k": -1 }));
    let (status, _) = send_json(app(&mock), post("/v1/completions", body.to_string())).await;
    assert_eq!(status, StatusCode::OK);
    let r = mock.last_request();
    assert_eq!(r.prompt, Prompt::Text("only one".into()));
    assert_eq!(r.stop, vec!["x".to_string()]);
    assert_eq!(r.max_tokens, Some(5));
    assert_eq!(r.sampling.top_k, 0, "top_k -1 means off");
}

#[tokio::test]
async fn ignore_eos_reaches_the_backend_and_must_be_a_boolean() {
    let mock = Mock::hello();
    for (path, body) in
        [("/v1/chat/completions", chat(json!({ "ignore_eos": true }))), ("/v1/completions", completion(json!({ "ignore_eos": true })))]
    {
        let (status, v) = send_json(app(&mock), post(path, body.to_string())).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert!(mock.last_request().sampling.ignore_eos, "{path}");
    }
    let (status, _) = send_json(app(&mock), post("/v1/completions", completion(json!({})).to_string())).await;
    assert_eq!(status, StatusCode::OK);
    assert!(!mock.last_request().sampling.ignore_eos, "off unless asked");
    let body = completion(json!({ "ignore_eos": "yes" }));
    expect_error(&mock, "/v1/completions", body, StatusCode::BAD_REQUEST, Some("ignore_eos")).await;
}

#[tokio::test]
async fn repeated_keys_lone_surrogates_and_an_empty_salt_are_refused_saying_why() {
    let mock = Mock::hello();
    for (body, says) in [
        (r#"{"model":"m","prompt":"hi","max_tokens":2,"max_tokens":100000}"#.to_string(), "appears twice"),
        (r#"{"model":"m","prompt":"hi","cache_salt":"\ud800"}"#.to_string(), "lone surrogate"),
    ] {
        let (status, v) = send_json(app(&mock), post("/v1/completions", body.clone())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{body}: {v}");
    }
    let v =
        expect_error(&mock, "/v1/completions", completion(json!({ "cache_salt": "" })), StatusCode::BAD_REQUEST, Some("cache_salt")).await;
    assert!(v["error"]["message"].as_str().unwrap().contains("non-empty"), "{v}");
}

#[tokio::test]
async fn unknown_fields_are_refused_and_null_means_not_given() {
    let mock = Mock::hello();
    let extra = json!({
        "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "metadata": { "a": "1" },
        "store": false, "parallel_tool_calls": null,
        "max_tokens": null, "temperature": null, "stop": null, "seed": null, "stream": null, "n": null,
    });
    let (status, v) = send_json(app(&mock), post("/v1/chat/completions", chat(extra).to_string())).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let r = mock.last_request();
    assert_eq!(r.max_tokens, None);
    assert_eq!(r.sampling, bulkhead_protocol::Sampling { temperature: 1.0, seed: r.sampling.seed, ..Default::default() });
    assert!(r.stop.is_empty());
    let body = chat(json!({ "x-vendor-extension": [1, 2] }));
    let v = expect_error(&mock, "/v1/chat/completions", body, StatusCode::BAD_REQUEST, Some("x-vendor-extension")).await;
    assert_eq!(v["error"]["code"], "unknown_parameter");
}

#[tokio::test]
async fn an_unknown_model_is_a_404_model_not_found() {
    let mock = Mock::hello();
    let body = chat(json!({ "model": "gpt-9" }));
    let v = expect_error(&mock, "/v1/chat/completions", body, StatusCode::NOT_FOUND, Some("model")).await;
    assert_eq!(v["error"]["code"], "model_not_found");
    let body = completion(json!({ "model": "gpt-9", "stream": true }));
    let v = expect_error(&mock, "/v1/completions", body, StatusCode::NOT_FOUND, Some("model")).await;
    assert_eq!(v["error"]["code"], "model_not_found");
    assert!(mock.requests.lock().unwrap().is_empty());
}

#[tokio::test]
async fn empty_messages_are_rejected() {
    let mock = Mock::hello();
    let body = chat(json!({ "messages": [] }));
    expect_error(&mock, "/v1/chat/completions", body, StatusCode::BAD_REQUEST, Some("messages")).await;
}

#[tokio::test]
async fn an_oversize_body_is_a_413_with_an_openai_error_body() {
    let mock = Mock::hello();
    let big = chat(json!({ "messages": [{ "role": "user", "content": "x".repeat(bulkhead_api::MAX_BODY_BYTES + 1) }] }));
    let (status, v) = send_json(app(&mock), post("/v1/chat/completions", big.to_string())).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_error(&v, "invalid_request_error", None);
    assert_eq!(v["error"]["code"], "payload_too_large");
    // Also when the body arrives as a stream with no length known up front.
    let chunks = vec![Ok::<_, std::io::Error>(Bytes::from(vec![b' '; bulkhead_api::MAX_BODY_BYTES])), Ok(Bytes::from_static(b"{}"))];
    let req = Request::post("/v1/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(futures_util::stream::iter(chunks)))
        .unwrap();
    let (status, v) = send_json(app(&mock), req).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_error(&v, "invalid_request_error", None);
}

#[tokio::test]
async fn dropping_a_stream_closes_the_backend_channel() {
    let mock =
        Mock::new(vec![GenEvent::Text { text: "one".into(), logprobs: None }, GenEvent::Text { text: "two".into(), logprobs: None }]);
    let resp = app(&mock).oneshot(post("/v1/chat/completions", chat(json!({ "stream": true })).to_string())).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut frames = resp.into_body().into_data_stream();
    let role = frames.next().await.unwrap().unwrap();
    assert!(role.starts_with(b"data: {"), "{role:?}");
    let one = frames.next().await.unwrap().unwrap();
    assert!(std::str::from_utf8(&one).unwrap().contains("\"content\":\"one\""));
    let sender = mock.last_sender();
    assert!(!sender.is_closed(), "the stream is still open");
    drop(frames);
    assert!(sender.is_closed(), "the client going away reaches the backend");
}

#[tokio::test]
async fn dropping_a_pending_non_streaming_request_closes_the_backend_channel() {
    let mock = Mock::new(vec![GenEvent::Text { text: "never finishes".into(), logprobs: None }]);
    let fut = app(&mock).oneshot(post("/v1/chat/completions", chat(json!({})).to_string()));
    tokio::select! {
        r = fut => panic!("the request cannot finish: {r:?}"),
        () = tokio::time::sleep(Duration::from_millis(300)) => {}
    }
    let sender = mock.last_sender();
    assert!(sender.is_closed(), "the dropped handler dropped its receiver");
}

#[tokio::test]
async fn the_model_list_reports_max_model_len_and_single_models_are_found_by_id() {
    let mock = Mock::hello();
    let (status, v) = send_json(app(&mock), get("/v1/models")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["object"], "list");
    assert_eq!(
        v["data"][0],
        json!({ "id": MODEL, "object": "model", "created": 1_700_000_000u64, "owned_by": "test", "max_model_len": MAX_LEN })
    );
    assert_eq!(v["data"].as_array().unwrap().len(), 2);

    let (status, v) = send_json(app(&mock), get("/v1/models/mock-model")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["id"], MODEL);
    assert_eq!(v["max_model_len"], MAX_LEN);

    let (status, v) = send_json(app(&mock), get("/v1/models/org/with-slash")).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["max_model_len"], 512);

    let (status, v) = send_json(app(&mock), get("/v1/models/nope")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_error(&v, "not_found_error", Some("model"));
    assert_eq!(v["error"]["code"], "model_not_found");
}

#[tokio::test]
async fn health_is_200_and_ready_follows_the_backend() {
    let mock = Mock::hello();
    let (status, _, _) = send(app(&mock), get("/health")).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, _) = send(app(&mock), get("/ready")).await;
    assert_eq!(status, StatusCode::OK);
    mock.ready.store(false, Ordering::SeqCst);
    let (status, _, _) = send(app(&mock), get("/ready")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let (status, _, _) = send(app(&mock), get("/health")).await;
    assert_eq!(status, StatusCode::OK, "health only says the process lives");
}

#[tokio::test]
async fn the_request_id_is_echoed_or_generated() {
    let mock = Mock::hello();
    let req = Request::get("/health").header("x-request-id", "abc-123").body(Body::empty()).unwrap();
    let (_, headers, _) = send(app(&mock), req).await;
    assert_eq!(headers["x-request-id"], "abc-123");

    let (_, h1, _) = send(app(&mock), get("/health")).await;
    let (_, h2, _) = send(app(&mock), get("/health")).await;
    let (a, b) = (h1["x-request-id"].to_str().unwrap(), h2["x-request-id"].to_str().unwrap());
    assert_eq!(a.len(), 32);
    assert_ne!(a, b);

    // Errors carry it too, and an unusable client id is replaced.
    let req = Request::post("/v1/chat/completions").header("x-request-id", "x".repeat(500)).body(Body::empty()).unwrap();
    let (status, headers, _) = send(app(&mock), req).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(headers["x-request-id"].len(), 32);
}

#[tokio::test]
async fn unknown_routes_and_methods_get_openai_error_bodies() {
    let mock = Mock::hello();
    let (status, v) = send_json(app(&mock), get("/v1/nothing")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_error(&v, "not_found_error", None);
    let (status, v) = send_json(app(&mock), get("/v1/chat/completions")).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_error(&v, "invalid_request_error", None);
}

/// A `tracing` writer into a shared buffer.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn the_request_span_carries_the_request_id() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber =
        tracing_subscriber::fmt().with_max_level(tracing::Level::INFO).with_ansi(false).with_writer(move || writer.clone()).finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let mock = Mock::hello();
    let req = Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .header("x-request-id", "trace-me-42")
        .body(Body::from(chat(json!({})).to_string()))
        .unwrap();
    let (status, _, _) = send(app(&mock), req).await;
    assert_eq!(status, StatusCode::OK);
    let logs = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let line = logs.lines().find(|l| l.contains("completed")).unwrap_or_else(|| panic!("no completion log in {logs:?}"));
    assert!(line.contains("request_id=trace-me-42"), "{line}");
}

fn text(t: &str) -> GenEvent {
    GenEvent::Text { text: t.into(), logprobs: None }
}

/// Text released by byte-level token `t` (the mock's vocabulary: token b is byte b), with
/// log-probability `lp` and one alternative.
fn token(t: char, lp: f32) -> GenEvent {
    let id = t as u32;
    GenEvent::Text {
        text: t.to_string(),
        logprobs: Some((id, bulkhead_protocol::TokenLogprobs { logprob: lp, top: vec![(id, lp), (u32::from(b'z'), lp - 1.0)] })),
    }
}

fn finished(reason: FinishReason, completion_tokens: usize) -> GenEvent {
    GenEvent::Finished { reason, prompt_tokens: 5, completion_tokens, cached_tokens: 1 }
}

#[tokio::test]
async fn n_choices_come_back_by_index_each_with_its_own_seed_and_usage_counts_the_prompt_once() {
    let mock = Mock::new(vec![text("same"), finished(FinishReason::Stop, 3)]);
    let (status, v) = send_json(app(&mock), post("/v1/chat/completions", chat(json!({ "n": 3, "seed": 42 })).to_string())).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.iter().map(|c| c["index"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(
        v["usage"],
        json!({ "prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14, "prompt_tokens_details": { "cached_tokens": 1 } })
    );
    let seeds: Vec<Option<u64>> = mock.requests.lock().unwrap().iter().map(|r| r.sampling.seed).collect();
    assert_eq!(seeds.len(), 3);
    assert_eq!(seeds[0], Some(42), "the first choice keeps the seed");
    assert!(seeds[1] != seeds[0] && seeds[2] != seeds[1] && seeds[2] != seeds[0], "{seeds:?}");
    // A batch of two prompts with n = 2: indices prompt * n + choice.
    let mock = Mock::new(vec![text("x"), finished(FinishReason::Length, 1)]);
    let (_, v) = send_json(app(&mock), post("/v1/completions", completion(json!({ "prompt": ["a", "b"], "n": 2 })).to_string())).await;
    assert_eq!(v["choices"].as_array().unwrap().len(), 4, "{v}");
    let prompts: Vec<Prompt> = mock.requests.lock().unwrap().iter().map(|r| r.prompt.clone()).collect();
    assert_eq!(prompts, [Prompt::Text("a".into()), Prompt::Text("a".into()), Prompt::Text("b".into()), Prompt::Text("b".into())]);
    assert_eq!(v["usage"]["prompt_tokens"], 10, "each prompt once");
}

#[tokio::test]
async fn n_choices_stream_each_under_its_index_and_end_once() {
    let mock = Mock::new(vec![text("hi"), finished(FinishReason::Stop, 1)]);
    let body = chat(json!({ "n": 2, "stream": true, "stream_options": { "include_usage": true } }));
    let (status, _, bytes) = send(app(&mock), post("/v1/chat/completions", body.to_string())).await;
    assert_eq!(status, StatusCode::OK);
    let payloads = sse_payloads(&bytes);
    assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = payloads[..payloads.len() - 1].iter().map(|p| parse(p)).collect();
    for i in [0, 1] {
        let mine: Vec<&Value> = chunks.iter().filter(|c| c["choices"][0]["index"] == i).collect();
        assert_eq!(mine[0]["choices"][0]["delta"]["role"], "assistant");
        let text: String = mine.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        assert_eq!(text, "hi");
        assert_eq!(mine.iter().filter(|c| !c["choices"][0]["finish_reason"].is_null()).count(), 1);
    }
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 2);
}

#[tokio::test]
async fn best_of_keeps_the_most_likely_generations() {
    let mock = Mock::new(vec![]);
    mock.next_scripts.lock().unwrap().extend([
        vec![token('a', -3.0), finished(FinishReason::Stop, 1)],
        vec![token('b', -0.5), finished(FinishReason::Stop, 1)],
        vec![token('c', -2.0), finished(FinishReason::Stop, 1)],
    ]);
    let (status, v) = send_json(app(&mock), post("/v1/completions", completion(json!({ "best_of": 3, "n": 2 })).to_string())).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let texts: Vec<&str> = v["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert_eq!(texts, ["b", "c"]);
    assert!(v["choices"][0]["logprobs"].is_null(), "not asked for: {v}");
    assert!(mock.requests.lock().unwrap().iter().all(|r| r.sampling.logprobs == Some(0)), "best_of asks for them itself");
}

#[tokio::test]
async fn log_probabilities_are_named_by_their_tokens_in_both_forms() {
    let mock = Mock::new(vec![token('o', -0.25), token('k', -1.5), finished(FinishReason::Stop, 2)]);
    let (_, v) =
        send_json(app(&mock), post("/v1/chat/completions", chat(json!({ "logprobs": true, "top_logprobs": 1 })).to_string())).await;
    let content = &v["choices"][0]["logprobs"]["content"];
    assert_eq!(
        content[0],
        json!({ "token": "o", "logprob": -0.25, "bytes": [111], "top_logprobs": [{ "token": "o", "logprob": -0.25, "bytes": [111] }, { "token": "z", "logprob": -1.25, "bytes": [122] }] })
    );
    assert_eq!(content[1]["token"], "k");
    let (_, v) = send_json(app(&mock), post("/v1/completions", completion(json!({ "logprobs": 1 })).to_string())).await;
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"], json!(["o", "k"]));
    assert_eq!(lp["token_logprobs"], json!([-0.25, -1.5]));
    assert_eq!(lp["text_offset"], json!([0, 1]));
    assert_eq!(lp["top_logprobs"][0], json!({ "o": -0.25, "z": -1.25 }));
    // Streamed: each token's entry rides on its chunk.
    let (_, _, bytes) = send(app(&mock), post("/v1/chat/completions", chat(json!({ "logprobs": true, "stream": true })).to_string())).await;
    let entries: Vec<Value> = sse_payloads(&bytes)
        .iter()
        .filter(|p| *p != "[DONE]")
        .map(|p| parse(p))
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(entries.iter().map(|e| e["token"].as_str().unwrap()).collect::<String>(), "ok");
    // Echo puts the prompt first, and shifts the text offsets.
    let (_, v) = send_json(app(&mock), post("/v1/completions", completion(json!({ "echo": true })).to_string())).await;
    assert_eq!(v["choices"][0]["text"], "Once uponok");
}

#[tokio::test]
async fn tool_calls_are_parsed_into_the_message_and_streamed_as_deltas() {
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let script = vec![text("Checking."), text(&call[..9]), text(&call[9..]), finished(FinishReason::Stop, 30)];
    let mock = Mock::new(script);
    let tools = json!([{ "type": "function", "function": { "name": "get_weather", "parameters": { "type": "object", "properties": { "city": { "type": "string" } } } } }]);
    let (status, v) = send_json(app(&mock), post("/v1/chat/completions", chat(json!({ "tools": tools })).to_string())).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], "Checking.");
    let tc = &choice["message"]["tool_calls"][0];
    assert_eq!(tc["type"], "function");
    assert_eq!(tc["function"]["name"], "get_weather");
    assert_eq!(serde_json::from_str::<Value>(tc["function"]["arguments"].as_str().unwrap()).unwrap(), json!({ "city": "Paris" }));
    assert!(tc["id"].as_str().unwrap().starts_with("call_"));
    let Prompt::Chat { tools: Some(t), .. } = mock.last_request().prompt else { panic!("the tools reach the backend") };
    assert_eq!(t.defs.len(), 1);
    // Streaming: text deltas, then one delta holding the whole call, then tool_calls.
    let (_, _, bytes) = send(app(&mock), post("/v1/chat/completions", chat(json!({ "tools": tools, "stream": true })).to_string())).await;
    let chunks: Vec<Value> = sse_payloads(&bytes).iter().filter(|p| *p != "[DONE]").map(|p| parse(p)).collect();
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, "Checking.", "no call text leaks into content");
    let calls: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0]["delta"].get("tool_calls")).collect();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0][0]["index"], 0);
    assert_eq!(calls[0][0]["function"]["name"], "get_weather");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");
    // `required` is enforced by a grammar; `none` leaves the text alone.
    send_json(app(&mock), post("/v1/chat/completions", chat(json!({ "tools": tools, "tool_choice": "required" })).to_string())).await;
    assert!(matches!(mock.last_request().sampling.grammar, Some(bulkhead_protocol::GrammarSpec::Lark(_))));
    let (_, v) =
        send_json(app(&mock), post("/v1/chat/completions", chat(json!({ "tools": tools, "tool_choice": "none" })).to_string())).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["choices"][0]["message"]["content"].as_str().unwrap().contains("<tool_call>"));
}

#[tokio::test]
async fn a_grammar_that_does_not_compile_or_an_id_outside_the_vocabulary_is_a_400_before_the_backend() {
    let mock = Mock::hello();
    for (extra, param) in [
        (json!({ "guided_regex": "(unclosed" }), "guided_regex"),
        (json!({ "guided_grammar": "start: undefined_rule" }), "guided_grammar"),
        (
            json!({ "response_format": { "type": "json_schema", "json_schema": { "name": "x", "schema": { "type": "frobnicate" } } } }),
            "response_format",
        ),
        (json!({ "logit_bias": { "999999": 1 } }), "logit_bias"),
        (json!({ "stop_token_ids": [999999] }), "stop_token_ids"),
    ] {
        expect_error(&mock, "/v1/chat/completions", chat(extra), StatusCode::BAD_REQUEST, Some(param)).await;
    }
    expect_error(&mock, "/v1/completions", completion(json!({ "prompt": [999999] })), StatusCode::BAD_REQUEST, Some("prompt")).await;
    assert!(mock.requests.lock().unwrap().is_empty(), "no bad request reached the backend");
    // A good one compiles and reaches it.
    let (status, v) = send_json(app(&mock), post("/v1/chat/completions", chat(json!({ "guided_regex": "[0-9]+" })).to_string())).await;
    assert_eq!(status, StatusCode::OK, "{v}");
}

#[tokio::test]
async fn tokenize_and_detokenize_use_the_served_vocabulary_and_embeddings_are_a_404() {
    let mock = Mock::hello();
    let (status, v) = send_json(app(&mock), post("/tokenize", json!({ "model": MODEL, "prompt": "hi" }).to_string())).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v, json!({ "count": 2, "max_model_len": MAX_LEN, "tokens": [104, 105] }));
    let (_, v) = send_json(app(&mock), post("/tokenize", json!({ "messages": [{ "role": "user", "content": "A" }] }).to_string())).await;
    // <|im_start|>user\nA<|im_end|>\n<|im_start|>assistant\n in the byte-level vocabulary.
    assert_eq!(v["tokens"][0], 256);
    assert_eq!(v["count"], v["tokens"].as_array().unwrap().len());
    let (_, v) = send_json(app(&mock), post("/detokenize", json!({ "tokens": [104, 105] }).to_string())).await;
    assert_eq!(v, json!({ "prompt": "hi" }));
    expect_error(&mock, "/detokenize", json!({ "tokens": [1, 99999] }), StatusCode::BAD_REQUEST, Some("tokens")).await;
    expect_error(&mock, "/detokenize", json!({ "tokens": [-1] }), StatusCode::BAD_REQUEST, Some("tokens[0]")).await;
    expect_error(&mock, "/tokenize", json!({ "model": "other", "prompt": "x" }), StatusCode::NOT_FOUND, Some("model")).await;
    let (status, v) = send_json(app(&mock), post("/tokenize", json!({ "prompt": "hi", "add_special_tokens": false }).to_string())).await;
    assert_eq!((status, &v["tokens"]), (StatusCode::OK, &json!([104, 105])));
    let wrong = json!({ "prompt": "x", "add_special_tokens": "no" });
    expect_error(&mock, "/tokenize", wrong, StatusCode::BAD_REQUEST, Some("add_special_tokens")).await;
    let unknown = json!({ "prompt": "x", "add_generation_prompt": true });
    expect_error(&mock, "/tokenize", unknown, StatusCode::BAD_REQUEST, Some("add_generation_prompt")).await;
    expect_error(&mock, "/detokenize", json!({ "tokens": [1], "x": 1 }), StatusCode::BAD_REQUEST, Some("x")).await;
    let (status, v) = send_json(app(&mock), post("/v1/embeddings", json!({ "model": MODEL, "input": "x" }).to_string())).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_error(&v, "not_found_error", None);
}
