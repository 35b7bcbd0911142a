//! The OpenAI wire format: request bodies checked field by field (so a wrong type names its
//! `param`, and an unknown field is refused with 400 naming it, as OpenAI does: a misspelt
//! `temprature` must not pass as a default) and the response and stream-chunk objects.

use bulkhead_protocol::Sampling;
use bulkhead_tokenizer::ChatMessage;
use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{Map, Number, Value};
use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema, Type};
use utoipa::{PartialSchema, ToSchema};

use crate::backend::{FinishReason, ModelCard, Prompt};
use crate::error::ApiError;
use crate::tools::{self, Tools};

mod grammar;

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
    ("priority", "request priorities are not supported (the queue is fair across tenants)", None),
];

/// Request fields both endpoints read; any field outside these, [`CHAT_ONLY`] or
/// [`TEXT_ONLY`] (by endpoint) and [`UNSUPPORTED`] is refused as unknown.
#[rustfmt::skip]
const KNOWN: &[&str] = &[
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stream",
    "stream_options", "stop", "ignore_eos", "skip_special_tokens", "cache_salt", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "logprobs", "min_tokens", "stop_token_ids", "response_format", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend", "structured_outputs", "user", "metadata",
    "store", "service_tier", "modalities",
];
/// Fields only `/v1/chat/completions` reads.
const CHAT_ONLY: &[&str] = &["messages", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs"];
/// Fields only `/v1/completions` reads.
const TEXT_ONLY: &[&str] = &["prompt", "best_of", "echo"];
/// A chat message's fields. The last four are what the official clients send back when a
/// response's message is appended to the conversation; they are accepted only empty.
#[rustfmt::skip]
const MESSAGE_FIELDS: &[&str] = &[
    "role", "content", "name", "tool_calls", "tool_call_id", "refusal", "annotations", "audio", "function_call",
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

/// Parse a `POST /v1/chat/completions` body.
pub fn parse_chat(body: &Value) -> Result<CompletionParams, ApiError> {
    let obj = as_object(body)?;
    let messages = parse_messages(obj)?;
    let tools = tools::parse(obj)?;
    let mut p = common(obj, vec![Prompt::Chat { messages, tools: tools.clone() }], Endpoint::Chat)?;
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

/// Parse a `POST /v1/completions` body.
pub fn parse_completion(body: &Value) -> Result<CompletionParams, ApiError> {
    let obj = as_object(body)?;
    let prompts = match field(obj, "prompt") {
        None => {
            return Err(ApiError::invalid_request("prompt", "Missing required parameter: 'prompt'."));
        }
        Some(Value::String(s)) => vec![text_prompt(s, "prompt")?],
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(ApiError::invalid_request("prompt", "Invalid 'prompt': empty array."));
        }
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => vec![token_prompt(items, "prompt")?],
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let param = format!("prompt[{i}]");
                match item {
                    Value::String(s) => text_prompt(s, &param),
                    Value::Array(ids) => token_prompt(ids, &param),
                    v => Err(type_error(&param, "a string or an array of token ids", v)),
                }
            })
            .collect::<Result<_, _>>()?,
        Some(v) => {
            return Err(type_error("prompt", "a string, an array of strings, an array of token ids or an array of such arrays", v));
        }
    };
    common(obj, prompts, Endpoint::Text)
}

/// A text prompt; empty is refused (nothing to continue from; vLLM refuses it too).
fn text_prompt(s: &str, param: &str) -> Result<Prompt, ApiError> {
    if s.is_empty() {
        return Err(ApiError::invalid_request(param, format!("Invalid '{param}': it is empty. Send at least one character.")));
    }
    Ok(Prompt::Text(s.to_owned()))
}

/// A token-id prompt (checked against the vocabulary by the backend).
fn token_prompt(ids: &[Value], param: &str) -> Result<Prompt, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid_request(param, format!("Invalid '{param}': empty array of token ids.")));
    }
    let ids = ids
        .iter()
        .enumerate()
        .map(|(i, v)| {
            u32::try_from(int(v, &format!("{param}[{i}]"), 0)?).map_err(|_| range_error(&format!("{param}[{i}]"), "a token id".into(), v))
        })
        .collect::<Result<_, _>>()?;
    Ok(Prompt::Tokens(ids))
}

/// Which endpoint a body came to: some fields belong to one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Text,
}

