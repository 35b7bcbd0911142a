//! The OpenAI wire format: request bodies read into the request types (`request`, whose
//! fields name their `param` when refused; an unknown field is refused with 400 naming it,
//! as OpenAI does: a misspelt `temprature` must not pass as a default) and checked as a
//! whole, and the response and stream-chunk objects.

use bulkhead_protocol::Sampling;
use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{Map, Value};
use utoipa::ToSchema;

pub use crate::backend::{Defaults, OPENAI_TEMPERATURE};
use crate::backend::{FinishReason, ModelCard, Prompt};
use crate::error::ApiError;
use crate::tools::{self, Tools};

mod de;
mod grammar;
mod request;

pub use request::{
    ChatCompletionRequest, ChatMessageParam, CompletionOptions, CompletionRequest, ContentPart, ContentPartType, MessageContent,
    PromptParam, Role, StopParam, StreamOptions,
};

/// Most stop strings a request may give (OpenAI's limit).
pub const MAX_STOP: usize = 4;
/// Longest accepted `cache_salt`, in bytes.
pub const MAX_CACHE_SALT: usize = 256;
/// Largest accepted `temperature` (OpenAI's range is `0..=2`).
pub const MAX_TEMPERATURE: f64 = 2.0;
/// Most choices (`n`, `best_of`) one request may ask for.
pub const MAX_N: usize = 16;
/// Most generations (prompts × `best_of`) one request may start.
pub const MAX_GENERATIONS: usize = 64;
/// Most `top_logprobs` of a chat completion (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u64 = 20;
/// Most `logprobs` of a text completion (OpenAI's limit).
pub const MAX_TEXT_LOGPROBS: u64 = 5;
/// Most `logit_bias` entries and `stop_token_ids` one request may give.
pub const MAX_TOKEN_LIST: usize = 1024;

/// OpenAI (and vLLM) request fields Bulkhead does not implement: each gets 400 naming it,
/// never a silent 200 that did not do what was asked. A field with a default is accepted
/// when it asks for just that (`"use_beam_search": false` changes nothing).
const UNSUPPORTED: &[(&str, &str, Option<bool>)] = &[
    ("audio", "audio output is not supported", None),
    ("prediction", "predicted outputs are not supported", None),
    ("web_search_options", "web search is not supported", None),
    ("functions", "the deprecated 'functions' are not supported; send 'tools'", None),
    ("function_call", "the deprecated 'function_call' is not supported; send 'tool_choice'", None),
    ("reasoning_effort", "this model does not reason; 'reasoning_effort' is not supported", None),
    ("suffix", "'suffix' (insertion) is not supported", None),
    // vLLM's extras that are not built here.
    ("use_beam_search", "beam search is not supported", Some(false)),
    ("length_penalty", "length_penalty (beam search) is not supported", None),
    ("include_stop_str_in_output", "the stop string is never included in the output here", Some(false)),
    ("prompt_logprobs", "prompt log-probabilities are not computed", None),
    ("allowed_token_ids", "allowed_token_ids is not supported; use logit_bias or a grammar", None),
    ("bad_words", "bad_words is not supported; use logit_bias", None),
    ("truncate_prompt_tokens", "prompts are never truncated here: an over-long prompt is refused", None),
    ("chat_template", "a per-request chat template is not supported", None),
    ("chat_template_kwargs", "chat_template_kwargs is not supported", None),
    ("continue_final_message", "continuing the final message is not supported", Some(false)),
    ("add_generation_prompt", "the generation prompt is always added", Some(true)),
    ("documents", "documents (RAG templates) are not supported", None),
    ("return_tokens_as_token_ids", "tokens are returned as text", Some(false)),
    ("logits_processors", "logits processors are not supported", None),
    ("guided_whitespace_pattern", "guided_whitespace_pattern is not supported", None),
    ("spaces_between_special_tokens", "special tokens are detokenised as they are", Some(true)),
];

