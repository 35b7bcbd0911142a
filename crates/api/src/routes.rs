//! The axum [`Router`]: OpenAI endpoints over a [`Backend`], the JSON extractor whose
//! rejections are OpenAI error bodies, server-sent-event streaming, and the `x-request-id`
//! middleware. Each handler carries its `#[utoipa::path]` description for the OpenAPI
//! document ([`crate::openapi`]).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::PathRejection;
use axum::extract::{DefaultBodyLimit, Extension, FromRequest, Path, Request, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use serde_json::Value;
use tokio::sync::mpsc::Receiver;
use tracing::{Instrument, Span};
use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
use utoipa::{IntoResponses, ToSchema};

use crate::backend::{Backend, GenEvent, GenerationRequest, ModelCard};
use crate::error::{ApiError, ErrorBody, ErrorKind};
use crate::ids::{random_hex, unix_now};
use crate::tenants::{Tenant, Tenants};
use crate::trace::{TRACEPARENT, TraceParent};
use crate::openai::{
    self, AssistantMessage, ChatChoice, ChatChunk, ChatCompletion, ChatCompletionRequest,
    ChunkChoice, CompletionParams, CompletionRequest, Delta, ModelList, ModelObject, TextChoice,
    TextCompletion, Usage,
};

/// Largest accepted request body; larger ones get 413.
pub const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

/// The request-id header, echoed on every response.
pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Longest client-supplied `x-request-id` kept; longer (or non-ASCII) ones are replaced.
const MAX_REQUEST_ID_LEN: usize = 128;

/// The request's id, as a request extension: the client's `x-request-id` or a fresh one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XRequestId(pub String);

#[derive(Clone)]
struct AppState {
    backend: Arc<dyn Backend>,
}

/// The OpenAI-compatible HTTP API over `backend`: `POST /v1/chat/completions`,
/// `POST /v1/completions`, `GET /v1/models`, `GET /v1/models/{id}`, `GET /health`,
/// `GET /ready`, and its OpenAPI document at `GET /openapi.json`. Every error, including
/// unknown routes and unreadable bodies, is an OpenAI error body. No authentication: every
/// request belongs to the tenant `default`.
pub fn router(backend: Arc<dyn Backend>) -> Router {
    router_with_tenants(backend, Arc::new(Tenants::open()))
}

/// [`router`] where every `/v1/` request must carry the API key of one of `tenants`
/// (when they configure any): 401 `invalid_api_key` otherwise, before the body is read.
pub fn router_with_tenants(backend: Arc<dyn Backend>, tenants: Arc<Tenants>) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(get_model))
        .route_layer(middleware::from_fn_with_state(tenants, authenticate));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/openapi.json", get(openapi_json))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(AppState { backend })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn(request_id))
}

/// Takes the client's `x-request-id` (or makes one) and continues its W3C `traceparent` (or
/// starts a trace), runs the request inside a span with fields `request_id` and `trace_id`,
/// and returns both headers on the response (`traceparent` naming this request's span).
async fn request_id(mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(&X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|s| {
            !s.is_empty()
                && s.len() <= MAX_REQUEST_ID_LEN
                && s.bytes().all(|b| b.is_ascii_graphic())
        })
        .map_or_else(random_hex, str::to_owned);
    let trace = TraceParent::continue_or_start(req.headers());
    req.extensions_mut().insert(XRequestId(id.clone()));
    req.extensions_mut().insert(trace);
    let span = tracing::info_span!(
        "request",
        request_id = %id,
        trace_id = %trace.trace_id,
        method = %req.method(),
        path = %req.uri().path(),
        tenant = tracing::field::Empty
    );
    let mut resp = next.run(req).instrument(span).await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert(X_REQUEST_ID.clone(), v);
    }
    if let Ok(v) = HeaderValue::from_str(&trace.to_string()) {
        resp.headers_mut().insert(TRACEPARENT.clone(), v);
    }
    resp
}

/// The tenant of a `/v1/` request, from its API key (never from its body), as a request
/// extension and on the request's span; 401 before anything else when the key is wrong.
async fn authenticate(State(tenants): State<Arc<Tenants>>, mut req: Request, next: Next) -> Response {
    match tenants.authenticate(req.headers()) {
        Ok(t) => {
            Span::current().record("tenant", &*t.name);
            req.extensions_mut().insert(t);
            next.run(req).await
        }
        Err(e) => {
            tracing::info!(code = e.code, "refused: API key");
            e.into_response()
        }
    }
}