/// The fields chat and text completions share.
fn common(obj: &Map<String, Value>, prompts: Vec<Prompt>, endpoint: Endpoint) -> Result<CompletionParams, ApiError> {
    check_fields(obj, endpoint)?;
    let user = match field(obj, "user") {
        None => None,
        Some(Value::String(u)) => Some(u.chars().take(256).collect()),
        Some(v) => return Err(type_error("user", "a string", v)),
    };
    let model = match field(obj, "model") {
        None => {
            return Err(ApiError::invalid_request("model", "Missing required parameter: 'model'."));
        }
        Some(Value::String(s)) => s.clone(),
        Some(v) => return Err(type_error("model", "a string", v)),
    };
    let max_tokens = match field(obj, "max_completion_tokens") {
        Some(v) => Some(positive_int(v, "max_completion_tokens")?),
        None => field(obj, "max_tokens").map(|v| positive_int(v, "max_tokens")).transpose()?,
    };
    let mut sampling = parse_sampling(obj, endpoint, max_tokens)?;
    let (grammar, grammar_param) = match grammar::parse(obj)? {
        Some((g, param)) => (Some(g), Some(param)),
        None => (None, None),
    };
    sampling.grammar = grammar;
    let n = match field(obj, "n") {
        None => 1,
        Some(v) => choices(v, "n")?,
    };
    let best_of = match (endpoint, field(obj, "best_of")) {
        (Endpoint::Text, Some(v)) => {
            let b = choices(v, "best_of")?;
            if b < n {
                return Err(ApiError::invalid_request("best_of", "best_of must be at least n."));
            }
            b
        }
        _ => n,
    };
    let stream = match field(obj, "stream") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(type_error("stream", "a boolean", v)),
    };
    if stream && best_of > n {
        return Err(ApiError::invalid_request("best_of", "best_of larger than n cannot be streamed (the best are known only at the end)."));
    }
    if prompts.len().saturating_mul(best_of) > MAX_GENERATIONS {
        return Err(ApiError::invalid_request(
            "prompt",
            format!("{} prompts times {best_of} generations each is over the limit of {MAX_GENERATIONS} per request.", prompts.len()),
        ));
    }
    let echo = match (endpoint, field(obj, "echo")) {
        (Endpoint::Text, Some(Value::Bool(b))) => *b,
        (Endpoint::Text, Some(v)) => return Err(type_error("echo", "a boolean", v)),
        _ => false,
    };
    if echo && sampling.logprobs.is_some() {
        return Err(ApiError::invalid_request(
            "echo",
            "echo with logprobs is not supported: the prompt's log-probabilities are not computed.",
        )
        .with_code("unsupported_parameter"));
    }
    let include_usage = match field(obj, "stream_options") {
        None => false,
        Some(Value::Object(o)) => match deny_unknown(o, "stream_options", |k| k == "include_usage").and(Ok(field(o, "include_usage")))? {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(type_error("stream_options.include_usage", "a boolean", v)),
        },
        Some(v) => return Err(type_error("stream_options", "an object", v)),
    };
    let stop = parse_stop(obj)?;
    let cache_salt = match field(obj, "cache_salt") {
        None => None,
        // vLLM's rule: an empty salt is refused rather than silently made a scope of its own
        // (leave the field out to share the tenant's cache).
        Some(Value::String(s)) if s.is_empty() => {
            return Err(ApiError::invalid_request(
                "cache_salt",
                "cache_salt must be a non-empty string if provided; leave it out to share the tenant's cache.",
            ));
        }
        Some(Value::String(s)) if s.len() <= MAX_CACHE_SALT => Some(s.clone()),
        Some(Value::String(s)) => {
            return Err(ApiError::invalid_request("cache_salt", format!("cache_salt is {} bytes; the most is {MAX_CACHE_SALT}.", s.len())));
        }
        Some(v) => return Err(type_error("cache_salt", "a string", v)),
    };
    Ok(CompletionParams {
        model,
        prompts,
        max_tokens,
        sampling,
        stop,
        stream,
        include_usage,
        cache_salt,
        n,
        best_of,
        echo,
        tools: None,
        grammar_param,
        user,
    })
}

/// The field set of a body: unsupported fields (unless set to their default), unknown ones
/// and the few whose only accepted value is the default are refused, naming the field.
fn check_fields(obj: &Map<String, Value>, endpoint: Endpoint) -> Result<(), ApiError> {
    for (name, why, default) in UNSUPPORTED {
        let Some(v) = field(obj, name) else { continue };
        let harmless = default.is_some_and(|d| v.as_bool() == Some(d));
        if !harmless && (*name != "suffix" || endpoint == Endpoint::Text) {
            return Err(ApiError::invalid_request(*name, format!("'{name}': {why}.")).with_code("unsupported_parameter"));
        }
    }
    let own = match endpoint {
        Endpoint::Chat => CHAT_ONLY,
        Endpoint::Text => TEXT_ONLY,
    };
    deny_unknown(obj, "", |k| {
        KNOWN.contains(&k) || own.contains(&k) || UNSUPPORTED.iter().any(|u| u.0 == k && (k != "suffix" || endpoint == Endpoint::Text))
    })?;
    match field(obj, "modalities") {
        None => {}
        Some(Value::Array(m)) if m.iter().all(|x| x.as_str() == Some("text")) => {}
        Some(_) => {
            return Err(
                ApiError::invalid_request("modalities", "Only the 'text' modality is supported.").with_code("unsupported_parameter")
            );
        }
    }
    if let Some(Value::Bool(true)) = field(obj, "store") {
        return Err(ApiError::invalid_request("store", "Stored completions are not supported: this server keeps no completions.")
            .with_code("unsupported_parameter"));
    }
    match field(obj, "service_tier") {
        None => {}
        Some(Value::String(t)) if t == "auto" || t == "default" => {}
        Some(_) => {
            return Err(ApiError::invalid_request("service_tier", "Only the 'auto' and 'default' service tiers exist here.")
                .with_code("unsupported_parameter"));
        }
    }
    match field(obj, "metadata") {
        None => {}
        Some(Value::Object(m)) if m.values().all(Value::is_string) => {}
        Some(v) => return Err(type_error("metadata", "an object of strings", v)),
    }
    Ok(())
}

