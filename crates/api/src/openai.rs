//! The OpenAI wire format: request bodies checked field by field (so a wrong type names its
//! `param`, and unknown fields are ignored as OpenAI clients send extras) and the response
//! and stream-chunk objects.

use bulkhead_engine::SamplingParams;
use bulkhead_tokenizer::ChatMessage;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::backend::{ModelCard, Prompt};
use crate::error::ApiError;

/// Most stop strings a request may give (OpenAI's limit).
pub const MAX_STOP: usize = 4;
/// Largest accepted `temperature` (OpenAI's range is `0..=2`).
pub const MAX_TEMPERATURE: f64 = 2.0;

/// A completion request (chat or text), checked and reduced to what generation needs.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionParams {
    /// The model asked for.
    pub model: String,
    /// Messages or text.
    pub prompt: Prompt,
    /// `max_completion_tokens`, else `max_tokens`; at least 1 when given.
    pub max_tokens: Option<usize>,
    /// temperature, top_p, top_k, seed.
    pub sampling: SamplingParams,
    /// Stop strings (empty ones dropped).
    pub stop: Vec<String>,
    /// Whether to answer with server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`: send a usage chunk before `[DONE]`.
    pub include_usage: bool,
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
}

/// Parse a `POST /v1/chat/completions` body.
pub fn parse_chat(body: &Value) -> Result<CompletionParams, ApiError> {
    let obj = as_object(body)?;
    let messages = parse_messages(obj)?;
    common(obj, Prompt::Chat(messages))
}

/// Parse a `POST /v1/completions` body.
pub fn parse_completion(body: &Value) -> Result<CompletionParams, ApiError> {
    let obj = as_object(body)?;
    let prompt = match field(obj, "prompt") {
        None => {
            return Err(ApiError::invalid_request(
                "prompt",
                "Missing required parameter: 'prompt'.",
            ));
        }
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] => s.clone(),
            [] => {
                return Err(ApiError::invalid_request(
                    "prompt",
                    "Invalid 'prompt': empty array.",
                ));
            }
            [_] => {
                return Err(ApiError::invalid_request(
                    "prompt",
                    "Invalid 'prompt': only a string (or an array of one string) is supported, not token ids.",
                ));
            }
            _ => {
                return Err(ApiError::invalid_request(
                    "prompt",
                    "Invalid 'prompt': only one prompt per request is supported.",
                ));
            }
        },
        Some(v) => {
            return Err(type_error(
                "prompt",
                "a string or an array of one string",
                v,
            ));
        }
    };
    common(obj, Prompt::Text(prompt))
}

/// The fields chat and text completions share.
fn common(obj: &Map<String, Value>, prompt: Prompt) -> Result<CompletionParams, ApiError> {
    let model = match field(obj, "model") {
        None => {
            return Err(ApiError::invalid_request(
                "model",
                "Missing required parameter: 'model'.",
            ));
        }
        Some(Value::String(s)) => s.clone(),
        Some(v) => return Err(type_error("model", "a string", v)),
    };
    let max_tokens = match field(obj, "max_completion_tokens") {
        Some(v) => Some(positive_int(v, "max_completion_tokens")?),
        None => field(obj, "max_tokens")
            .map(|v| positive_int(v, "max_tokens"))
            .transpose()?,
    };
    let mut sampling = SamplingParams::default();
    if let Some(v) = field(obj, "temperature") {
        let t = number(v, "temperature")?;
        if !(0.0..=MAX_TEMPERATURE).contains(&t) {
            return Err(range_error(
                "temperature",
                format!("a value in [0, {MAX_TEMPERATURE}]"),
                v,
            ));
        }
        sampling.temperature = t as f32;
    }
    if let Some(v) = field(obj, "top_p") {
        let p = number(v, "top_p")?;
        // The f32 rounding must not turn a tiny positive top_p into 0.
        if !(p > 0.0 && p <= 1.0) || (p as f32) <= 0.0 {
            return Err(range_error("top_p", "a value in (0, 1]".into(), v));
        }
        sampling.top_p = p as f32;
    }
    if let Some(v) = field(obj, "top_k") {
        sampling.top_k = match v.as_i64() {
            Some(-1) => 0, // vLLM's "off"
            _ => usize::try_from(int(v, "top_k", 0)?).unwrap_or(usize::MAX),
        };
    }
    if let Some(v) = field(obj, "seed") {
        sampling.seed = Some(seed(v)?);
    }
    match field(obj, "n").map(|v| int(v, "n", 1)).transpose()? {
        None | Some(1) => {}
        Some(_) => return Err(ApiError::invalid_request("n", "Only n=1 is supported.")),
    }
    let stream = match field(obj, "stream") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(type_error("stream", "a boolean", v)),
    };
    let include_usage = match field(obj, "stream_options") {
        None => false,
        Some(Value::Object(o)) => match field(o, "include_usage") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(type_error("stream_options.include_usage", "a boolean", v)),
        },
        Some(v) => return Err(type_error("stream_options", "an object", v)),
    };
    let stop = parse_stop(obj)?;
    Ok(CompletionParams {
        model,
        prompt,
        max_tokens,
        sampling,
        stop,
        stream,
        include_usage,
    })
}