/// A JSON body whose every rejection (wrong Content-Type, unreadable or oversize body,
/// malformed JSON) is an [`ApiError`], never axum's plain-text rejection.
#[derive(Debug, Clone)]
pub struct OpenAiJson(pub Value);

/// How long a request body may take to arrive, as a request extension the server sets
/// (`--http-body-timeout-ms`); [`DEFAULT_BODY_TIMEOUT`] without one. A body still arriving
/// after it gets 408.
#[derive(Clone, Copy, Debug)]
pub struct BodyTimeout(pub std::time::Duration);

/// The body read timeout when the server sets none.
pub const DEFAULT_BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

impl<S: Send + Sync> FromRequest<S> for OpenAiJson {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let ct = req
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        match ct.as_deref() {
            Some(ct) if is_json(ct) => {}
            Some(ct) => {
                return Err(ApiError::bad_request(format!(
                    "Invalid Content-Type header ({ct}): expected application/json."
                )));
            }
            None => {
                return Err(ApiError::bad_request(
                    "Missing Content-Type header: expected application/json.",
                ));
            }
        }
        let limit = req.extensions().get::<BodyTimeout>().map_or(DEFAULT_BODY_TIMEOUT, |t| t.0);
        let read = tokio::time::timeout(limit, Bytes::from_request(req, state))
            .await
            .map_err(|_| ApiError::body_timeout(limit))?;
        let bytes = read.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::payload_too_large(MAX_BODY_BYTES)
            } else {
                ApiError::bad_request(format!("Could not read the request body: {r}"))
            }
        })?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(ApiError::bad_request(
                "We could not parse the JSON body of your request: the body is empty. Send a JSON object.",
            ));
        }
        serde_json::from_slice(&bytes).map(OpenAiJson).map_err(|e| {
            ApiError::bad_request(format!(
                "We could not parse the JSON body of your request ({e}). Send valid JSON with Content-Type: application/json."
            ))
        })
    }
}

fn is_json(content_type: &str) -> bool {
    let mime = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
}

/// Which completion endpoint a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Text,
}

/// The errors a completion request may get, as OpenAPI responses; every body is an
/// `ErrorResponse` ([`ErrorBody`]).
struct CompletionErrors;

impl IntoResponses for CompletionErrors {
    fn responses() -> BTreeMap<String, RefOr<utoipa::openapi::Response>> {
        [
            (
                StatusCode::BAD_REQUEST,
                "Invalid body or field (`param` names it), or prompt plus `max_tokens` over the \
                 context (`code: context_length_exceeded`).",
            ),
            (
                StatusCode::UNAUTHORIZED,
                "With API keys configured: a missing or unknown `Authorization: Bearer` key \
                 (`code: invalid_api_key`).",
            ),
            (
                StatusCode::NOT_FOUND,
                "Unknown `model` (`code: model_not_found`).",
            ),
            (StatusCode::PAYLOAD_TOO_LARGE, "The body is over 4 MiB."),
            (
                StatusCode::TOO_MANY_REQUESTS,
                "Too much is waiting to take this request now (`type: rate_limit_error`); retry \
                 after `Retry-After` seconds.",
            ),
            (StatusCode::INTERNAL_SERVER_ERROR, "The server failed."),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "No capacity now (`type: overloaded_error`); retry after `Retry-After` seconds.",
            ),
        ]
        .into_iter()
        .map(|(status, why)| (status.as_str().to_owned(), error_response(why)))
        .collect()
    }
}

/// An OpenAPI response with an `ErrorResponse` body.
fn error_response(description: &str) -> RefOr<utoipa::openapi::Response> {
    let body = ContentBuilder::new()
        .schema(Some(Ref::from_schema_name(ErrorBody::name())))
        .build();
    ResponseBuilder::new()
        .description(description)
        .content("application/json", body)
        .into()
}