/// The sampling controls of a body, range-checked (`max_tokens` bounds `min_tokens`).
fn parse_sampling(obj: &Map<String, Value>, endpoint: Endpoint, max_tokens: Option<usize>) -> Result<Sampling, ApiError> {
    let mut sampling = Sampling::default();
    if let Some(v) = field(obj, "temperature") {
        let t = number(v, "temperature")?;
        if !(0.0..=MAX_TEMPERATURE).contains(&t) {
            return Err(range_error("temperature", format!("a value in [0, {MAX_TEMPERATURE}]"), v));
        }
        sampling.temperature = t as f32;
    }
    if let Some(v) = field(obj, "top_p") {
        let p = number(v, "top_p")?;
        if !(p > 0.0 && p <= 1.0) {
            return Err(range_error("top_p", "a value in (0, 1]".into(), v));
        }
        // The f32 rounding must not turn a tiny positive top_p into 0 (outside the sampler's
        // range): the smallest positive f32 keeps only the most likely token, as `p` does.
        sampling.top_p = (p as f32).max(f32::MIN_POSITIVE);
    }
    if let Some(v) = field(obj, "top_k") {
        sampling.top_k = match v.as_f64() {
            Some(-1.0) => 0, // vLLM's "off"
            _ => u32::try_from(int(v, "top_k", 0)?).unwrap_or(u32::MAX),
        };
    }
    sampling.min_p = bounded(obj, "min_p", 0.0, 1.0)?.unwrap_or(0.0) as f32;
    sampling.presence_penalty = bounded(obj, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32;
    sampling.frequency_penalty = bounded(obj, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32;
    if let Some(v) = field(obj, "repetition_penalty") {
        let r = number(v, "repetition_penalty")?;
        if !(r > 0.0 && r <= 2.0) {
            return Err(range_error("repetition_penalty", "a value in (0, 2]".into(), v));
        }
        sampling.repetition_penalty = r as f32;
    }
    sampling.logit_bias = parse_logit_bias(obj)?;
    if let Some(v) = field(obj, "min_tokens") {
        sampling.min_tokens =
            u32::try_from(int(v, "min_tokens", 0)?).map_err(|_| range_error("min_tokens", "a value that fits the context".into(), v))?;
        if max_tokens.is_some_and(|m| sampling.min_tokens as usize > m) {
            return Err(ApiError::invalid_request("min_tokens", "min_tokens must not be larger than max_tokens."));
        }
    }
    sampling.stop_token_ids = match field(obj, "stop_token_ids") {
        None => Vec::new(),
        Some(Value::Array(ids)) if ids.len() <= MAX_TOKEN_LIST => ids
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let p = format!("stop_token_ids[{i}]");
                u32::try_from(int(v, &p, 0)?).map_err(|_| range_error(&p, "a token id".into(), v))
            })
            .collect::<Result<_, _>>()?,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid_request("stop_token_ids", format!("At most {MAX_TOKEN_LIST} stop_token_ids.")));
        }
        Some(v) => return Err(type_error("stop_token_ids", "an array of token ids", v)),
    };
    sampling.logprobs = parse_logprobs(obj, endpoint)?;
    if let Some(v) = field(obj, "seed") {
        sampling.seed = Some(seed(v)?);
    }
    // Not OpenAI's: llama.cpp's and vLLM's extension, for fixed-length benchmarks.
    match field(obj, "ignore_eos") {
        None => {}
        Some(Value::Bool(b)) => sampling.ignore_eos = *b,
        Some(v) => return Err(type_error("ignore_eos", "a boolean", v)),
    }
    // vLLM's: special tokens (`<|im_start|>`, ...) are left out of the text unless asked for.
    match field(obj, "skip_special_tokens") {
        None => {}
        Some(Value::Bool(b)) => sampling.skip_special_tokens = *b,
        Some(v) => return Err(type_error("skip_special_tokens", "a boolean", v)),
    }
    Ok(sampling)
}

/// `n` or `best_of`: 1 to [`MAX_N`].
fn choices(v: &Value, param: &str) -> Result<usize, ApiError> {
    match int(v, param, 1)? {
        x if x as usize <= MAX_N => Ok(x as usize),
        _ => Err(range_error(param, format!("a value in [1, {MAX_N}]"), v)),
    }
}

