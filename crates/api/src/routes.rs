//! The axum [`Router`]: OpenAI endpoints over a [`Backend`], the JSON extractor whose
//! rejections are OpenAI error bodies, server-sent-event streaming, and the `x-request-id`
//! middleware. Each handler carries its `#[utoipa::path]` description for the OpenAPI
//! document ([`crate::openapi`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{DefaultBodyLimit, Extension, FromRequest, Path, Request, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use serde_json::Value;
use tracing::{Instrument, Span};
use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
use utoipa::{IntoResponses, ToSchema};

use crate::backend::{Backend, GenEvent, GenerationRequest, ModelCard, Prompt};
use crate::error::{ApiError, ErrorBody, ErrorKind};
use crate::ids::{random_hex, unix_now};
use crate::openai::{
    self, ChatChunk, ChatCompletion, ChatCompletionRequest, CompletionParams, CompletionRequest, ModelList, ModelObject, TextCompletion,
};
use crate::respond::{Endpoint, Generation, Meta, collect_response, stream_response};
use crate::tenants::{Tenant, Tenants};
use crate::tools::Tools;
use crate::trace::{TRACEPARENT, TraceParent};

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
        .route("/v1/embeddings", post(embeddings))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(middleware::from_fn_with_state(tenants, authenticate));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/openapi.json", get(openapi_json))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(AppState { backend: Arc::clone(&backend) })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn(request_id))
        .layer(middleware::from_fn_with_state(backend, count_responses))
}

/// Every response, 401s, 404s and 413s included, counted by status.
async fn count_responses(State(backend): State<Arc<dyn Backend>>, req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    backend.responded(resp.status().as_u16());
    resp
}

/// Takes the client's `x-request-id` (or makes one) and continues its W3C `traceparent` (or
/// starts a trace), runs the request inside a span with fields `request_id` and `trace_id`,
/// and returns both headers on the response (`traceparent` naming this request's span).
async fn request_id(mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(&X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= MAX_REQUEST_ID_LEN && s.bytes().all(|b| b.is_ascii_graphic()))
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

/// Set on the response of every request that passed [`authenticate`] (a tenant's key, or
/// any `/v1/` request when no keys are configured): the HTTP front keeps the connections
/// that carried one and bounds how long the others may stay.
#[derive(Clone, Copy, Debug)]
pub struct Authenticated;

/// The tenant of a `/v1/` request, from its API key (never from its body), as a request
/// extension and on the request's span; 401 before anything else when the key is wrong.
async fn authenticate(State(tenants): State<Arc<Tenants>>, mut req: Request, next: Next) -> Response {
    match tenants.authenticate(req.headers()) {
        Ok(t) => {
            Span::current().record("tenant", &*t.name);
            req.extensions_mut().insert(t);
            let mut resp = next.run(req).await;
            resp.extensions_mut().insert(Authenticated);
            resp
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
        let ct = req.headers().get(header::CONTENT_TYPE).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        match ct.as_deref() {
            Some(ct) if is_json(ct) => {}
            Some(ct) => {
                return Err(ApiError::bad_request(format!("Invalid Content-Type header ({ct}): expected application/json.")));
            }
            None => {
                return Err(ApiError::bad_request("Missing Content-Type header: expected application/json."));
            }
        }
        let limit = req.extensions().get::<BodyTimeout>().map_or(DEFAULT_BODY_TIMEOUT, |t| t.0);
        let read = tokio::time::timeout(limit, Bytes::from_request(req, state)).await.map_err(|_| ApiError::body_timeout(limit))?;
        let bytes = read.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::payload_too_large(MAX_BODY_BYTES)
            } else {
                ApiError::bad_request(format!("Could not read the request body: {r}"))
            }
        })?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(ApiError::bad_request("We could not parse the JSON body of your request: the body is empty. Send a JSON object."));
        }
        crate::json::parse(&bytes).map(OpenAiJson).map_err(|e| {
            // serde_json's words for a lone surrogate ("unexpected end of hex escape") do not
            // say what is wrong with the text.
            let why = e.to_string();
            let hint = if why.contains("surrogate") || why.contains("hex escape") {
                " A \\u escape must encode a Unicode character: a lone surrogate (\\ud800 to \\udfff without its pair) is not text."
            } else {
                ""
            };
            ApiError::bad_request(format!(
                "We could not parse the JSON body of your request ({why}).{hint} Send valid JSON with Content-Type: application/json."
            ))
        })
    }
}

