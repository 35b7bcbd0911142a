#![forbid(unsafe_code)]
//! Bulkhead's OpenAI-compatible HTTP API, independent of how text is generated: the
//! gateway (crates/gateway) is its one production [`Backend`].
//!
//! # Layout
//!
//! - [`backend`]: the [`Backend`] trait the HTTP layer drives ([`GenerationRequest`] in, a
//!   stream of [`GenEvent`]s out; dropping the stream aborts the request) and [`ModelCard`].
//! - [`error`]: [`ApiError`], every error as an OpenAI error body with its HTTP status.
//! - [`json`]: request bodies as JSON that names each key once (a repeated key is 400).
//! - [`openai`]: the wire format — request bodies checked field by field, response and
//!   stream-chunk objects.
//! - [`openapi`]: the OpenAPI document ([`openapi::document`]), generated from the types and
//!   handlers; served at `/openapi.json`, checked in as `docs/openapi.json`.
//! - [`routes`]: [`router`], the axum endpoints (`/v1/chat/completions`, `/v1/completions`,
//!   `/v1/models`, `/health`, `/ready`), server-sent events, the JSON extractor and the
//!   `x-request-id` middleware.
//! - [`tenants`]: [`Tenants`], API keys to tenants (401 `invalid_api_key` otherwise); the
//!   tenant of a request comes from its key, never from its body.
//! - [`trace`]: W3C `traceparent`: [`trace::TraceParent`] continued or started per request.
//! - [`prompt`]: [`PromptEncoder`], chat template and tokenizer applied to a prompt.
//! - [`testing`]: a byte-level vocabulary for mock backends in tests and fuzzing.
//! - [`tools`]: tool calling: `tools`/`tool_choice`, the default tool preamble, the grammar
//!   of `required` and named calls, and the `<tool_call>` parser.
//! - [`web`]: the browser pages built into the binary: the chat page at `/` and the live
//!   isolation dashboard at `/dashboard`, under a strict Content-Security-Policy.
//! - `respond`: one request's generations merged into one response or event stream.
//! - `ids`: completion and request ids.

pub mod backend;
pub mod error;
mod ids;
pub mod json;
pub mod openai;
pub mod openapi;
pub mod prompt;
mod respond;
pub mod routes;
pub mod tenants;
pub mod testing;
pub mod tools;
pub mod trace;
pub mod web;

pub use backend::{Backend, FinishReason, GenEvent, GenerationRequest, ModelCard, Prompt};
pub use error::{ApiError, ErrorKind};
pub use prompt::PromptEncoder;
pub use routes::{Authenticated, BodyTimeout, DEFAULT_BODY_TIMEOUT, MAX_BODY_BYTES, router, router_with_tenants};
pub use tenants::{Tenant, Tenants, TenantsError};