/// An optional number in `[lo, hi]`.
fn bounded(obj: &Map<String, Value>, param: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    let Some(v) = field(obj, param) else { return Ok(None) };
    let x = number(v, param)?;
    if !(lo..=hi).contains(&x) {
        return Err(range_error(param, format!("a value in [{lo}, {hi}]"), v));
    }
    Ok(Some(x))
}

/// `logit_bias`: token ids (as strings, OpenAI's form) to a bias in [-100, 100].
fn parse_logit_bias(obj: &Map<String, Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(v) = field(obj, "logit_bias") else { return Ok(Vec::new()) };
    let Value::Object(map) = v else { return Err(type_error("logit_bias", "an object of token ids to numbers", v)) };
    if map.len() > MAX_TOKEN_LIST {
        return Err(ApiError::invalid_request("logit_bias", format!("At most {MAX_TOKEN_LIST} logit_bias entries.")));
    }
    let mut out = Vec::with_capacity(map.len());
    for (k, b) in map {
        let param = format!("logit_bias.{k}");
        let id: u32 =
            k.parse().map_err(|_| ApiError::invalid_request(param.clone(), format!("Invalid 'logit_bias': '{k}' is not a token id.")))?;
        let bias = number(b, &param)?;
        if !(-100.0..=100.0).contains(&bias) {
            return Err(range_error(&param, "a value in [-100, 100]".into(), b));
        }
        out.push((id, bias as f32));
    }
    out.sort_unstable_by_key(|e| e.0);
    Ok(out)
}

/// Chat: `logprobs` (boolean) and `top_logprobs` (0–20, only with `logprobs`). Text:
/// `logprobs` (0–5 alternatives).
fn parse_logprobs(obj: &Map<String, Value>, endpoint: Endpoint) -> Result<Option<u8>, ApiError> {
    match endpoint {
        Endpoint::Chat => {
            let on = match field(obj, "logprobs") {
                None => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => return Err(type_error("logprobs", "a boolean", v)),
            };
            let top = match field(obj, "top_logprobs") {
                None => None,
                Some(v) => match int(v, "top_logprobs", 0)? {
                    x if x <= MAX_TOP_LOGPROBS => Some(x as u8),
                    _ => return Err(range_error("top_logprobs", format!("a value in [0, {MAX_TOP_LOGPROBS}]"), v)),
                },
            };
            match (on, top) {
                (false, Some(_)) => Err(ApiError::invalid_request("top_logprobs", "top_logprobs requires logprobs: true.")),
                (false, None) => Ok(None),
                (true, top) => Ok(Some(top.unwrap_or(0))),
            }
        }
        Endpoint::Text => match field(obj, "logprobs") {
            None => Ok(None),
            Some(v) => match int(v, "logprobs", 0)? {
                x if x <= MAX_TEXT_LOGPROBS => Ok(Some(x as u8)),
                _ => Err(range_error("logprobs", format!("a value in [0, {MAX_TEXT_LOGPROBS}]"), v)),
            },
        },
    }
}

fn parse_messages(obj: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match field(obj, "messages") {
        None => {
            return Err(ApiError::invalid_request("messages", "Missing required parameter: 'messages'."));
        }
        Some(Value::Array(items)) => items,
        Some(v) => return Err(type_error("messages", "an array", v)),
    };
    if items.is_empty() {
        return Err(ApiError::invalid_request(
            "messages",
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead.",
        ));
    }
    items.iter().enumerate().map(|(i, m)| parse_message(i, m)).collect()
}

fn parse_message(i: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let p = |f: &str| format!("messages[{i}].{f}");
    let Value::Object(m) = m else {
        return Err(type_error(&format!("messages[{i}]"), "an object", m));
    };
    deny_unknown(m, &format!("messages[{i}]"), |k| MESSAGE_FIELDS.contains(&k))?;
    for key in &MESSAGE_FIELDS[5..] {
        match m.get(*key) {
            None | Some(Value::Null) => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(_) => {
                return Err(ApiError::invalid_request(p(key), format!("'{}' is not supported in a request.", p(key)))
                    .with_code("unsupported_parameter"));
            }
        }
    }
    let role = match field(m, "role") {
        None => {
            return Err(ApiError::invalid_request(p("role"), format!("Missing required parameter: '{}'.", p("role"))));
        }
        Some(Value::String(r)) => match r.as_str() {
            "system" | "user" | "assistant" | "tool" => r.clone(),
            "developer" => "system".to_string(),
            other => {
                return Err(ApiError::invalid_request(
                    p("role"),
                    format!("Invalid value: '{other}'. Supported values are: 'system', 'developer', 'user', 'assistant' and 'tool'."),
                ));
            }
        },
        Some(v) => return Err(type_error(&p("role"), "a string", v)),
    };
    let content = match field(m, "content") {
        // An assistant turn that only called tools has no content.
        None if role == "assistant" => String::new(),
        None => {
            return Err(ApiError::invalid_request(p("content"), format!("Missing required parameter: '{}'.", p("content"))));
        }
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                texts.push(text_part(&format!("messages[{i}].content[{j}]"), part)?);
            }
            texts.join("\n")
        }
        Some(v) => {
            return Err(type_error(&p("content"), "a string or an array of content parts", v));
        }
    };
    let mut msg = ChatMessage::new(role, content);
    match field(m, "tool_calls") {
        None => {}
        Some(Value::Array(calls)) if msg.role == "assistant" => msg.tool_calls = Some(Value::Array(parse_tool_calls(i, calls)?)),
        Some(Value::Array(_)) => return Err(ApiError::invalid_request(p("tool_calls"), "Only assistant messages carry tool_calls.")),
        Some(v) => return Err(type_error(&p("tool_calls"), "an array", v)),
    }
    for (key, slot) in [("tool_call_id", &mut msg.tool_call_id), ("name", &mut msg.name)] {
        match field(m, key) {
            None => {}
            Some(Value::String(s)) => *slot = Some(s.clone()),
            Some(v) => return Err(type_error(&p(key), "a string", v)),
        }
    }
    if msg.role == "tool" && msg.tool_call_id.is_none() {
        return Err(ApiError::invalid_request(p("tool_call_id"), format!("Missing required parameter: '{}'.", p("tool_call_id"))));
    }
    Ok(msg)
}