fn is_json(content_type: &str) -> bool {
    let mime = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
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
            (StatusCode::NOT_FOUND, "Unknown `model` (`code: model_not_found`)."),
            (StatusCode::PAYLOAD_TOO_LARGE, "The body is over 4 MiB."),
            (
                StatusCode::TOO_MANY_REQUESTS,
                "Too much is waiting to take this request now (`type: rate_limit_error`); retry \
                 after `Retry-After` seconds.",
            ),
            (StatusCode::INTERNAL_SERVER_ERROR, "The server failed."),
            (StatusCode::SERVICE_UNAVAILABLE, "No capacity now (`type: overloaded_error`); retry after `Retry-After` seconds."),
        ]
        .into_iter()
        .map(|(status, why)| (status.as_str().to_owned(), error_response(why)))
        .collect()
    }
}

/// An OpenAPI response with an `ErrorResponse` body.
fn error_response(description: &str) -> RefOr<utoipa::openapi::Response> {
    let body = ContentBuilder::new().schema(Some(Ref::from_schema_name(ErrorBody::name()))).build();
    ResponseBuilder::new().description(description).content("application/json", body).into()
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
    body: Result<OpenAiJson, ApiError>,
) -> Result<Response, ApiError> {
    let p = body.and_then(|OpenAiJson(b)| openai::parse_chat(&b, &st.backend.defaults())).inspect_err(|e| refused_early(&st, e))?;
    complete(st, rid, trace, tenant, Endpoint::Chat, p).await
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
    body: Result<OpenAiJson, ApiError>,
) -> Result<Response, ApiError> {
    let p = body.and_then(|OpenAiJson(b)| openai::parse_completion(&b, &st.backend.defaults())).inspect_err(|e| refused_early(&st, e))?;
    complete(st, rid, trace, tenant, Endpoint::Text, p).await
}

/// Count a completion request refused before it reached the backend.
fn refused_early(st: &AppState, e: &ApiError) {
    let reason = if e.code == Some("context_length_exceeded") { "context_length" } else { "invalid" };
    st.backend.refused_early(reason);
}

fn find_model(backend: &dyn Backend, name: &str) -> Result<ModelCard, ApiError> {
    backend.models().into_iter().find(|c| c.id == name).ok_or_else(|| ApiError::model_not_found(name))
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
    p.check_against(&card)
        .and_then(|()| p.check_vocab(st.backend.encoder().tokenizer().vocab_size()))
        .inspect_err(|e| refused_early(&st, e))?;
    if let Some(user) = &p.user {
        tracing::info!(user = %user, "end user");
    }
    let echo = if p.echo {
        p.prompts
            .iter()
            .map(|pr| match pr {
                Prompt::Text(t) => Ok(t.clone()),
                Prompt::Tokens(ids) => st.backend.encoder().decode(ids),
                Prompt::Chat { .. } => Ok(String::new()),
            })
            .collect::<Result<_, _>>()?
    } else {
        Vec::new()
    };
    // best_of ranks generations by their log-probabilities, asked for here if not by the
    // client (and then left out of the answer).
    let mut sampling = p.sampling.clone();
    if p.best_of > p.n && sampling.logprobs.is_none() {
        sampling.logprobs = Some(0);
    }
    // A request without a seed gets one here, so that every worker that runs any part of
    // it draws the same numbers: a migrated stream resumes the same text (I11).
    let seed = sampling.seed.unwrap_or_else(|| crate::ids::random_u128() as u64);
    let mut reqs = Vec::with_capacity(p.prompts.len() * p.best_of);
    for (i, prompt) in p.prompts.iter().enumerate() {
        for j in 0..p.best_of {
            let mut sampling = sampling.clone();
            // Each choice draws its own tokens: each gets a seed of its own.
            sampling.seed = Some(sibling_seed(seed, j));
            reqs.push((
                i,
                GenerationRequest {
                    request_id: rid.0.clone(),
                    trace_id: trace.trace_id,
                    model: card.id.clone(),
                    prompt: prompt.clone(),
                    max_tokens: p.max_tokens,
                    sampling,
                    stop: p.stop.clone(),
                    tenant: tenant.clone(),
                    cache_salt: p.cache_salt.clone(),
                    priority: p.priority,
                },
            ));
        }
    }
    let backend = Arc::clone(&st.backend);
    let (grammar, grammar_param) = (p.sampling.grammar.clone(), p.grammar_param.unwrap_or("response_format"));
    // Compiling the grammar and admission may block (tokenising, the engine between steps).
    let gens = tokio::task::spawn_blocking(move || -> Result<Vec<Generation>, ApiError> {
        if let Some(g) = &grammar {
            backend.encoder().check_grammar(g).map_err(|e| {
                ApiError::invalid_request(grammar_param, format!("The output constraint is not a grammar this server can follow: {e}"))
            })?;
        }
        // All or none: on a refusal the generations started so far are dropped (aborted).
        reqs.into_iter().map(|(prompt, req)| Ok(Generation { prompt, rx: backend.generate(req)?, first: None })).collect()
    })
    .await
    .map_err(|e| ApiError::internal(format!("the backend failed to admit the request: {e}")))??;
    let meta = Meta {
        id: match endpoint {
            Endpoint::Chat => format!("chatcmpl-{}", random_hex()),
            Endpoint::Text => format!("cmpl-{}", random_hex()),
        },
        created: unix_now(),
        model: card.id,
        endpoint,
        include_usage: p.include_usage,
        n: p.n,
        parse_calls: p.tools.as_ref().filter(|t| t.parses()).map(Tools::parallel_calls),
        logprobs: p.sampling.logprobs.is_some(),
        echo,
    };
    if p.stream {
        // Wait for each generation's first event before answering 200: a refusal that only
        // a worker can make (its own admission, I3) still reaches the client as its HTTP
        // status.
        let mut gens = gens;
        for g in &mut gens {
            let first = g.rx.recv().await;
            if let Some(GenEvent::Failed(e)) = first {
                return Err(e);
            }
            g.first = first;
        }
        Ok(stream_response(meta, Arc::clone(&st.backend), gens))
    } else {
        collect_response(meta, st.backend.encoder(), gens).await
    }
}