/// Create a chat completion.
///
/// With `stream: true` the answer is `text/event-stream`: one `chat.completion.chunk` per
/// `data:` line (the first carries `role`, the last content chunk `finish_reason`, then a
/// usage chunk if `stream_options.include_usage`), ending with `data: [DONE]`. An error after
/// the stream started arrives as a `data:` line holding an error body, then `data: [DONE]`.
#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    tag = "completions",
    request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "The completion (JSON), or its chunks (server-sent events).", content(
            (ChatCompletion = "application/json"),
            (ChatChunk = "text/event-stream"),
        )),
        CompletionErrors,
    )
)]
async fn chat_completions(
    State(st): State<AppState>,
    Extension(rid): Extension<XRequestId>,
    Extension(trace): Extension<TraceParent>,
    Extension(tenant): Extension<Tenant>,
    OpenAiJson(body): OpenAiJson,
) -> Result<Response, ApiError> {
    complete(st, rid, trace, tenant, Endpoint::Chat, openai::parse_chat(&body)?).await
}

/// Create a text completion.
///
/// With `stream: true` the answer is `text/event-stream`: one `text_completion` object per
/// `data:` line (`text` is the delta), then a usage object if `stream_options.include_usage`,
/// ending with `data: [DONE]`.
#[utoipa::path(
    post,
    path = "/v1/completions",
    tag = "completions",
    request_body = CompletionRequest,
    responses(
        (status = 200, description = "The completion (JSON), or its chunks (server-sent events).", content(
            (TextCompletion = "application/json"),
            (TextCompletion = "text/event-stream"),
        )),
        CompletionErrors,
    )
)]
async fn completions(
    State(st): State<AppState>,
    Extension(rid): Extension<XRequestId>,
    Extension(trace): Extension<TraceParent>,
    Extension(tenant): Extension<Tenant>,
    OpenAiJson(body): OpenAiJson,
) -> Result<Response, ApiError> {
    complete(st, rid, trace, tenant, Endpoint::Text, openai::parse_completion(&body)?).await
}

fn find_model(backend: &dyn Backend, name: &str) -> Result<ModelCard, ApiError> {
    backend
        .models()
        .into_iter()
        .find(|c| c.id == name)
        .ok_or_else(|| ApiError::model_not_found(name))
}

async fn complete(
    st: AppState,
    rid: XRequestId,
    trace: TraceParent,
    tenant: Tenant,
    endpoint: Endpoint,
    p: CompletionParams,
) -> Result<Response, ApiError> {
    let card = find_model(st.backend.as_ref(), &p.model)?;
    p.check_against(&card)?;
    let req = GenerationRequest {
        request_id: rid.0,
        trace_id: trace.trace_id,
        model: card.id.clone(),
        prompt: p.prompt,
        max_tokens: p.max_tokens,
        sampling: p.sampling,
        stop: p.stop,
        tenant,
        cache_salt: p.cache_salt,
    };
    let backend = Arc::clone(&st.backend);
    // Admission may block (tokenising, waiting for the engine between steps).
    let rx = tokio::task::spawn_blocking(move || backend.generate(req))
        .await
        .map_err(|e| ApiError::internal(format!("the backend failed to admit the request: {e}")))?
        .map_err(|mut e| {
            if endpoint == Endpoint::Text && e.param.as_deref() == Some("messages") {
                e.param = Some("prompt".into());
            }
            e
        })?;
    let meta = Meta {
        id: match endpoint {
            Endpoint::Chat => format!("chatcmpl-{}", random_hex()),
            Endpoint::Text => format!("cmpl-{}", random_hex()),
        },
        created: unix_now(),
        model: card.id,
        endpoint,
        include_usage: p.include_usage,
    };
    if p.stream {
        // Wait for the first event before answering 200: a refusal that only a worker can
        // make (its own admission, I3) still reaches the client as its HTTP status.
        let mut rx = rx;
        let first = rx.recv().await;
        if let Some(GenEvent::Failed(e)) = first {
            return Err(e);
        }
        Ok(stream_response(meta, first, rx))
    } else {
        collect_response(meta, rx).await
    }
}

/// What every response object of one completion shares.
struct Meta {
    id: String,
    created: u64,
    model: String,
    endpoint: Endpoint,
    include_usage: bool,
}