/// An assistant message's `tool_calls`, checked: each has an `id` and a `function` with a
/// `name` and `arguments` (a JSON text, parsed into an object for the template where it is
/// one, as Hugging Face templates expect).
fn parse_tool_calls(i: usize, calls: &[Value]) -> Result<Vec<Value>, ApiError> {
    calls
        .iter()
        .enumerate()
        .map(|(j, c)| {
            let p = format!("messages[{i}].tool_calls[{j}]");
            let bad = |what: &str| ApiError::invalid_request(p.clone(), format!("Invalid '{p}': {what}."));
            let f = c.get("function").and_then(Value::as_object).ok_or_else(|| bad("'function' must be an object"))?;
            let name = f.get("name").and_then(Value::as_str).ok_or_else(|| bad("'function.name' must be a string"))?;
            let arguments = match f.get("arguments") {
                None | Some(Value::Null) => Value::Object(Map::new()),
                Some(Value::String(s)) => serde_json::from_str::<Value>(s).unwrap_or_else(|_| Value::String(s.clone())),
                Some(v) => v.clone(),
            };
            let id = c.get("id").and_then(Value::as_str).unwrap_or_default();
            Ok(serde_json::json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}))
        })
        .collect()
}

fn text_part<'a>(param: &str, part: &'a Value) -> Result<&'a str, ApiError> {
    let Value::Object(o) = part else {
        return Err(type_error(param, "an object", part));
    };
    if field(o, "type").and_then(Value::as_str) == Some("text") {
        deny_unknown(o, param, |k| k == "type" || k == "text")?;
    }
    match field(o, "type") {
        Some(Value::String(t)) if t == "text" => {}
        Some(Value::String(t)) => {
            return Err(ApiError::invalid_request(
                format!("{param}.type"),
                format!("Unsupported content part type '{t}': only 'text' is supported."),
            ));
        }
        Some(v) => return Err(type_error(&format!("{param}.type"), "a string", v)),
        None => {
            return Err(ApiError::invalid_request(format!("{param}.type"), format!("Missing required parameter: '{param}.type'.")));
        }
    }
    match field(o, "text") {
        Some(Value::String(s)) => Ok(s),
        Some(v) => Err(type_error(&format!("{param}.text"), "a string", v)),
        None => Err(ApiError::invalid_request(format!("{param}.text"), format!("Missing required parameter: '{param}.text'."))),
    }
}

fn parse_stop(obj: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let list: Vec<String> = match field(obj, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP {
                return Err(ApiError::invalid_request(
                    "stop",
                    format!("Invalid 'stop': array too long. Expected at most {MAX_STOP} stop sequences, but got {}.", items.len()),
                ));
            }
            let mut out = Vec::with_capacity(items.len());
            for (i, s) in items.iter().enumerate() {
                match s {
                    Value::String(s) => out.push(s.clone()),
                    v => return Err(type_error(&format!("stop[{i}]"), "a string", v)),
                }
            }
            out
        }
        Some(v) => return Err(type_error("stop", "a string or an array of strings", v)),
    };
    // An empty stop string would end every generation at once; it is no stop at all.
    Ok(list.into_iter().filter(|s| !s.is_empty()).collect())
}