/// A completion request (chat or text), checked and reduced to what generation needs.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionParams {
    /// The model asked for.
    pub model: String,
    /// The prompts: one for chat, one or more (a batch) for text completions.
    pub prompts: Vec<Prompt>,
    /// `max_completion_tokens`, else `max_tokens`; at least 1 when given.
    pub max_tokens: Option<usize>,
    /// How each token is picked (penalties, bias, log-probabilities and grammar included).
    pub sampling: Sampling,
    /// Stop strings (empty ones dropped).
    pub stop: Vec<String>,
    /// Whether to answer with server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`: send a usage chunk before `[DONE]`.
    pub include_usage: bool,
    /// `cache_salt` (vLLM's): splits the tenant's prefix cache further.
    pub cache_salt: Option<String>,
    /// Choices returned per prompt.
    pub n: usize,
    /// Generations per prompt, of which the `n` most likely are returned (at least `n`).
    pub best_of: usize,
    /// Text completions: the prompt's text comes first in each choice.
    pub echo: bool,
    /// Chat: the request's tools.
    pub tools: Option<Tools>,
    /// The field the grammar came from, for a 400 when it does not compile.
    pub grammar_param: Option<&'static str>,
    /// `user`: the client's end-user id, for the logs.
    pub user: Option<String>,
    /// vLLM's `priority`: lower first, within the tenant's own queue.
    pub priority: i64,
}

impl CompletionParams {
    /// Refuse a `max_tokens` that cannot fit the model's context whatever the prompt.
    pub fn check_against(&self, card: &ModelCard) -> Result<(), ApiError> {
        match self.max_tokens {
            Some(n) if n > card.max_model_len => Err(ApiError::invalid_request(
                "max_tokens",
                format!(
                    "max_tokens is too large: {n}. This model's maximum context length is {} tokens \
                     (prompt and completion together).",
                    card.max_model_len
                ),
            )
            .with_code("context_length_exceeded")),
            _ => Ok(()),
        }
    }

    /// Refuse token ids (token-id prompts, `logit_bias`, `stop_token_ids`) outside a
    /// vocabulary of `vocab`.
    pub fn check_vocab(&self, vocab: usize) -> Result<(), ApiError> {
        for (i, p) in self.prompts.iter().enumerate() {
            if let Prompt::Tokens(ids) = p
                && let Some(&id) = ids.iter().find(|id| **id as usize >= vocab)
            {
                let param = if self.prompts.len() == 1 { "prompt".to_string() } else { format!("prompt[{i}]") };
                return Err(ApiError::invalid_request(
                    param,
                    format!("Invalid 'prompt': token id {id} is not in the vocabulary of {vocab} tokens."),
                ));
            }
        }
        if let Some(&(id, _)) = self.sampling.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
            return Err(ApiError::invalid_request(
                "logit_bias",
                format!("Invalid 'logit_bias': token id {id} is not in the vocabulary of {vocab} tokens."),
            ));
        }
        if let Some(&id) = self.sampling.stop_token_ids.iter().find(|id| **id as usize >= vocab) {
            return Err(ApiError::invalid_request(
                "stop_token_ids",
                format!("Invalid 'stop_token_ids': token id {id} is not in the vocabulary of {vocab} tokens."),
            ));
        }
        Ok(())
    }
}

/// Parse a `POST /v1/chat/completions` body; fields it leaves out take `defaults`.
pub fn parse_chat(body: &Value, defaults: &Defaults) -> Result<CompletionParams, ApiError> {
    let req: ChatCompletionRequest = read_body(body)?;
    refuse_extra(&req.extra, Endpoint::Chat)?;
    let Some(messages) = req.messages else {
        return Err(ApiError::invalid_request("messages", "Missing required parameter: 'messages'."));
    };
    let tools = tools::parse_fields(req.tools.as_ref(), req.tool_choice.as_ref(), req.parallel_tool_calls.as_ref())?;
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (false, Some(_)) => return Err(ApiError::invalid_request("top_logprobs", "top_logprobs requires logprobs: true.")),
        (false, None) => None,
        (true, top) => Some(top.unwrap_or(0) as u8),
    };
    let messages = messages.into_iter().map(ChatMessageParam::into_message).collect();
    let own = Own { model: req.model, logprobs, best_of: None, echo: false };
    let mut p = common(own, req.options, vec![Prompt::Chat { messages, tools: tools.clone() }], defaults)?;
    if let Some(t) = &tools
        && let Some(g) = t.grammar()
    {
        if p.sampling.grammar.is_some() {
            return Err(ApiError::invalid_request(
                "tool_choice",
                "tool_choice 'required' or a named function cannot be combined with another output constraint.",
            ));
        }
        p.sampling.grammar = Some(g);
        p.grammar_param = Some("tools");
    }
    p.tools = tools;
    Ok(p)
}

