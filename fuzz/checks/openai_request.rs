//! The `openai_request` fuzz check, shared by the cargo-fuzz target (`fuzz/fuzz_targets/
//! openai_request.rs`, nightly) and `crates/api/tests/fuzz_corpus.rs`, which replays the
//! committed corpus on stable.
//!
//! Input: the first byte picks the endpoint (even: chat, odd: text completions); the rest is
//! the body of a `POST` with `Content-Type: application/json`, sent through the real axum
//! router to a backend that admits everything. Properties:
//! - the answer is 2xx, or a 4xx with an OpenAI error body; never 5xx, never a panic;
//! - a 4xx means the backend never saw the request (refusals happen before admission);
//! - a request the backend saw is within what the API promises: the served model,
//!   `max_tokens` within the context, `temperature` in `[0, 2]` (OpenAI's range; the engine
//!   would take up to 100) and `top_p` in `(0, 1]`, which the engine accepts too, at most
//!   four non-empty stop strings; penalties, `min_p`, `logprobs`, `logit_bias` and
//!   `stop_token_ids` in range, token ids (prompts included) in the vocabulary, at most
//!   `MAX_GENERATIONS` generations (prompts × `best_of`).
//!
//! The corpus keeps, besides what `cargo fuzz cmin` selects, hand-written `boundary-*`
//! inputs: requests valid but for one field just out of range, so that a validation check
//! removed turns one of them into a 2xx these properties refuse.

use std::sync::{Arc, Mutex, OnceLock};

use axum::body::Body;
use axum::http::{Request, header};
use bulkhead_api::openai::{MAX_GENERATIONS, MAX_STOP, MAX_TEMPERATURE, MAX_TOP_LOGPROBS};
use bulkhead_api::testing::byte_level_encoder;
use bulkhead_api::{ApiError, Backend, FinishReason, GenEvent, GenerationRequest, ModelCard, Prompt, PromptEncoder, router};
use serde_json::Value;
use tokio::sync::mpsc;
use tower::ServiceExt;

/// The one model served.
pub const MODEL: &str = "fuzz-model";
/// Its context length (small, so `max_tokens` over it is easy to reach).
pub const MAX_LEN: usize = 64;
/// The byte-level vocabulary's size (256 bytes and two ChatML tokens).
const VOCAB: usize = 258;

/// Admits every request with a two-event answer, keeping what it was asked.
struct Admit {
    seen: Mutex<Vec<GenerationRequest>>,
    encoder: PromptEncoder,
}

impl Default for Admit {
    fn default() -> Self {
        Admit { seen: Mutex::new(Vec::new()), encoder: byte_level_encoder() }
    }
}

impl Backend for Admit {
    fn encoder(&self) -> &PromptEncoder {
        &self.encoder
    }

    fn models(&self) -> Vec<ModelCard> {
        vec![ModelCard { id: MODEL.into(), max_model_len: MAX_LEN, created: 0, owned_by: "fuzz".into() }]
    }

    fn generate(&self, req: GenerationRequest) -> Result<mpsc::Receiver<GenEvent>, ApiError> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).push(req);
        let (tx, rx) = mpsc::channel(2);
        let done = GenEvent::Finished { reason: FinishReason::Stop, prompt_tokens: 1, completion_tokens: 1, cached_tokens: 0 };
        for ev in [GenEvent::Text { text: "ok".into(), logprobs: None }, done] {
            tx.try_send(ev).map_err(|e| ApiError::internal(e.to_string()))?;
        }
        Ok(rx)
    }

    fn ready(&self) -> bool {
        true
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().enable_time().build().expect("a current-thread runtime"))
}

