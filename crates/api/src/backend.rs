//! [`Backend`]: what the HTTP layer needs from whatever generates text: the disaggregated
//! gateway in production, mock backends in the tests.

pub use bulkhead_protocol::FinishReason;
use bulkhead_protocol::{Sampling, TokenLogprobs};
use bulkhead_tokenizer::ChatMessage;
use tokio::sync::mpsc::Receiver;

use crate::error::ApiError;
use crate::prompt::PromptEncoder;
use crate::tenants::Tenant;
use crate::tools::Tools;
use crate::trace::TraceId;

/// One model a backend serves, as listed by `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelCard {
    /// The name clients pass as `model`.
    pub id: String,
    /// Most tokens (prompt + completion) one request may use.
    pub max_model_len: usize,
    /// Unix time (seconds) the model was loaded.
    pub created: u64,
    /// Who serves it (OpenAI's `owned_by`).
    pub owned_by: String,
}

/// The input of a generation.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Chat messages and the request's tools; the backend applies the model's chat template
    /// (with the generation prompt appended).
    Chat {
        /// The conversation.
        messages: Vec<ChatMessage>,
        /// The tools, if any (they reach the prompt unless `tool_choice` is `none`).
        tools: Option<Tools>,
    },
    /// Raw text, tokenised as is (`/v1/completions`).
    Text(String),
    /// Token ids, used as they are (`/v1/completions`).
    Tokens(Vec<u32>),
}

impl Prompt {
    /// The request field the prompt came from, for errors about it.
    pub fn param(&self) -> &'static str {
        match self {
            Prompt::Chat { .. } => "messages",
            Prompt::Text(_) | Prompt::Tokens(_) => "prompt",
        }
    }
}

/// One generation request, validated by the HTTP layer.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    /// The request's id (the `x-request-id` header), for logs; not necessarily unique.
    pub request_id: String,
    /// The W3C trace the request belongs to (continued from `traceparent` or new), for logs.
    pub trace_id: TraceId,
    /// The model asked for.
    pub model: String,
    /// What to continue.
    pub prompt: Prompt,
    /// Most tokens to generate; `None` means whatever context remains after the prompt.
    pub max_tokens: Option<usize>,
    /// Sampling settings (already range-checked).
    pub sampling: Sampling,
    /// Stop strings: generation ends before the first one, which is not returned.
    pub stop: Vec<String>,
    /// Who sent it (from the API key).
    pub tenant: Tenant,
    /// `cache_salt`: splits the tenant's prefix cache further (at most 256 bytes).
    pub cache_salt: Option<String>,
    /// Its place in its tenant's queue: lower first (vLLM's `priority`).
    pub priority: i64,
}

/// What a backend streams for one request. The stream ends after `Finished` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// More text (a delta; may be empty) and, when the request asked for log-probabilities,
    /// the token that released it with its log-probabilities.
    Text {
        /// The text.
        text: String,
        /// The token and its log-probabilities.
        logprobs: Option<(u32, TokenLogprobs)>,
    },
    /// The generation ended normally, with its token counts.
    Finished {
        /// Why it ended.
        reason: FinishReason,
        /// Tokens in the prompt (after the chat template).
        prompt_tokens: usize,
        /// Tokens generated.
        completion_tokens: usize,
        /// Prompt tokens whose KV came from the prefix cache.
        cached_tokens: usize,
    },
    /// The generation failed after it was admitted.
    Failed(ApiError),
}

/// OpenAI's documented default `temperature`: what a request without one gets unless the
/// operator sets another ([`Defaults`]).
pub const OPENAI_TEMPERATURE: f32 = 1.0;

/// What a request that leaves a sampling field out gets: OpenAI's defaults, or the
/// operator's (`serve --default-temperature`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Defaults {
    /// The `temperature` of a request without one (0: greedy).
    pub temperature: f32,
}

impl Default for Defaults {
    fn default() -> Self {
        Defaults { temperature: OPENAI_TEMPERATURE }
    }
}

/// A generator of text behind the OpenAI API.
///
/// Dropping the [`Receiver`] returned by [`Backend::generate`] is how a client disconnect
/// reaches the backend: it must then abort the request and free what it holds.
pub trait Backend: Send + Sync + 'static {
    /// The models served.
    fn models(&self) -> Vec<ModelCard>;

    /// The served model's tokenizer and chat template (`/tokenize`, `/detokenize`, token
    /// names in log-probabilities, grammar checks).
    fn encoder(&self) -> &PromptEncoder;

    /// Admit a request and start generating. Admission happens here: errors (context
    /// length, unknown model, overload) come back before any stream exists. May block
    /// briefly (the HTTP layer calls it off the async workers).
    fn generate(&self, req: GenerationRequest) -> Result<Receiver<GenEvent>, ApiError>;

    /// Whether the backend can take requests now: `GET /ready` (readiness) answers 200 when
    /// true, 503 otherwise. The disaggregated gateway is ready while at least one prefill and
    /// one decode worker are registered. (`GET /health`, liveness, does not ask.)
    fn ready(&self) -> bool;

    /// Whether the backend can serve, or will again by itself: `GET /health` (liveness)
    /// answers 503 when false, so that a supervisor restarts the process.
    fn healthy(&self) -> bool {
        true
    }

    /// What a request that leaves a sampling field out gets (default: OpenAI's).
    fn defaults(&self) -> Defaults {
        Defaults::default()
    }

    /// Every HTTP response the API sends, by status (metrics; default: not counted).
    fn responded(&self, _status: u16) {}

    /// A completion request the HTTP layer refused before [`Backend::generate`] (an
    /// unreadable body, a bad field, `max_tokens` past the context), by reason: `invalid`
    /// or `context_length` (metrics; default: not counted).
    fn refused_early(&self, _reason: &'static str) {}
}