async fn collect_response(meta: Meta, mut rx: Receiver<GenEvent>) -> Result<Response, ApiError> {
    let mut text = String::new();
    let (reason, usage) = loop {
        match rx.recv().await {
            Some(GenEvent::Text(t)) => text.push_str(&t),
            Some(GenEvent::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                break (reason, Usage::new(prompt_tokens, completion_tokens, cached_tokens));
            }
            Some(GenEvent::Failed(e)) => return Err(e),
            None => return Err(ApiError::internal("The generation ended without a result.")),
        }
    };
    tracing::info!(
        prompt_tokens = usage.prompt_tokens,
        completion_tokens = usage.completion_tokens,
        finish_reason = reason.as_str(),
        "completed"
    );
    let Meta {
        id,
        created,
        model,
        endpoint,
        ..
    } = meta;
    Ok(match endpoint {
        Endpoint::Chat => Json(ChatCompletion {
            id,
            object: "chat.completion",
            created,
            model,
            choices: vec![ChatChoice {
                index: 0,
                message: AssistantMessage {
                    role: "assistant",
                    content: text,
                },
                logprobs: None,
                finish_reason: reason.as_str(),
            }],
            usage,
        })
        .into_response(),
        Endpoint::Text => Json(TextCompletion {
            id,
            object: "text_completion",
            created,
            model,
            choices: vec![TextChoice {
                index: 0,
                text,
                logprobs: None,
                finish_reason: Some(reason.as_str()),
            }],
            usage: Some(Some(usage)),
        })
        .into_response(),
    })
}

/// State of one SSE stream. Dropping it (the client went away) drops the receiver, which
/// tells the backend to abort.
struct StreamState {
    /// An event already taken from `rx`, delivered first.
    first: Option<GenEvent>,
    rx: Receiver<GenEvent>,
    meta: Meta,
    started: bool,
    done: bool,
}