/// The seed of choice `j` of a request seeded with `seed`: the seed itself for the first,
/// a fixed mix for the others, so a seeded request with `n > 1` is reproducible and its
/// choices differ.
fn sibling_seed(seed: u64, j: usize) -> u64 {
    if j == 0 {
        return seed;
    }
    // SplitMix64's finaliser over the seed and the choice number.
    let mut z = seed ^ (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The body of `POST /tokenize`: a text `prompt`, or chat `messages` (templated as a
/// completion would be).
#[derive(Debug, Clone, ToSchema)]
pub struct TokenizeRequest {
    /// The model (optional; the served one).
    pub model: Option<String>,
    /// Text, tokenised as `/v1/completions` would.
    pub prompt: Option<String>,
    /// Messages, templated and tokenised as `/v1/chat/completions` would.
    #[schema(value_type = Option<Vec<Object>>)]
    pub messages: Option<Vec<Value>>,
    /// Whether the model's BOS is added where its tokenizer asks for one (vLLM's field;
    /// default true).
    pub add_special_tokens: Option<bool>,
}

/// The answer of `POST /tokenize` (vLLM's form).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TokenizeResponse {
    /// How many tokens.
    pub count: usize,
    /// The served context, for comparison.
    pub max_model_len: usize,
    /// The token ids.
    pub tokens: Vec<u32>,
}

/// The body of `POST /detokenize`.
#[derive(Debug, Clone, ToSchema)]
pub struct DetokenizeRequest {
    /// The model (optional; the served one).
    pub model: Option<String>,
    /// Token ids.
    pub tokens: Vec<u32>,
}

/// The answer of `POST /detokenize` (vLLM's form).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DetokenizeResponse {
    /// The ids' text.
    pub prompt: String,
}

/// The served model's card, or 404 for another `model`.
fn model_of(backend: &dyn Backend, body: &serde_json::Map<String, Value>) -> Result<ModelCard, ApiError> {
    match body.get("model").filter(|v| !v.is_null()) {
        None => backend.models().into_iter().next().ok_or_else(|| ApiError::model_not_found("")),
        Some(Value::String(m)) => find_model(backend, m),
        Some(_) => Err(ApiError::invalid_request("model", "Invalid type for 'model': expected a string.")),
    }
}

fn body_object(body: &Value) -> Result<&serde_json::Map<String, Value>, ApiError> {
    body.as_object().ok_or_else(|| ApiError::bad_request("The request body must be a JSON object."))
}

/// Tokenise a prompt (vLLM's endpoint).
#[utoipa::path(
    post,
    path = "/tokenize",
    tag = "tokens",
    request_body = TokenizeRequest,
    responses((status = 200, body = TokenizeResponse), (status = 400, description = "Invalid body.", body = ErrorBody), (status = 404, description = "Unknown model.", body = ErrorBody))
)]
async fn tokenize(State(st): State<AppState>, OpenAiJson(body): OpenAiJson) -> Result<Json<TokenizeResponse>, ApiError> {
    let obj = body_object(&body)?;
    openai::deny_unknown(obj, "", |k| ["model", "prompt", "messages", "add_special_tokens"].contains(&k))?;
    let card = model_of(st.backend.as_ref(), obj)?;
    let add_special_tokens = match obj.get("add_special_tokens") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid_request("add_special_tokens", "Invalid type for 'add_special_tokens': expected a boolean."));
        }
    };
    let prompt = match (obj.get("prompt").filter(|v| !v.is_null()), obj.get("messages").filter(|v| !v.is_null())) {
        (Some(Value::String(p)), None) => Prompt::Text(p.clone()),
        (Some(_), None) => return Err(ApiError::invalid_request("prompt", "Invalid type for 'prompt': expected a string.")),
        (None, Some(_)) => {
            match openai::parse_chat(&serde_json::json!({"model": card.id, "messages": obj["messages"]}), &st.backend.defaults())?
                .prompts
                .pop()
            {
                Some(p) => p,
                None => return Err(ApiError::invalid_request("messages", "No messages.")),
            }
        }
        _ => return Err(ApiError::bad_request("Send exactly one of 'prompt' and 'messages'.")),
    };
    let backend = Arc::clone(&st.backend);
    let tokens = tokio::task::spawn_blocking(move || backend.encoder().encode_with(&prompt, add_special_tokens))
        .await
        .map_err(|e| ApiError::internal(format!("tokenising failed: {e}")))??;
    Ok(Json(TokenizeResponse { count: tokens.len(), max_model_len: card.max_model_len, tokens }))
}

