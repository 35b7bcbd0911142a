//! [`ApiError`]: every refusal or failure the API reports, rendered as an OpenAI error body
//! `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bulkhead_protocol::admission::Refusal;
use serde::Serialize;

/// The OpenAI error `type` an [`ApiError`] carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request is malformed or cannot be served as asked (400, 413).
    InvalidRequest,
    /// The model or route does not exist (404).
    NotFound,
    /// The server is at capacity; retrying later may succeed (503).
    Overloaded,
    /// Too many requests are waiting; retrying later may succeed (429).
    RateLimited,
    /// The server failed (500).
    Server,
}

impl ErrorKind {
    /// The OpenAI `type` string: `invalid_request_error`, `not_found_error`,
    /// `overloaded_error`, `rate_limit_error` or `server_error`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest => "invalid_request_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::Overloaded => "overloaded_error",
            ErrorKind::RateLimited => "rate_limit_error",
            ErrorKind::Server => "server_error",
        }
    }
}

/// An error answered to the client: status, OpenAI `type`, optional `code` and `param`, and a
/// human-readable message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// HTTP status of the response.
    pub status: StatusCode,
    /// OpenAI error `type`.
    pub kind: ErrorKind,
    /// Machine-readable `code`, e.g. `context_length_exceeded` or `model_not_found`.
    pub code: Option<&'static str>,
    /// The request field at fault, e.g. `max_tokens` or `messages[0].content`.
    pub param: Option<String>,
    /// What went wrong, for people.
    pub message: String,
    /// `Retry-After` of a 429 or 503, in seconds (1 unless set).
    pub retry_after_s: u32,
}