/// The top-level object of a body, or 400.
fn as_object(body: &Value) -> Result<&Map<String, Value>, ApiError> {
    match body {
        Value::Object(o) => Ok(o),
        v => Err(ApiError::bad_request(format!("The request body must be a JSON object, but got {}.", type_name(v)))),
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

/// A field that is present and not `null` (clients send `null` for "not given").
fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

/// The value of a JSON number that is a whole number, `4` and `4.0` alike (JSON Schema's
/// `integer` admits both, so clients generated from a schema may send either); `None` for a
/// fraction. Whole numbers past the `i128` range saturate, which keeps them out of range.
fn whole(n: &Number) -> Option<i128> {
    if let Some(x) = n.as_u64() {
        return Some(x.into());
    }
    if let Some(x) = n.as_i64() {
        return Some(x.into());
    }
    n.as_f64().filter(|f| f.is_finite() && f.fract() == 0.0).map(|f| f as i128)
}

/// A JSON integer (or whole decimal) `>= min`, or 400 naming `param`.
fn int(v: &Value, param: &str, min: u64) -> Result<u64, ApiError> {
    let Value::Number(n) = v else {
        return Err(type_error(param, "an integer", v));
    };
    match whole(n) {
        None => Err(type_error(param, "an integer", v)),
        Some(x) if x < i128::from(min) => Err(range_error(param, format!("a value >= {min}"), v)),
        Some(x) => u64::try_from(x).map_err(|_| range_error(param, format!("a value <= {}", u64::MAX), v)),
    }
}

fn positive_int(v: &Value, param: &str) -> Result<usize, ApiError> {
    let x = int(v, param, 1)?;
    usize::try_from(x).map_err(|_| range_error(param, format!("a value <= {}", usize::MAX), v))
}

/// A finite JSON number, or 400 naming `param`.
fn number(v: &Value, param: &str) -> Result<f64, ApiError> {
    match v.as_f64() {
        Some(x) if x.is_finite() => Ok(x),
        _ => Err(type_error(param, "a number", v)),
    }
}

/// Any non-negative integer (or whole decimal). Integers past `u64::MAX` (which JSON
/// parsing turns into floats) are folded into a `u64` deterministically, so the same seed
/// still gives the same output.
fn seed(v: &Value) -> Result<u64, ApiError> {
    let Value::Number(n) = v else {
        return Err(type_error("seed", "an integer", v));
    };
    match whole(n) {
        None => Err(type_error("seed", "an integer", v)),
        Some(x) if x < 0 => Err(range_error("seed", "a value >= 0".into(), v)),
        Some(x) => Ok(u64::try_from(x).unwrap_or_else(|_| n.as_f64().map_or(u64::MAX, f64::to_bits))),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a decimal number",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn type_error(param: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::invalid_request(param, format!("Invalid type for '{param}': expected {expected}, but got {} instead.", type_name(got)))
}

fn range_error(param: &str, expected: String, got: &Value) -> ApiError {
    // Integers past u64 reach here as floats (`1.8446744073709552e19`): print them whole.
    let shown = match got {
        Value::Number(n) if n.is_f64() && whole(n).is_some() => n.as_f64().map_or_else(|| got.to_string(), |f| format!("{f:.0}")),
        _ => got.to_string(),
    };
    ApiError::invalid_request(param, format!("Invalid '{param}': expected {expected}, but got {shown} instead."))
}

// Request bodies as the OpenAPI document describes them. The handlers do not deserialise
// into these types: they parse the raw JSON with `parse_chat` / `parse_completion`, which name
// the faulty `param`. Unknown fields are accepted and ignored. tests/openapi.rs checks that
// every field documented here is one the parser reads, and the other way round.

/// The body of `POST /v1/chat/completions`.
#[derive(Debug, Clone, ToSchema)]
pub struct ChatCompletionRequest {
    /// The model to use (see `GET /v1/models`).
    pub model: String,
    /// The conversation so far; the model's chat template is applied to it.
    #[schema(min_items = 1)]
    pub messages: Vec<ChatMessageParam>,
    /// Functions the model may call (`{"type": "function", "function": {name, description,
    /// parameters}}`). They reach the chat template's `tools`, or a default tool preamble in
    /// the system message where the template has none.
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
    /// `none` (tools left out), `auto` (the default), `required`, or
    /// `{"type": "function", "function": {"name": ...}}`; the last two are enforced by a
    /// grammar, so the call always parses against the function's schema.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// Whether several calls may come in one reply (default true).
    pub parallel_tool_calls: Option<bool>,
    /// Return each generated token's log-probability.
    pub logprobs: Option<bool>,
    /// With `logprobs`: this many most likely alternatives per token.
    #[schema(minimum = 0, maximum = 20)]
    pub top_logprobs: Option<u32>,
    /// Settings shared with text completions.
    #[serde(flatten)]
    pub options: CompletionOptions,
}

/// The body of `POST /v1/completions`.
#[derive(Debug, Clone, ToSchema)]
pub struct CompletionRequest {
    /// The model to use (see `GET /v1/models`).
    pub model: String,
    /// The text to continue, tokenised as is: a string, token ids, or a batch of either.
    pub prompt: PromptParam,
    /// Return each generated token's log-probability and this many most likely
    /// alternatives.
    #[schema(minimum = 0, maximum = 5)]
    pub logprobs: Option<u32>,
    /// Start each choice's text with the prompt's (not with `logprobs`).
    pub echo: Option<bool>,
    /// Generate this many per prompt and return the `n` most likely (by the sum of their
    /// tokens' log-probabilities); not with `stream`.
    #[schema(minimum = 1, maximum = 16)]
    pub best_of: Option<u32>,
    /// Settings shared with chat completions.
    #[serde(flatten)]
    pub options: CompletionOptions,
}

/// Generation settings both completion endpoints take; `null` means not given.
#[derive(Debug, Clone, ToSchema)]
pub struct CompletionOptions {
    /// Most tokens to generate (default: what the context leaves after the prompt). A value
    /// larger than the model's context is refused with `context_length_exceeded`.
    #[schema(minimum = 1)]
    pub max_tokens: Option<u64>,
    /// Takes precedence over `max_tokens`.
    #[schema(minimum = 1)]
    pub max_completion_tokens: Option<u64>,
    /// Sampling temperature; 0 is greedy.
    #[schema(minimum = 0.0, maximum = 2.0)]
    pub temperature: Option<f64>,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches `top_p`.
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    pub top_p: Option<f64>,
    /// Keep only the `top_k` most likely tokens; 0 or -1 means no limit (not OpenAI's: vLLM's).
    #[schema(minimum = -1)]
    pub top_k: Option<i64>,
    /// Same seed, same parameters, same prompt: same output, also with `temperature > 0`.
    #[schema(minimum = 0)]
    pub seed: Option<u64>,
    /// Choices per prompt, each sampled independently (a seed gives each its own
    /// derived seed).
    #[schema(minimum = 1, maximum = 16)]
    pub n: Option<u32>,
    /// Keep only tokens at least this fraction as likely as the most likely one (vLLM's).
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub min_p: Option<f64>,
    /// Lowers the logit of every token already generated, once.
    #[schema(minimum = -2.0, maximum = 2.0)]
    pub presence_penalty: Option<f64>,
    /// Lowers the logit of every token already generated, per occurrence.
    #[schema(minimum = -2.0, maximum = 2.0)]
    pub frequency_penalty: Option<f64>,
    /// Divides the positive logits (multiplies the negative ones) of tokens in the prompt
    /// or generated so far (vLLM's); 1 is off.
    #[schema(exclusive_minimum = 0.0, maximum = 2.0)]
    pub repetition_penalty: Option<f64>,
    /// Token ids (as strings) to a bias in [-100, 100] added to their logits.
    #[schema(value_type = Option<HashMap<String, f64>>)]
    pub logit_bias: Option<Value>,
    /// End-of-generation and `stop_token_ids` tokens are held back until this many tokens
    /// were generated (vLLM's).
    #[schema(minimum = 0)]
    pub min_tokens: Option<u64>,
    /// Tokens that end the generation like the end-of-generation token (vLLM's).
    pub stop_token_ids: Option<Vec<u32>>,
    /// `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema",
    /// "json_schema": {"name", "schema", "strict"}}`: the output is constrained to it at
    /// every token (llguidance), the first one included.
    #[schema(value_type = Option<Object>)]
    pub response_format: Option<Value>,
    /// vLLM's: the output is JSON valid under this JSON Schema (an object or its text).
    #[schema(value_type = Option<Object>)]
    pub guided_json: Option<Value>,
    /// vLLM's: the output matches this regular expression.
    pub guided_regex: Option<String>,
    /// vLLM's: the output is exactly one of these strings.
    pub guided_choice: Option<Vec<String>>,
    /// vLLM's: the output follows this Lark grammar (llguidance's dialect).
    pub guided_grammar: Option<String>,
    /// vLLM's: `auto`, `llguidance` or `guidance` (all llguidance here).
    pub guided_decoding_backend: Option<String>,
    /// vLLM's newer form: one of `json`, `regex`, `choice`, `grammar` or `json_object`.
    #[schema(value_type = Option<Object>)]
    pub structured_outputs: Option<Value>,
    /// Only `["text"]`.
    pub modalities: Option<Vec<String>>,
    /// Only false: completions are not stored.
    pub store: Option<bool>,
    /// Only `auto` or `default`.
    pub service_tier: Option<String>,
    /// An end-user id, for the logs.
    #[schema(max_length = 256)]
    pub user: Option<String>,
    /// Up to 16 string pairs, for the logs.
    #[schema(value_type = Option<HashMap<String, String>>)]
    pub metadata: Option<Value>,
    /// Answer with server-sent events (`text/event-stream`), one chunk object per `data:`
    /// line, ending with `data: [DONE]`.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Up to 4 strings; generation ends before the first one, which is not returned.
    pub stop: Option<StopParam>,
    /// Keep generating past the end-of-generation token until `max_tokens` (not OpenAI's:
    /// llama.cpp's and vLLM's, for fixed-length benchmarks).
    pub ignore_eos: Option<bool>,
    /// Leave special tokens such as `<|im_start|>` out of the text (default true; vLLM's).
    pub skip_special_tokens: Option<bool>,
    /// Splits your prefix cache further (vLLM's): requests share cached prompt pages only
    /// with requests of the same tenant (API key) and the same salt.
    #[schema(max_length = 256)]
    pub cache_salt: Option<String>,
}

/// `stream_options` of a completion request.
#[derive(Debug, Clone, ToSchema)]
pub struct StreamOptions {
    /// Send one more chunk before `[DONE]`, with no choices and the request's `usage`; every
    /// other chunk then carries `usage: null`.
    pub include_usage: Option<bool>,
}

/// One or several stop strings.
#[derive(Debug, Clone)]
pub enum StopParam {
    /// One stop string.
    One(String),
    /// Up to [`MAX_STOP`] stop strings.
    Many(Vec<String>),
}

impl PartialSchema for StopParam {
    fn schema() -> RefOr<Schema> {
        string_or_array(
            ObjectBuilder::new().description(Some("One stop string.")),
            ArrayBuilder::new().max_items(Some(MAX_STOP)).description(Some("Up to 4 stop strings.")),
        )
    }
}

impl ToSchema for StopParam {}

/// The prompt of a text completion: a string, token ids, or a batch of either.
#[derive(Debug, Clone)]
pub enum PromptParam {
    /// The prompt.
    Text(String),
    /// A batch of prompts: one choice (or `n`) each.
    Batch(Vec<String>),
    /// Token ids.
    Tokens(Vec<u32>),
    /// A batch of token-id prompts.
    TokenBatch(Vec<Vec<u32>>),
}

impl PartialSchema for PromptParam {
    fn schema() -> RefOr<Schema> {
        let text = || ObjectBuilder::new().schema_type(Type::String).min_length(Some(1));
        let ids = || ArrayBuilder::new().min_items(Some(1)).items(ObjectBuilder::new().schema_type(Type::Integer).minimum(Some(0)));
        OneOfBuilder::new()
            .item(text().description(Some("The prompt (not empty).")))
            .item(
                ArrayBuilder::new()
                    .min_items(Some(1))
                    .max_items(Some(MAX_GENERATIONS))
                    .items(text())
                    .description(Some("A batch of prompts.")),
            )
            .item(ids().description(Some("Token ids.")))
            .item(
                ArrayBuilder::new()
                    .min_items(Some(1))
                    .max_items(Some(MAX_GENERATIONS))
                    .items(ids())
                    .description(Some("A batch of token-id prompts.")),
            )
            .into()
    }
}

impl ToSchema for PromptParam {}

/// `oneOf` a string (`one`, with its bounds) and an array of such strings (`many`, with its
/// bounds). utoipa's derive cannot bound the array of an enum variant, hence the two
/// hand-written schemas above.
fn string_or_array(one: ObjectBuilder, many: ArrayBuilder) -> RefOr<Schema> {
    let one = one.schema_type(Type::String).build();
    let mut item = one.clone();
    item.description = None;
    OneOfBuilder::new().item(one).item(many.items(item)).into()
}

/// One message of a chat request.
#[derive(Debug, Clone, ToSchema)]
pub struct ChatMessageParam {
    /// Who wrote it.
    pub role: Role,
    /// Its text, or text parts (joined with newlines). An `assistant` message may omit it.
    pub content: MessageContent,
    /// An assistant message's tool calls (`id`, `type`, `function` with `name` and
    /// `arguments`).
    #[schema(value_type = Option<Vec<Object>>)]
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
    /// A participant's or function's name.
    pub name: Option<String>,
}

/// The author of a chat message.
#[derive(Debug, Clone, Copy, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions.
    System,
    /// Instructions (OpenAI's newer name for `system`; treated the same).
    Developer,
    /// The user.
    User,
    /// The model.
    Assistant,
    /// A tool's result.
    Tool,
}

/// The content of a chat message.
#[derive(Debug, Clone, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Text parts (only `text` parts are supported).
    Parts(Vec<ContentPart>),
}

/// One part of a message's content.
#[derive(Debug, Clone, ToSchema)]
pub struct ContentPart {
    /// Always `text`.
    #[serde(rename = "type")]
    pub kind: ContentPartType,
    /// The text.
    pub text: String,
}

/// The type of a [`ContentPart`]; only `text` is supported.
#[derive(Debug, Clone, Copy, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ContentPartType {
    /// A text part.
    Text,
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
        parse_completion(&body)
    }

    fn refused(extra: Value) -> Option<String> {
        text(extra).err().and_then(|e| e.param)
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
            let e = parse_completion(&json!({"model": "m", "prompt": prompt})).expect_err("empty");
            assert_eq!(e.param.as_deref(), Some(param));
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn token_id_and_batch_prompts_parse_and_special_tokens_are_skipped_unless_asked() {
        let prompts = |prompt: Value| parse_completion(&json!({"model": "m", "prompt": prompt})).map(|p| p.prompts);
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
            parse_chat(&body).err().and_then(|e| e.param)
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
            parse_chat(&body)
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