/// Parse a `POST /v1/completions` body; fields it leaves out take `defaults`.
pub fn parse_completion(body: &Value, defaults: &Defaults) -> Result<CompletionParams, ApiError> {
    let req: CompletionRequest = read_body(body)?;
    refuse_extra(&req.extra, Endpoint::Text)?;
    let Some(PromptParam(prompts)) = req.prompt else {
        return Err(ApiError::invalid_request("prompt", "Missing required parameter: 'prompt'."));
    };
    let own = Own { model: req.model, logprobs: req.logprobs.map(|n| n as u8), best_of: req.best_of, echo: req.echo.unwrap_or(false) };
    common(own, req.options, prompts, defaults)
}

/// A body read as its request type `T`. The shared options are read on their own first:
/// inside `#[serde(flatten)]` serde loses the path of an error, and with it the `param`
/// (reading them again as part of `T` then cannot fail).
fn read_body<'a, T: serde::Deserialize<'a>>(body: &'a Value) -> Result<T, ApiError> {
    as_object(body)?;
    de::typed::<CompletionOptions>(body)?;
    de::typed(body)
}

/// Which endpoint a body came to: some fields belong to one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Text,
}

/// What a body's own fields (beside the shared [`CompletionOptions`]) bring.
struct Own {
    model: Option<String>,
    logprobs: Option<u8>,
    best_of: Option<u32>,
    echo: bool,
}

/// The checks across fields, and the request reduced to what generation needs.
fn common(own: Own, mut o: CompletionOptions, prompts: Vec<Prompt>, defaults: &Defaults) -> Result<CompletionParams, ApiError> {
    let Some(model) = own.model else {
        return Err(ApiError::invalid_request("model", "Missing required parameter: 'model'."));
    };
    let max_tokens = match (o.max_completion_tokens, &o.max_tokens) {
        (Some(n), _) => Some(n as usize),
        (None, Some(v)) => Some(de::positive_int(v).map_err(|f| f.named("max_tokens"))? as usize),
        (None, None) => None,
    };
    let mut sampling = sampling(&mut o, max_tokens, defaults)?;
    sampling.logprobs = own.logprobs;
    let (grammar, grammar_param) = match grammar::parse(&o)? {
        Some((g, param)) => (Some(g), Some(param)),
        None => (None, None),
    };
    sampling.grammar = grammar;
    let n = o.n.map_or(1, |n| n as usize);
    let best_of = match own.best_of.map(|b| b as usize) {
        Some(b) if b < n => return Err(ApiError::invalid_request("best_of", "best_of must be at least n.")),
        Some(b) => b,
        None => n,
    };
    let stream = o.stream.unwrap_or(false);
    if stream && best_of > n {
        return Err(ApiError::invalid_request("best_of", "best_of larger than n cannot be streamed (the best are known only at the end)."));
    }
    if prompts.len().saturating_mul(best_of) > MAX_GENERATIONS {
        return Err(ApiError::invalid_request(
            "prompt",
            format!("{} prompts times {best_of} generations each is over the limit of {MAX_GENERATIONS} per request.", prompts.len()),
        ));
    }
    if own.echo && sampling.logprobs.is_some() {
        return Err(ApiError::invalid_request(
            "echo",
            "echo with logprobs is not supported: the prompt's log-probabilities are not computed.",
        )
        .with_code("unsupported_parameter"));
    }
    Ok(CompletionParams {
        model,
        prompts,
        max_tokens,
        sampling,
        stop: o.stop.map(StopParam::into_strings).unwrap_or_default(),
        stream,
        include_usage: o.stream_options.and_then(|s| s.include_usage).unwrap_or(false),
        cache_salt: o.cache_salt,
        n,
        best_of,
        echo: own.echo,
        tools: None,
        grammar_param,
        user: o.user.map(|u| u.chars().take(256).collect()),
        priority: o.priority.unwrap_or(0),
    })
}

/// The fields a body's type does not name: OpenAI's and vLLM's that are not implemented
/// (400 `unsupported_parameter`, unless set to their default) and unknown ones (400
/// `unknown_parameter`), each named.
fn refuse_extra(extra: &Map<String, Value>, endpoint: Endpoint) -> Result<(), ApiError> {
    // `suffix` is a text completion's field: in a chat body it is unknown.
    let unsupported = |k: &str| UNSUPPORTED.iter().any(|u| u.0 == k && (k != "suffix" || endpoint == Endpoint::Text));
    for (name, why, default) in UNSUPPORTED {
        let Some(v) = extra.get(*name).filter(|v| !v.is_null()) else { continue };
        let harmless = default.is_some_and(|d| v.as_bool() == Some(d));
        if !harmless && unsupported(name) {
            return Err(ApiError::invalid_request(*name, format!("'{name}': {why}.")).with_code("unsupported_parameter"));
        }
    }
    deny_unknown(extra, "", unsupported)
}