fn stream_response(meta: Meta, first: Option<GenEvent>, rx: Receiver<GenEvent>) -> Response {
    let span = Span::current();
    let state = StreamState {
        first,
        rx,
        meta,
        started: false,
        done: false,
    };
    let stream = futures_util::stream::unfold(state, move |mut st| {
        async move {
            if st.done {
                return None;
            }
            let frame = next_frames(&mut st).await;
            Some((Ok::<_, Infallible>(Bytes::from(frame)), st))
        }
        .instrument(span.clone())
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

/// The next SSE frame(s) of a stream; sets `done` after the last.
async fn next_frames(st: &mut StreamState) -> String {
    if !st.started {
        st.started = true;
        if st.meta.endpoint == Endpoint::Chat {
            let delta = Delta {
                role: Some("assistant"),
                content: Some(String::new()),
            };
            return data(&chunk(&st.meta, Some(delta), None, None));
        }
    }
    loop {
        let ev = match st.first.take() {
            Some(e) => Some(e),
            None => st.rx.recv().await,
        };
        match ev {
            Some(GenEvent::Text(t)) if t.is_empty() => continue,
            Some(GenEvent::Text(t)) => {
                return match st.meta.endpoint {
                    Endpoint::Chat => data(&chunk(
                        &st.meta,
                        Some(Delta {
                            role: None,
                            content: Some(t),
                        }),
                        None,
                        None,
                    )),
                    Endpoint::Text => data(&text_chunk(&st.meta, t, None, None)),
                };
            }
            Some(GenEvent::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                st.done = true;
                let usage = Usage::new(prompt_tokens, completion_tokens, cached_tokens);
                tracing::info!(
                    prompt_tokens,
                    completion_tokens,
                    finish_reason = reason.as_str(),
                    "completed (streamed)"
                );
                let m = &st.meta;
                let reason = Some(reason.as_str());
                let mut out = match m.endpoint {
                    Endpoint::Chat => data(&chunk(m, Some(Delta::default()), reason, None)),
                    Endpoint::Text => data(&text_chunk(m, String::new(), reason, None)),
                };
                if m.include_usage {
                    out.push_str(&match m.endpoint {
                        Endpoint::Chat => data(&chunk(m, None, None, Some(usage))),
                        Endpoint::Text => data(&TextCompletion {
                            id: m.id.clone(),
                            object: "text_completion",
                            created: m.created,
                            model: m.model.clone(),
                            choices: Vec::new(),
                            usage: Some(Some(usage)),
                        }),
                    });
                }
                out.push_str("data: [DONE]\n\n");
                return out;
            }
            Some(GenEvent::Failed(e)) => {
                st.done = true;
                tracing::warn!(
                    kind = e.error_type(),
                    code = e.code,
                    "generation failed mid-stream: {}",
                    e.message
                );
                return error_end(&e);
            }
            None => {
                st.done = true;
                let e = ApiError::internal("The generation ended without a result.");
                tracing::warn!("{}", e.message);
                return error_end(&e);
            }
        }
    }
}

/// The end of a stream that failed: an error body, then `[DONE]` so that clients which wait
/// for it (as the OpenAI ones do) stop reading.
fn error_end(e: &ApiError) -> String {
    data(&e.body()) + "data: [DONE]\n\n"
}

/// A chat chunk: with one choice carrying `delta` (and `finish_reason`), or with no choices
/// and `usage` set (the usage chunk).
fn chunk(
    m: &Meta,
    delta: Option<Delta>,
    finish_reason: Option<&'static str>,
    usage: Option<Usage>,
) -> ChatChunk {
    ChatChunk {
        id: m.id.clone(),
        object: "chat.completion.chunk",
        created: m.created,
        model: m.model.clone(),
        choices: delta
            .map(|delta| ChunkChoice {
                index: 0,
                delta,
                logprobs: None,
                finish_reason,
            })
            .into_iter()
            .collect(),
        usage: m.include_usage.then_some(usage),
    }
}

fn text_chunk(
    m: &Meta,
    text: String,
    finish_reason: Option<&'static str>,
    usage: Option<Usage>,
) -> TextCompletion {
    TextCompletion {
        id: m.id.clone(),
        object: "text_completion",
        created: m.created,
        model: m.model.clone(),
        choices: vec![TextChoice {
            index: 0,
            text,
            logprobs: None,
            finish_reason,
        }],
        usage: m.include_usage.then_some(usage),
    }
}

/// One SSE `data:` frame. JSON never contains a raw newline, so one line suffices.
fn data<T: Serialize>(v: &T) -> String {
    match serde_json::to_string(v) {
        Ok(s) => format!("data: {s}\n\n"),
        Err(e) => {
            let body = ApiError::internal(format!("cannot encode a stream chunk: {e}")).body();
            format!("data: {body}\n\n")
        }
    }
}

/// List the models served.
#[utoipa::path(get, path = "/v1/models", tag = "models", responses((status = 200, body = ModelList)))]
async fn list_models(State(st): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: st
            .backend
            .models()
            .into_iter()
            .map(ModelObject::from)
            .collect(),
    })
}

/// One model by id (ids may contain `/`).
#[utoipa::path(
    get,
    path = "/v1/models/{id}",
    tag = "models",
    params(("id" = String, Path, description = "The model's id.")),
    responses(
        (status = 200, body = ModelObject),
        (status = 404, description = "No such model (`code: model_not_found`).", body = ErrorBody),
    )
)]
async fn get_model(
    State(st): State<AppState>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<ModelObject>, ApiError> {
    let Path(id) =
        id.map_err(|e| ApiError::bad_request(format!("Invalid model id in the path: {e}")))?;
    Ok(Json(ModelObject::from(find_model(
        st.backend.as_ref(),
        &id,
    )?)))
}

/// The body of `/health` and `/ready`.
#[derive(Debug, Clone, Serialize, ToSchema)]
struct Status {
    /// `ok` or `failed` (health), `ready` or `not ready`.
    #[schema(example = "ok")]
    status: &'static str,
}

/// Liveness: the server answers and can serve, or recover by itself. 503 when it cannot
/// (for a supervisor to restart it).
#[utoipa::path(
    get,
    path = "/health",
    tag = "operations",
    responses((status = 200, body = Status), (status = 503, description = "Cannot serve and cannot recover by itself.", body = Status))
)]
async fn health(State(st): State<AppState>) -> Response {
    status(st.backend.healthy(), "ok", "failed")
}

/// 200 with `up`, or 503 with `down`.
fn status(ok: bool, up: &'static str, down: &'static str) -> Response {
    if ok {
        Json(Status { status: up }).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, Json(Status { status: down })).into_response()
    }
}

/// Readiness: the backend can take requests now (in `serve`, workers are registered).
#[utoipa::path(
    get,
    path = "/ready",
    tag = "operations",
    responses((status = 200, body = Status), (status = 503, description = "Not ready yet.", body = Status))
)]
async fn ready(State(st): State<AppState>) -> Response {
    status(st.backend.ready(), "ready", "not ready")
}

/// This document.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    responses((status = 200, description = "The OpenAPI 3.1 document of this API.", body = Object))
)]
async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    Json(crate::openapi::document())
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::route_not_found(method.as_str(), uri.path())
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        ErrorKind::InvalidRequest,
        format!("Method {method} is not allowed for {}.", uri.path()),
    )
    .with_code("method_not_allowed")
}