fn parse_messages(obj: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match field(obj, "messages") {
        None => {
            return Err(ApiError::invalid_request(
                "messages",
                "Missing required parameter: 'messages'.",
            ));
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
    items
        .iter()
        .enumerate()
        .map(|(i, m)| parse_message(i, m))
        .collect()
}

fn parse_message(i: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let p = |f: &str| format!("messages[{i}].{f}");
    let Value::Object(m) = m else {
        return Err(type_error(&format!("messages[{i}]"), "an object", m));
    };
    let role = match field(m, "role") {
        None => {
            return Err(ApiError::invalid_request(
                p("role"),
                format!("Missing required parameter: '{}'.", p("role")),
            ));
        }
        Some(Value::String(r)) => match r.as_str() {
            "system" | "user" | "assistant" | "tool" => r.clone(),
            "developer" => "system".to_string(),
            other => {
                return Err(ApiError::invalid_request(
                    p("role"),
                    format!(
                        "Invalid value: '{other}'. Supported values are: 'system', 'developer', 'user', 'assistant' and 'tool'."
                    ),
                ));
            }
        },
        Some(v) => return Err(type_error(&p("role"), "a string", v)),
    };
    let content = match field(m, "content") {
        // An assistant turn that only called tools has no content.
        None if role == "assistant" => String::new(),
        None => {
            return Err(ApiError::invalid_request(
                p("content"),
                format!("Missing required parameter: '{}'.", p("content")),
            ));
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
            return Err(type_error(
                &p("content"),
                "a string or an array of content parts",
                v,
            ));
        }
    };
    Ok(ChatMessage::new(role, content))
}

fn text_part<'a>(param: &str, part: &'a Value) -> Result<&'a str, ApiError> {
    let Value::Object(o) = part else {
        return Err(type_error(param, "an object", part));
    };
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
            return Err(ApiError::invalid_request(
                format!("{param}.type"),
                format!("Missing required parameter: '{param}.type'."),
            ));
        }
    }
    match field(o, "text") {
        Some(Value::String(s)) => Ok(s),
        Some(v) => Err(type_error(&format!("{param}.text"), "a string", v)),
        None => Err(ApiError::invalid_request(
            format!("{param}.text"),
            format!("Missing required parameter: '{param}.text'."),
        )),
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
                    format!(
                        "Invalid 'stop': array too long. Expected at most {MAX_STOP} stop sequences, but got {}.",
                        items.len()
                    ),
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
        v => Err(ApiError::bad_request(format!(
            "The request body must be a JSON object, but got {}.",
            type_name(v)
        ))),
    }
}

/// A field that is present and not `null` (clients send `null` for "not given").
fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