/// The sampling controls (each range-checked as it was read; `max_tokens` bounds
/// `min_tokens`).
fn sampling(o: &mut CompletionOptions, max_tokens: Option<usize>, defaults: &Defaults) -> Result<Sampling, ApiError> {
    let mut s = Sampling { temperature: o.temperature.map_or(defaults.temperature, |t| t as f32), ..Sampling::default() };
    if let Some(p) = o.top_p {
        // The f32 rounding must not turn a tiny positive top_p into 0 (outside the sampler's
        // range): the smallest positive f32 keeps only the most likely token, as `p` does.
        s.top_p = (p as f32).max(f32::MIN_POSITIVE);
    }
    if let Some(k) = o.top_k {
        s.top_k = k;
    }
    s.min_p = o.min_p.unwrap_or(0.0) as f32;
    s.presence_penalty = o.presence_penalty.unwrap_or(0.0) as f32;
    s.frequency_penalty = o.frequency_penalty.unwrap_or(0.0) as f32;
    if let Some(r) = o.repetition_penalty {
        s.repetition_penalty = r as f32;
    }
    s.logit_bias = o.logit_bias.take().unwrap_or_default();
    if let Some(m) = o.min_tokens {
        s.min_tokens = m;
        if max_tokens.is_some_and(|max| m as usize > max) {
            return Err(ApiError::invalid_request("min_tokens", "min_tokens must not be larger than max_tokens."));
        }
    }
    s.stop_token_ids = o.stop_token_ids.take().unwrap_or_default();
    if let Some(seed) = o.seed {
        s.seed = Some(seed);
    }
    // Not OpenAI's: llama.cpp's and vLLM's extension, for fixed-length benchmarks.
    if let Some(b) = o.ignore_eos {
        s.ignore_eos = b;
    }
    // vLLM's: special tokens (`<|im_start|>`, ...) are left out of the text unless asked for.
    if let Some(b) = o.skip_special_tokens {
        s.skip_special_tokens = b;
    }
    Ok(s)
}

/// The top-level object of a body, or 400.
fn as_object(body: &Value) -> Result<&Map<String, Value>, ApiError> {
    match body {
        Value::Object(o) => Ok(o),
        v => Err(ApiError::bad_request(format!("The request body must be a JSON object, but got {}.", de::type_name(v)))),
    }
}

/// 400 naming the first key of `obj` that `known` does not accept (`path` is where `obj`
/// sits in the body, empty at the top). Free-form objects (a schema, `metadata`,
/// `logit_bias`) are never passed here.
pub fn deny_unknown(obj: &Map<String, Value>, path: &str, known: impl Fn(&str) -> bool) -> Result<(), ApiError> {
    match obj.keys().find(|k| !known(k)) {
        None => Ok(()),
        Some(k) => {
            let param = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
            Err(ApiError::invalid_request(param.clone(), format!("Unrecognized request argument supplied: {param}"))
                .with_code("unknown_parameter"))
        }
    }
}

/// A field of a free-form object that is present and not `null` (clients send `null` for
/// "not given").
fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

/// `Invalid type for '{param}': ...`, for the checks of free-form objects.
fn type_error(param: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::invalid_request(param, format!("Invalid type for '{param}': expected {expected}, but got {} instead.", de::type_name(got)))
}

/// Token counts of one completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
pub struct Usage {
    /// Tokens in the prompt (after the chat template).
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// How the prompt tokens were served.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV came from the prefix cache (computed for an earlier request
    /// of the same tenant and salt).
    pub cached_tokens: usize,
}

impl Usage {
    /// Usage from the counts.
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// A `chat.completion` object.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletion {
    /// `chatcmpl-...`.
    pub id: String,
    /// Always `chat.completion`.
    #[schema(example = "chat.completion")]
    pub object: &'static str,
    /// Unix time (seconds).
    pub created: u64,
    /// The model that answered.
    pub model: String,
    /// One choice per `n`, by `index`.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
}

/// One choice of a [`ChatCompletion`].
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChoice {
    /// Its place among the request's `n` choices.
    pub index: u32,
    /// The reply.
    pub message: AssistantMessage,
    /// The tokens' log-probabilities, when `logprobs` was asked for; else null.
    #[schema(required = true)]
    pub logprobs: Option<ChatLogprobs>,
    /// `stop`, `length`, `tool_calls` or `abort`.
    #[schema(value_type = String, example = "stop")]
    pub finish_reason: &'static str,
}

