//! A small OpenAI-API client: `/v1/models`, and `/v1/completions` or `/v1/chat/completions`,
//! streamed (SSE) or not, with the timing of every content chunk. Works against any
//! OpenAI-compatible server; nothing here knows Bulkhead.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Value, json};

use crate::ClientError;
use crate::http::{self, Timeouts, Url};
use crate::sse::SseParser;

/// Largest non-streamed response body accepted.
const MAX_BODY_BYTES: usize = 64 << 20;

/// Who the client is and how long it waits.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The server.
    pub url: Url,
    /// Sent as `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Extra headers on every request (e.g. a tenant header).
    pub headers: Vec<(String, String)>,
    /// Time limits of each request.
    pub timeouts: Timeouts,
}

/// A client; cheap to clone and share between tasks.
#[derive(Debug, Clone)]
pub struct Client {
    cfg: Arc<ClientConfig>,
}

/// Which endpoint a completion goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// `/v1/completions`: the prompt is raw text.
    Completions,
    /// `/v1/chat/completions`: the prompt is one user message.
    Chat,
}

impl Api {
    /// The request path.
    pub fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
        }
    }
}

/// One completion to ask for.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    /// Endpoint.
    pub api: Api,
    /// The `model` field.
    pub model: String,
    /// Text (completions) or the user message (chat).
    pub prompt: String,
    /// `max_tokens`.
    pub max_tokens: u32,
    /// `temperature` (0 = greedy).
    pub temperature: f32,
    /// Send `ignore_eos: true` (llama.cpp, vLLM and Bulkhead honour it) for fixed lengths.
    pub ignore_eos: bool,
    /// Stream with SSE (and ask for a usage chunk).
    pub stream: bool,
}