/// The text of token ids (vLLM's endpoint).
#[utoipa::path(
    post,
    path = "/detokenize",
    tag = "tokens",
    request_body = DetokenizeRequest,
    responses((status = 200, body = DetokenizeResponse), (status = 400, description = "Invalid body or a token id outside the vocabulary.", body = ErrorBody), (status = 404, description = "Unknown model.", body = ErrorBody))
)]
async fn detokenize(State(st): State<AppState>, OpenAiJson(body): OpenAiJson) -> Result<Json<DetokenizeResponse>, ApiError> {
    let obj = body_object(&body)?;
    openai::deny_unknown(obj, "", |k| k == "model" || k == "tokens")?;
    model_of(st.backend.as_ref(), obj)?;
    let ids: Vec<u32> = match obj.get("tokens") {
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| {
                    ApiError::invalid_request(format!("tokens[{i}]"), format!("Invalid 'tokens[{i}]': expected a token id."))
                })
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(ApiError::invalid_request("tokens", "Missing or invalid 'tokens': expected an array of token ids.")),
    };
    Ok(Json(DetokenizeResponse { prompt: st.backend.encoder().decode(&ids)? }))
}

/// Embeddings: this model is a generator and serves none.
#[utoipa::path(post, path = "/v1/embeddings", tag = "models", responses((status = 404, description = "The served model does not produce embeddings (`code: model_not_supported`).", body = ErrorBody)))]
async fn embeddings() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, ErrorKind::NotFound, "The served model generates text and does not produce embeddings.")
        .with_code("model_not_supported")
}

/// List the models served.
#[utoipa::path(get, path = "/v1/models", tag = "models", responses((status = 200, body = ModelList)))]
async fn list_models(State(st): State<AppState>) -> Json<ModelList> {
    Json(ModelList { object: "list", data: st.backend.models().into_iter().map(ModelObject::from).collect() })
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
async fn get_model(State(st): State<AppState>, id: Result<Path<String>, PathRejection>) -> Result<Json<ModelObject>, ApiError> {
    let Path(id) = id.map_err(|e| ApiError::bad_request(format!("Invalid model id in the path: {e}")))?;
    Ok(Json(ModelObject::from(find_model(st.backend.as_ref(), &id)?)))
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

/// 405 as an OpenAI error body, like every other error.
pub(crate) async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, ErrorKind::InvalidRequest, format!("Method {method} is not allowed for {}.", uri.path()))
        .with_code("method_not_allowed")
}
