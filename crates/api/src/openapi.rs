//! The OpenAPI 3.1 document of the HTTP API, generated from the request, response and error
//! types and the handlers' `#[utoipa::path]` annotations. Served at `GET /openapi.json` and
//! checked in as `docs/openapi.json`: tests/openapi.rs fails when the two differ.

use utoipa::OpenApi;

use crate::error::ErrorBody;
use crate::routes;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Bulkhead",
        description = "OpenAI-compatible completions from a disaggregated prefill/decode server \
                       whose KV cache cannot leak across requests. Every error is an OpenAI error \
                       body (`ErrorResponse`). Unknown request fields are accepted and logged; OpenAI fields this server does not implement are refused with 400 naming them. `bulkhead serve` \
                       also serves Prometheus metrics at `GET /metrics` (text), not described here."
    ),
    paths(
        routes::chat_completions,
        routes::completions,
        routes::list_models,
        routes::get_model,
        routes::embeddings,
        routes::tokenize,
        routes::detokenize,
        routes::health,
        routes::ready,
        routes::openapi_json,
    ),
    // Referenced by name from the completion errors (routes::CompletionErrors).
    components(schemas(ErrorBody)),
    tags(
        (name = "completions", description = "Chat and text completions."),
        (name = "models", description = "The models served."),
        (name = "tokens", description = "Tokenising and detokenising with the served model's vocabulary (vLLM's endpoints)."),
        (name = "operations", description = "Health, readiness and this document."),
    )
)]
struct ApiDoc;

/// The OpenAPI document of [`crate::routes::router`].
pub fn document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}