/// A JSON integer `>= min`, or 400 naming `param`.
fn int(v: &Value, param: &str, min: u64) -> Result<u64, ApiError> {
    match v {
        Value::Number(n) => match n.as_u64() {
            Some(x) if x >= min => Ok(x),
            _ if n.is_f64() => Err(type_error(param, "an integer", v)),
            _ => Err(range_error(param, format!("a value >= {min}"), v)),
        },
        _ => Err(type_error(param, "an integer", v)),
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

/// Any non-negative integer. Integers past `u64::MAX` (which JSON parsing turns into
/// floats) are folded into a `u64` deterministically, so the same seed still gives the
/// same output.
fn seed(v: &Value) -> Result<u64, ApiError> {
    let Value::Number(n) = v else {
        return Err(type_error("seed", "an integer", v));
    };
    if let Some(x) = n.as_u64() {
        return Ok(x);
    }
    if n.is_i64() {
        return Err(range_error("seed", "a value >= 0".into(), v));
    }
    match n.as_f64() {
        Some(x) if x.is_finite() && x >= 0.0 && x.fract() == 0.0 => Ok(x.to_bits()),
        Some(x) if x < 0.0 => Err(range_error("seed", "a value >= 0".into(), v)),
        _ => Err(type_error("seed", "an integer", v)),
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
    ApiError::invalid_request(
        param,
        format!(
            "Invalid type for '{param}': expected {expected}, but got {} instead.",
            type_name(got)
        ),
    )
}

fn range_error(param: &str, expected: String, got: &Value) -> ApiError {
    ApiError::invalid_request(
        param,
        format!("Invalid '{param}': expected {expected}, but got {got} instead."),
    )
}

/// Token counts of one completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Tokens in the prompt (after the chat template).
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

impl Usage {
    /// Usage from the two counts.
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
        }
    }
}

/// A `chat.completion` object.
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    /// `chatcmpl-...`.
    pub id: String,
    /// Always `chat.completion`.
    pub object: &'static str,
    /// Unix time (seconds).
    pub created: u64,
    /// The model that answered.
    pub model: String,
    /// The single choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
}

/// One choice of a [`ChatCompletion`].
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    /// Always 0 (n = 1).
    pub index: u32,
    /// The reply.
    pub message: AssistantMessage,
    /// Always null (logprobs are not supported).
    pub logprobs: Option<()>,
    /// `stop` or `length`.
    pub finish_reason: &'static str,
}

/// The assistant's reply.
#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: &'static str,
    /// The generated text.
    pub content: String,
}

/// A `text_completion` object.
#[derive(Debug, Clone, Serialize)]
pub struct TextCompletion {
    /// `cmpl-...`.
    pub id: String,
    /// Always `text_completion`.
    pub object: &'static str,
    /// Unix time (seconds).
    pub created: u64,
    /// The model that answered.
    pub model: String,
    /// The single choice.
    pub choices: Vec<TextChoice>,
    /// Token counts (absent in stream chunks unless `include_usage`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// One choice of a [`TextCompletion`] (also a stream chunk's choice).
#[derive(Debug, Clone, Serialize)]
pub struct TextChoice {
    /// Always 0.
    pub index: u32,
    /// The generated text (a delta in stream chunks).
    pub text: String,
    /// Always null.
    pub logprobs: Option<()>,
    /// `stop` or `length`; null in stream chunks before the last.
    pub finish_reason: Option<&'static str>,
}

/// A `chat.completion.chunk` object (one server-sent event of a chat stream).
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunk {
    /// Same id on every chunk of a stream.
    pub id: String,
    /// Always `chat.completion.chunk`.
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
#[derive(Debug, Clone, Serialize)]
pub struct ChunkChoice {
    /// Always 0.
    pub index: u32,
    /// What changed.
    pub delta: Delta,
    /// Always null.
    pub logprobs: Option<()>,
    /// Null until the last content chunk.
    pub finish_reason: Option<&'static str>,
}

/// The change one chat chunk carries; absent fields are omitted.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Delta {
    /// `assistant`, in the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// A model in `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelObject {
    /// The model's name.
    pub id: String,
    /// Always `model`.
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
        ModelObject {
            id: c.id,
            object: "model",
            created: c.created,
            owned_by: c.owned_by,
            max_model_len: c.max_model_len,
        }
    }
}

/// The `GET /v1/models` body.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    /// Always `list`.
    pub object: &'static str,
    /// The models.
    pub data: Vec<ModelObject>,
}