/// Runs one input; panics if a property fails.
pub fn check(data: &[u8]) {
    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    let path = if pick % 2 == 0 { "/v1/chat/completions" } else { "/v1/completions" };
    let backend = Arc::new(Admit::default());
    let req =
        Request::post(path).header(header::CONTENT_TYPE, "application/json").body(Body::from(body.to_vec())).expect("a valid request");
    let (status, content_type, out) = runtime().block_on(async {
        let resp = router(Arc::clone(&backend) as Arc<dyn Backend>).oneshot(req).await.expect("the router is infallible");
        let (parts, body) = resp.into_parts();
        let ct = parts.headers.get(header::CONTENT_TYPE).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        let bytes = axum::body::to_bytes(body, usize::MAX).await.expect("the body is readable");
        (parts.status, ct.unwrap_or_default(), bytes)
    });
    let seen = std::mem::take(&mut *backend.seen.lock().unwrap_or_else(|e| e.into_inner()));
    let out = String::from_utf8_lossy(&out);
    assert!(!status.is_server_error(), "{status} for {:?}: {out}", String::from_utf8_lossy(body));
    if status.is_client_error() {
        assert!(seen.is_empty(), "{status} after the backend admitted {seen:?}");
        assert!(content_type.starts_with("application/json"), "{status} as {content_type}");
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{status} body is not JSON ({e}): {out}"));
        assert_error_body(&v);
        return;
    }
    assert!(status.is_success(), "{status}: {out}");
    assert!(!seen.is_empty(), "{status} without reaching the backend: {out}");
    assert!(seen.len() <= MAX_GENERATIONS, "{} generations for one request", seen.len());
    seen.iter().for_each(assert_runnable);
    if content_type.starts_with("text/event-stream") {
        assert!(out.ends_with("data: [DONE]\n\n"), "unterminated stream: {out}");
    } else {
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{status} body is not JSON ({e}): {out}"));
        assert!(v["choices"][0].is_object(), "no choice in {v}");
    }
}

/// `{"error": {"message", "type", "param", "code"}}`, nothing else.
fn assert_error_body(v: &Value) {
    let e = v["error"].as_object().unwrap_or_else(|| panic!("no error object in {v}"));
    assert_eq!(e.len(), 4, "error has exactly message/type/param/code: {v}");
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e["param"].is_null() || e["param"].is_string(), "{v}");
    assert!(e["code"].is_null() || e["code"].is_string(), "{v}");
}

/// What validation promises the backend.
fn assert_runnable(r: &GenerationRequest) {
    assert_eq!(r.model, MODEL);
    if let Some(n) = r.max_tokens {
        assert!((1..=MAX_LEN).contains(&n), "max_tokens {n}");
    }
    let s = &r.sampling;
    let in_range = (0.0..=MAX_TEMPERATURE as f32).contains(&s.temperature) && s.top_p > 0.0 && s.top_p <= 1.0;
    assert!(in_range && bulkhead_engine::sampling::validate(s).is_ok(), "sampling out of range: {s:?}");
    assert!(r.stop.len() <= MAX_STOP && r.stop.iter().all(|s| !s.is_empty()), "stop {:?}", r.stop);
    let penalties = (-2.0..=2.0).contains(&s.presence_penalty)
        && (-2.0..=2.0).contains(&s.frequency_penalty)
        && s.repetition_penalty > 0.0
        && s.repetition_penalty <= 2.0;
    assert!(penalties && (0.0..=1.0).contains(&s.min_p), "penalties or min_p out of range: {s:?}");
    assert!(s.logprobs.is_none_or(|n| u64::from(n) <= MAX_TOP_LOGPROBS), "logprobs {:?}", s.logprobs);
    let vocab = VOCAB as u32;
    assert!(s.logit_bias.iter().all(|&(t, b)| t < vocab && (-100.0..=100.0).contains(&b)), "logit_bias {:?}", s.logit_bias);
    assert!(s.stop_token_ids.iter().all(|&t| t < vocab), "stop_token_ids {:?}", s.stop_token_ids);
    if let Prompt::Tokens(ids) = &r.prompt {
        assert!(!ids.is_empty() && ids.iter().all(|&t| t < vocab), "token prompt {ids:?}");
    }
    if let Some(m) = r.max_tokens {
        assert!(s.min_tokens as usize <= m, "min_tokens {} over max_tokens {m}", s.min_tokens);
    }
}