impl ApiError {
    /// 401 with OpenAI's `invalid_api_key` code: a missing or unknown API key.
    pub fn invalid_api_key(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::UNAUTHORIZED, ErrorKind::InvalidRequest, message).with_code("invalid_api_key")
    }

    /// An error with the given parts and no `code` or `param`.
    pub fn new(status: StatusCode, kind: ErrorKind, message: impl Into<String>) -> Self {
        ApiError { status, kind, code: None, param: None, message: message.into(), retry_after_s: 1 }
    }

    /// The same error with `Retry-After` set to `seconds` (at least 1).
    pub fn with_retry_after(mut self, seconds: u32) -> Self {
        self.retry_after_s = seconds.max(1);
        self
    }

    /// The same error with `code` set.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The same error with `param` set.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// 400 `context_length_exceeded`: `prompt_tokens + completion_tokens` exceeds `limit`.
    /// The message follows OpenAI's wording; `param` is `messages`.
    pub fn context_length_exceeded(prompt_tokens: usize, completion_tokens: usize, limit: usize, prompt_param: &str) -> Self {
        let requested = prompt_tokens.saturating_add(completion_tokens);
        ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorKind::InvalidRequest,
            format!(
                "This model's maximum context length is {limit} tokens. However, you requested {requested} tokens \
                 ({prompt_tokens} in the {prompt_param}, {completion_tokens} in the completion). \
                 Please reduce the length of the {prompt_param} or completion."
            ),
        )
        .with_code("context_length_exceeded")
        .with_param(prompt_param)
    }

    /// The 400 for a request the admission decision refused ([`Refusal`]): over the
    /// context, an empty prompt (`prompt_param` names the field that held it), or zero
    /// `max_tokens`.
    pub fn refused(r: &Refusal, prompt_param: &str) -> Self {
        match *r {
            Refusal::ContextLength { prompt, max_tokens, limit, .. } => {
                ApiError::context_length_exceeded(prompt, max_tokens, limit, prompt_param)
            }
            Refusal::PromptTooLong { prompt, limit } => ApiError::context_length_exceeded(prompt, 0, limit, prompt_param),
            Refusal::EmptyPrompt => ApiError::invalid_request(prompt_param, "The prompt is empty."),
            Refusal::ZeroMaxTokens => ApiError::invalid_request("max_tokens", "max_tokens must be at least 1."),
        }
    }

    /// 400 `invalid_request_error` about the request field `param`.
    pub fn invalid_request(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, ErrorKind::InvalidRequest, message).with_param(param)
    }

    /// 400 `invalid_request_error` about the request as a whole (no `param`), e.g. a body
    /// that is not JSON.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, ErrorKind::InvalidRequest, message)
    }

    /// 404 `model_not_found` for the model `name`.
    pub fn model_not_found(name: &str) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, ErrorKind::NotFound, format!("The model `{name}` does not exist."))
            .with_code("model_not_found")
            .with_param("model")
    }

    /// 404 for a path or method this server does not serve.
    pub fn route_not_found(method: &str, path: &str) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, ErrorKind::NotFound, format!("Unknown request URL: {method} {path}.")).with_code("unknown_url")
    }

    /// 408: the request body did not arrive within `limit`.
    pub fn body_timeout(limit: std::time::Duration) -> Self {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            ErrorKind::InvalidRequest,
            format!("The request body did not arrive within {} ms.", limit.as_millis()),
        )
        .with_code("request_timeout")
    }

    /// 413: the request body is larger than `limit` bytes.
    pub fn payload_too_large(limit: usize) -> Self {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::InvalidRequest,
            format!("The request body is larger than the limit of {limit} bytes."),
        )
        .with_code("payload_too_large")
    }

    /// 503 `overloaded_error`: no capacity for the request now; the client may retry.
    pub fn overloaded(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, ErrorKind::Overloaded, message).with_code("overloaded")
    }

    /// 429 `rate_limit_error`: the server has too much waiting to take this request now;
    /// `code` says why (`queue_full`, `queue_timeout`, `concurrency_limit_exceeded`,
    /// `tokens_per_minute_exceeded`). Answered with `Retry-After`.
    pub fn too_many_requests(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::TOO_MANY_REQUESTS, ErrorKind::RateLimited, message).with_code(code)
    }

    /// 500 `server_error`.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, ErrorKind::Server, message)
    }

    /// The OpenAI `type` string (stable: clients and tests match on it).
    pub fn error_type(&self) -> &'static str {
        self.kind.as_str()
    }

    /// The OpenAI error body, `{"error": {...}}`, as a JSON value.
    pub fn body(&self) -> serde_json::Value {
        // Serialising this struct of strings cannot fail; fall back to null all the same.
        serde_json::to_value(ErrorBody { error: self.detail() }).unwrap_or(serde_json::Value::Null)
    }

    fn detail(&self) -> ErrorDetail<'_> {
        ErrorDetail { message: &self.message, kind: self.error_type(), param: self.param.as_deref(), code: self.code }
    }
}

/// The body of every error response.
// Named `ErrorResponse` in the OpenAPI document.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = ErrorResponse)]
pub(crate) struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

/// What went wrong.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = ErrorDetail)]
struct ErrorDetail<'a> {
    /// For people.
    message: &'a str,
    /// `invalid_request_error`, `not_found_error`, `overloaded_error`, `rate_limit_error` or
    /// `server_error`.
    #[serde(rename = "type")]
    #[schema(example = "invalid_request_error")]
    kind: &'a str,
    /// The request field at fault, e.g. `max_tokens` or `messages[0].content`.
    #[schema(required = true)]
    param: Option<&'a str>,
    /// Machine-readable, e.g. `context_length_exceeded` or `model_not_found`.
    #[schema(required = true)]
    code: Option<&'a str>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = self.status.as_u16(), kind = self.error_type(), code = self.code, "{}", self.message);
        } else {
            tracing::debug!(status = self.status.as_u16(), kind = self.error_type(), code = self.code, "{}", self.message);
        }
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if matches!(self.status, StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS) {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(self.retry_after_s));
        }
        resp
    }
}