/// The assistant's reply.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: &'static str,
    /// The generated text; null when the reply is only tool calls.
    #[schema(required = true)]
    pub content: Option<String>,
    /// The tool calls parsed from the reply (absent when none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallObject>,
}

/// One tool call of a reply.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ToolCallObject {
    /// `call_...`.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    #[schema(example = "function")]
    pub kind: &'static str,
    /// The function and its arguments.
    pub function: FunctionCall,
}

/// A function called by name with arguments.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// Its arguments, as a JSON text.
    pub arguments: String,
}

/// One tool call in a stream chunk: complete in one delta.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ToolCallDelta {
    /// Its place among the choice's calls.
    pub index: u32,
    /// `call_...`.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    #[schema(example = "function")]
    pub kind: &'static str,
    /// The function and its whole arguments.
    pub function: FunctionCall,
}

/// `logprobs` of a chat choice or chunk.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct ChatLogprobs {
    /// One entry per generated token.
    pub content: Vec<TokenLogprob>,
}

/// A generated token's log-probability and the most likely alternatives at its step, under
/// the model (before penalties, bias and grammar).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its natural-log probability.
    pub logprob: f32,
    /// Its bytes (a token may hold part of a UTF-8 character).
    pub bytes: Vec<u8>,
    /// The `top_logprobs` most likely tokens, most likely first.
    pub top_logprobs: Vec<TopLogprob>,
}

/// One alternative in [`TokenLogprob::top_logprobs`].
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TopLogprob {
    /// The token's text.
    pub token: String,
    /// Its natural-log probability.
    pub logprob: f32,
    /// Its bytes.
    pub bytes: Vec<u8>,
}

/// `logprobs` of a text completion choice (the legacy form).
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct TextLogprobs {
    /// The generated tokens' texts.
    pub tokens: Vec<String>,
    /// Their log-probabilities.
    pub token_logprobs: Vec<f32>,
    /// Per token, the `logprobs` most likely tokens' texts and log-probabilities.
    pub top_logprobs: Vec<BTreeMap<String, f32>>,
    /// Where each token's text starts in the choice's `text`, in bytes.
    pub text_offset: Vec<usize>,
}

/// A `text_completion` object.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextCompletion {
    /// `cmpl-...`.
    pub id: String,
    /// Always `text_completion`.
    #[schema(example = "text_completion")]
    pub object: &'static str,
    /// Unix time (seconds).
    pub created: u64,
    /// The model that answered.
    pub model: String,
    /// One choice per prompt and `n`, by `index`.
    pub choices: Vec<TextChoice>,
    /// Token counts (absent in stream chunks unless `include_usage`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// One choice of a [`TextCompletion`] (also a stream chunk's choice).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextChoice {
    /// Its place: prompt number × `n` + choice number.
    pub index: u32,
    /// The generated text (a delta in stream chunks).
    pub text: String,
    /// The tokens' log-probabilities when `logprobs` was asked for; else null.
    #[schema(required = true)]
    pub logprobs: Option<TextLogprobs>,
    /// `stop`, `length` or `abort`; null in stream chunks before the last.
    #[schema(value_type = Option<FinishReason>, required = true)]
    pub finish_reason: Option<&'static str>,
}

/// A `chat.completion.chunk` object (one server-sent event of a chat stream).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChunk {
    /// Same id on every chunk of a stream.
    pub id: String,
    /// Always `chat.completion.chunk`.
    #[schema(example = "chat.completion.chunk")]
    pub object: &'static str,
    /// Unix time (seconds), same on every chunk.
    pub created: u64,
    /// The model that answered.
    pub model: String,
    /// One choice, or none in the usage chunk.
    pub choices: Vec<ChunkChoice>,
    /// Absent unless `include_usage`; then null except in the usage chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// One choice of a [`ChatChunk`].
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChunkChoice {
    /// Which of the request's `n` choices it continues.
    pub index: u32,
    /// What changed.
    pub delta: Delta,
    /// The log-probabilities of this chunk's tokens, when asked for; else null.
    #[schema(required = true)]
    pub logprobs: Option<ChatLogprobs>,
    /// Null until the choice's last chunk.
    #[schema(value_type = Option<String>, required = true)]
    pub finish_reason: Option<&'static str>,
}