impl CompletionRequest {
    /// The JSON body.
    pub fn body(&self) -> Value {
        let mut b = json!({ "model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature });
        match self.api {
            Api::Completions => b["prompt"] = json!(self.prompt),
            Api::Chat => b["messages"] = json!([{ "role": "user", "content": self.prompt }]),
        }
        if self.ignore_eos {
            b["ignore_eos"] = json!(true);
        }
        if self.stream {
            b["stream"] = json!(true);
            b["stream_options"] = json!({ "include_usage": true });
        }
        b
    }
}

/// Token counts reported by the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.completion_tokens`.
    pub completion_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`: prompt tokens the server took from its
    /// prefix cache, when it says (vLLM with `--enable-prompt-tokens-details`, OpenAI).
    pub cached_tokens: Option<u64>,
}

impl Usage {
    fn from_json(v: &Value) -> Option<Usage> {
        Some(Usage {
            prompt_tokens: v.get("prompt_tokens")?.as_u64()?,
            completion_tokens: v.get("completion_tokens")?.as_u64()?,
            cached_tokens: v.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64),
        })
    }
}

/// When to hang up on a streamed response early (the probe's aborted requests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HangUp {
    /// Read the whole response.
    Never,
    /// Close the connection after this many content chunks.
    AfterChunks(usize),
}

/// What one completion request produced, with its timing.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// HTTP status.
    pub status: u16,
    /// The generated text (concatenated deltas when streamed).
    pub text: String,
    /// The last `finish_reason` seen.
    pub finish_reason: Option<String>,
    /// `usage`, if the server sent it.
    pub usage: Option<Usage>,
    /// Chunks that carried text (streamed).
    pub content_chunks: usize,
    /// Time from sending the request to the first content chunk (streamed).
    pub ttft: Option<Duration>,
    /// Gaps between consecutive content chunks (streamed).
    pub itl: Vec<Duration>,
    /// Time from sending to the end of the response (or the hang-up).
    pub latency: Duration,
    /// The error the server reported: a non-2xx body, or an error event in the stream.
    pub error: Option<String>,
    /// `data: [DONE]` arrived (streamed).
    pub done: bool,
    /// We hung up before the end ([`HangUp`]).
    pub hung_up: bool,
}

impl Outcome {
    /// Whether the request succeeded: 2xx, no error event, and (when streamed) a complete
    /// stream.
    pub fn ok(&self, streamed: bool) -> bool {
        (200..300).contains(&self.status) && self.error.is_none() && (!streamed || self.done || self.hung_up)
    }

    /// Output tokens: `usage.completion_tokens` when given, else content chunks (one token
    /// per chunk is what servers send when streaming).
    pub fn output_tokens(&self) -> u64 {
        self.usage.map_or(self.content_chunks as u64, |u| u.completion_tokens)
    }
}

/// A model listed by `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelInfo {
    /// Its id.
    pub id: String,
    /// The context the server says it serves, if it says (`max_model_len`, vLLM and
    /// Bulkhead; `context_length`; `meta.n_ctx` style fields are the model's training
    /// context, not the server's, and are not used).
    pub context: Option<u64>,
}

impl Client {
    /// A client with this configuration.
    pub fn new(cfg: ClientConfig) -> Client {
        Client { cfg: Arc::new(cfg) }
    }

    /// The configuration.
    pub fn config(&self) -> &ClientConfig {
        &self.cfg
    }

    /// The same server under another identity (API key and extra headers): a tenant.
    pub fn with_identity(&self, api_key: Option<String>, headers: Vec<(String, String)>) -> Client {
        Client::new(ClientConfig { api_key, headers, ..(*self.cfg).clone() })
    }

    fn headers(&self, json_body: bool) -> Vec<(String, String)> {
        let mut h = Vec::with_capacity(self.cfg.headers.len() + 3);
        h.push(("Accept".to_string(), "application/json, text/event-stream".to_string()));
        if json_body {
            h.push(("Content-Type".to_string(), "application/json".to_string()));
        }
        if let Some(k) = &self.cfg.api_key {
            h.push(("Authorization".to_string(), format!("Bearer {k}")));
        }
        h.extend(self.cfg.headers.iter().cloned());
        h
    }

    /// Send a request; the response body is read by the caller. Dropping the response
    /// closes the connection.
    pub async fn request(&self, method: &str, path: &str, body: Option<&Value>) -> Result<http::Response, ClientError> {
        let bytes = body.map(|b| b.to_string().into_bytes());
        http::send(&self.cfg.url, method, path, &self.headers(body.is_some()), bytes.as_deref(), self.cfg.timeouts).await
    }

    /// `GET path`, the body as JSON (a non-JSON body becomes a JSON string).
    pub async fn get_json(&self, path: &str) -> Result<(u16, Value), ClientError> {
        let mut r = self.request("GET", path, None).await?;
        let body = r.body(MAX_BODY_BYTES).await?;
        Ok((r.status, json_or_string(&body)))
    }

    /// The models the server lists.
    pub async fn models(&self) -> Result<Vec<ModelInfo>, ClientError> {
        let (status, v) = self.get_json("/v1/models").await?;
        if !(200..300).contains(&status) {
            return Err(ClientError::Status { status, body: v.to_string() });
        }
        let data =
            v.get("data").and_then(Value::as_array).ok_or_else(|| ClientError::Protocol(format!("/v1/models has no `data` list: {v}")))?;
        Ok(data
            .iter()
            .filter_map(|m| {
                let id = m.get("id")?.as_str()?.to_string();
                let context = ["max_model_len", "context_length", "context_window"].iter().find_map(|k| m.get(*k).and_then(Value::as_u64));
                Some(ModelInfo { id, context })
            })
            .collect())
    }

    /// Run one completion, timing every content chunk.
    pub async fn complete(&self, req: &CompletionRequest, hang_up: HangUp) -> Result<Outcome, ClientError> {
        self.complete_body(req.api, &req.body(), hang_up).await
    }

    /// Run one completion whose JSON body the caller built (e.g. a chat with several
    /// messages), timing every content chunk. The body decides whether the answer streams.
    pub async fn complete_body(&self, api: Api, body: &Value, hang_up: HangUp) -> Result<Outcome, ClientError> {
        let t0 = Instant::now();
        let mut resp = self.request("POST", api.path(), Some(body)).await?;
        let mut out = Outcome { status: resp.status, ..Outcome::default() };
        let is_sse = resp.header("content-type").is_some_and(|c| c.starts_with("text/event-stream"));
        if !(200..300).contains(&resp.status) || !is_sse {
            let body = json_or_string(&resp.body(MAX_BODY_BYTES).await?);
            out.latency = t0.elapsed();
            if (200..300).contains(&resp.status) {
                read_choice(&body, api, &mut out);
                out.usage = body.get("usage").and_then(Usage::from_json);
                out.done = true; // a whole JSON answer is complete by definition
            } else {
                out.error = Some(error_text(&body));
            }
            return Ok(out);
        }
        let mut sse = SseParser::new();
        let mut last: Option<Instant> = None;
        'read: while let Some(bytes) = resp.chunk().await? {
            let now = Instant::now();
            for ev in sse.push(&bytes)? {
                if ev.data.trim() == "[DONE]" {
                    out.done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(&ev.data)
                    .map_err(|e| ClientError::Protocol(format!("stream event is not JSON ({e}): {:.200}", ev.data)))?;
                if ev.event.as_deref() == Some("error") || v.get("error").is_some() {
                    out.error = Some(error_text(&v));
                    continue;
                }
                if let Some(u) = v.get("usage").and_then(Usage::from_json) {
                    out.usage = Some(u);
                }
                let before = out.text.len();
                read_choice(&v, api, &mut out);
                if out.text.len() > before {
                    out.content_chunks += 1;
                    match last {
                        None => out.ttft = Some(now - t0),
                        Some(prev) => out.itl.push(now - prev),
                    }
                    last = Some(now);
                    if hang_up == HangUp::AfterChunks(out.content_chunks) {
                        out.hung_up = true;
                        break 'read;
                    }
                }
            }
        }
        out.latency = t0.elapsed();
        Ok(out)
    }
}

/// Append the text and finish reason of `choices[0]` (a whole answer or a stream chunk).
fn read_choice(v: &Value, api: Api, out: &mut Outcome) {
    let Some(c) = v.get("choices").and_then(|c| c.get(0)) else { return };
    let text = match api {
        Api::Completions => c.get("text"),
        Api::Chat => c.get("delta").or_else(|| c.get("message")).and_then(|m| m.get("content")),
    };
    if let Some(t) = text.and_then(Value::as_str) {
        out.text.push_str(t);
    }
    if let Some(f) = c.get("finish_reason").and_then(Value::as_str) {
        out.finish_reason = Some(f.to_string());
    }
}

fn json_or_string(body: &[u8]) -> Value {
    serde_json::from_slice(body).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()))
}

/// The message of an OpenAI error body (`{"error": {"message": ..}}`), else the whole body.
fn error_text(v: &Value) -> String {
    match v.get("error") {
        Some(e) => e.get("message").and_then(Value::as_str).map_or_else(|| e.to_string(), str::to_string),
        None => match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        },
    }
}