/// The change one chat chunk carries; absent fields are omitted.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct Delta {
    /// `assistant`, in the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Tool calls completed in this chunk.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallDelta>,
}

/// A model in `GET /v1/models`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelObject {
    /// The model's name.
    pub id: String,
    /// Always `model`.
    #[schema(example = "model")]
    pub object: &'static str,
    /// Unix time (seconds) it was loaded.
    pub created: u64,
    /// Who serves it.
    pub owned_by: String,
    /// Most tokens per request (prompt + completion), as vLLM reports it.
    pub max_model_len: usize,
}

impl From<ModelCard> for ModelObject {
    fn from(c: ModelCard) -> Self {
        ModelObject { id: c.id, object: "model", created: c.created, owned_by: c.owned_by, max_model_len: c.max_model_len }
    }
}

/// The `GET /v1/models` body.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelList {
    /// Always `list`.
    #[schema(example = "list")]
    pub object: &'static str,
    /// The models.
    pub data: Vec<ModelObject>,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn text(extra: Value) -> Result<CompletionParams, ApiError> {
        let mut body = json!({"model": "m", "prompt": "hi"});
        if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
            b.extend(e);
        }
        parse_completion(&body, &Defaults::default())
    }

    fn refused(extra: Value) -> Option<String> {
        text(extra).err().and_then(|e| e.param)
    }

    /// A request without `temperature` samples at OpenAI's default (1), or at the
    /// operator's default; one that sets it gets what it set.
    #[test]
    fn a_request_without_temperature_gets_openais_default_or_the_operators() {
        assert_eq!(text(json!({})).expect("accepted").sampling.temperature, 1.0);
        assert_eq!(text(json!({ "temperature": 0 })).expect("accepted").sampling.temperature, 0.0);
        let greedy = Defaults { temperature: 0.0 };
        let body = json!({"model": "m", "prompt": "hi"});
        assert_eq!(parse_completion(&body, &greedy).expect("accepted").sampling.temperature, 0.0);
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5});
        assert_eq!(parse_chat(&body, &greedy).expect("accepted").sampling.temperature, 0.5);
    }

    // Found by schemathesis: the schema's `exclusiveMinimum: 0` admits it.
    #[test]
    fn a_tiny_positive_top_p_is_accepted_and_stays_positive() {
        for p in [5e-324, 3.5e-56, 1e-40] {
            let s = text(json!({ "top_p": p })).expect("accepted").sampling;
            assert!(s.top_p > 0.0, "{p} -> {}", s.top_p);
        }
        assert_eq!(refused(json!({ "top_p": 0 })).as_deref(), Some("top_p"));
    }

    // Found by schemathesis: JSON Schema's `integer` admits `4.0`.
    #[test]
    fn whole_decimals_count_as_integers() {
        let p = text(json!({ "max_tokens": 4.0, "n": 1.0, "top_k": 3.0, "seed": 7.0 })).expect("accepted");
        assert_eq!(p.max_tokens, Some(4));
        assert_eq!(p.sampling.top_k, 3);
        assert_eq!(p.sampling.seed, Some(7));
        assert_eq!(text(json!({ "top_k": -1.0 })).expect("off").sampling.top_k, 0);
        for (extra, param) in [
            (json!({ "max_tokens": 4.5 }), "max_tokens"),
            (json!({ "max_tokens": 0.0 }), "max_tokens"),
            (json!({ "max_tokens": 1e30 }), "max_tokens"),
            (json!({ "seed": -3.0 }), "seed"),
            (json!({ "seed": 0.5 }), "seed"),
            (json!({ "top_k": -2.0 }), "top_k"),
        ] {
            assert_eq!(refused(extra.clone()).as_deref(), Some(param), "{extra}");
        }
        // Whole numbers past u64 still fold deterministically.
        assert_eq!(text(json!({ "seed": 1e30 })).expect("seed").sampling.seed, Some(1e30f64.to_bits()));
    }

    // Found by schemathesis: the decode worker refused it with its own wording, no `param`.
    #[test]
    fn an_empty_prompt_is_refused_naming_prompt() {
        for (prompt, param) in [(json!(""), "prompt"), (json!([""]), "prompt[0]")] {
            let e = parse_completion(&json!({"model": "m", "prompt": prompt}), &Defaults::default()).expect_err("empty");
            assert_eq!(e.param.as_deref(), Some(param));
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn token_id_and_batch_prompts_parse_and_special_tokens_are_skipped_unless_asked() {
        let prompts = |prompt: Value| parse_completion(&json!({"model": "m", "prompt": prompt}), &Defaults::default()).map(|p| p.prompts);
        assert_eq!(prompts(json!([1, 2, 3])).unwrap(), vec![Prompt::Tokens(vec![1, 2, 3])]);
        assert_eq!(prompts(json!([[1, 2], [3]])).unwrap(), vec![Prompt::Tokens(vec![1, 2]), Prompt::Tokens(vec![3])]);
        assert_eq!(prompts(json!(["a", "b"])).unwrap(), vec![Prompt::Text("a".into()), Prompt::Text("b".into())]);
        for (bad, param) in [
            (json!([-1]), "prompt[0]"),
            (json!([[]]), "prompt[0]"),
            (json!([1.5]), "prompt[0]"),
            (json!(["a", 3]), "prompt[1]"),
            (json!([1e12]), "prompt[0]"),
        ] {
            let e = prompts(bad.clone()).expect_err("refused");
            assert_eq!(e.param.as_deref(), Some(param), "{bad}: {}", e.message);
        }
        let many: Vec<String> = (0..=MAX_GENERATIONS).map(|i| format!("p{i}")).collect();
        assert_eq!(prompts(json!(many)).expect_err("too many").param.as_deref(), Some("prompt"));
        assert!(text(json!({})).expect("default").sampling.skip_special_tokens);
        assert!(!text(json!({ "skip_special_tokens": false })).expect("off").sampling.skip_special_tokens);
        assert_eq!(refused(json!({ "skip_special_tokens": 1 })).as_deref(), Some("skip_special_tokens"));
    }

    #[test]
    fn unsupported_and_unknown_fields_are_refused_by_name() {
        for (f, ..) in UNSUPPORTED {
            assert_eq!(refused(json!({ *f: {"x": 1} })).as_deref(), Some(*f), "{f}");
        }
        assert!(text(json!({ "use_beam_search": false, "add_generation_prompt": true })).is_ok(), "the defaults change nothing");
        assert_eq!(refused(json!({ "use_beam_search": true })).as_deref(), Some("use_beam_search"));
        assert_eq!(refused(json!({ "modalities": ["text", "audio"] })).as_deref(), Some("modalities"));
        assert_eq!(refused(json!({ "store": true })).as_deref(), Some("store"));
        assert!(text(json!({ "store": false, "modalities": ["text"], "user": "u", "metadata": {"a": "b"} })).is_ok());
        let e = text(json!({ "temprature": 0.5 })).expect_err("a misspelt field");
        assert_eq!((e.param.as_deref(), e.code), (Some("temprature"), Some("unknown_parameter")));
        assert!(e.message.contains("temprature"), "{}", e.message);
        // A null unknown field is still unknown: the name is what is wrong.
        assert_eq!(refused(json!({ "frobnicate": null })).as_deref(), Some("frobnicate"));
        // Each endpoint knows only its own fields: chat has no `suffix`, `prompt` or `echo`,
        // completions no `messages` or `tools`.
        let chat = |extra: Value| {
            let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            parse_chat(&body, &Defaults::default()).err().and_then(|e| e.param)
        };
        for f in ["suffix", "prompt", "echo", "best_of"] {
            assert_eq!(chat(json!({ f: "x" })).as_deref(), Some(f));
        }
        for f in ["messages", "tools", "top_logprobs"] {
            assert_eq!(refused(json!({ f: [] })).as_deref(), Some(f));
        }
        // Inside fixed objects too; free-form ones (metadata, logit_bias) stay free.
        assert_eq!(chat(json!({"messages": [{"role": "user", "content": "hi", "nmae": "x"}]})).as_deref(), Some("messages[0].nmae"));
        let part = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]});
        assert_eq!(chat(part).as_deref(), Some("messages[0].content[0].x"));
        assert_eq!(refused(json!({ "stream_options": {"include_usage": true, "inclde": 1} })).as_deref(), Some("stream_options.inclde"));
        // What the official client sends back with an assistant message it was given.
        let echoed = json!({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo", "refusal": null, "annotations": [], "audio": null, "function_call": null},
            {"role": "user", "content": "again"}]});
        assert_eq!(chat(echoed), None);
        assert_eq!(
            chat(json!({"messages": [{"role": "assistant", "content": "x", "audio": {"id": "a"}}]})).as_deref(),
            Some("messages[0].audio")
        );
    }

    #[test]
    fn integers_past_u64_are_reported_whole() {
        let big: Value = serde_json::from_str("18446744073709551616").expect("a JSON number");
        let e = text(json!({ "max_tokens": big })).expect_err("too big");
        assert!(e.message.contains("18446744073709551616"), "{}", e.message);
    }

    #[test]
    fn sampling_controls_are_range_checked_and_carried() {
        let p = text(json!({
            "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2, "min_p": 0.1,
            "logit_bias": {"7": -100, "3": 5.5}, "min_tokens": 2, "max_tokens": 4, "stop_token_ids": [9, 8], "logprobs": 3
        }))
        .expect("accepted");
        let s = p.sampling;
        assert_eq!((s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p), (0.5, -1.0, 1.2, 0.1));
        assert_eq!(s.logit_bias, vec![(3, 5.5), (7, -100.0)]);
        assert_eq!((s.min_tokens, s.stop_token_ids.as_slice(), s.logprobs), (2, &[9, 8][..], Some(3)));
        for (extra, param) in [
            (json!({ "presence_penalty": 2.5 }), "presence_penalty"),
            (json!({ "frequency_penalty": -3 }), "frequency_penalty"),
            (json!({ "repetition_penalty": 0 }), "repetition_penalty"),
            (json!({ "min_p": 1.5 }), "min_p"),
            (json!({ "logit_bias": {"x": 1} }), "logit_bias.x"),
            (json!({ "logit_bias": {"1": 101} }), "logit_bias.1"),
            (json!({ "min_tokens": 5, "max_tokens": 4 }), "min_tokens"),
            (json!({ "stop_token_ids": [-1] }), "stop_token_ids[0]"),
            (json!({ "logprobs": 6 }), "logprobs"),
            (json!({ "n": 0 }), "n"),
            (json!({ "n": 17 }), "n"),
            (json!({ "n": 3, "best_of": 2 }), "best_of"),
            (json!({ "best_of": 3, "stream": true }), "best_of"),
            (json!({ "echo": true, "logprobs": 1 }), "echo"),
        ] {
            assert_eq!(refused(extra.clone()).as_deref(), Some(param), "{extra}");
        }
        let chat = |extra: Value| {
            let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
            if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
                b.extend(e);
            }
            parse_chat(&body, &Defaults::default())
        };
        assert_eq!(chat(json!({"logprobs": true, "top_logprobs": 5})).expect("chat").sampling.logprobs, Some(5));
        assert_eq!(chat(json!({"top_logprobs": 5})).expect_err("needs logprobs").param.as_deref(), Some("top_logprobs"));
        assert_eq!(chat(json!({"logprobs": true, "top_logprobs": 21})).expect_err("too many").param.as_deref(), Some("top_logprobs"));
    }

    #[test]
    fn one_output_constraint_at_most_from_any_of_its_fields() {
        use bulkhead_protocol::GrammarSpec;
        let g = |extra: Value| text(extra).map(|p| (p.sampling.grammar, p.grammar_param));
        assert_eq!(
            g(json!({"response_format": {"type": "json_object"}})).unwrap(),
            (Some(GrammarSpec::JsonObject), Some("response_format"))
        );
        assert_eq!(g(json!({"response_format": {"type": "text"}})).unwrap(), (None, None));
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            g(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}))
                .unwrap()
                .0,
            Some(GrammarSpec::JsonSchema(schema.to_string()))
        );
        assert_eq!(g(json!({"guided_json": schema.to_string()})).unwrap().0, Some(GrammarSpec::JsonSchema(schema.to_string())));
        assert_eq!(g(json!({"guided_regex": "[0-9]+"})).unwrap().0, Some(GrammarSpec::Regex("[0-9]+".into())));
        assert_eq!(g(json!({"guided_choice": ["a", "b"]})).unwrap().0, Some(GrammarSpec::Choice(vec!["a".into(), "b".into()])));
        assert_eq!(g(json!({"structured_outputs": {"grammar": "start: \"x\""}})).unwrap().1, Some("structured_outputs"));
        for (extra, param) in [
            (json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}), "guided_regex"),
            (json!({"response_format": {"type": "yaml"}}), "response_format.type"),
            (json!({"response_format": {"type": "json_schema"}}), "response_format.json_schema"),
            (json!({"guided_choice": []}), "guided_choice"),
            (json!({"guided_json": "not json"}), "guided_json"),
            (json!({"guided_decoding_backend": "xgrammar"}), "guided_decoding_backend"),
        ] {
            assert_eq!(refused(extra.clone()).as_deref(), Some(param), "{extra}");
        }
    }
}
