//! The OpenAI wire format: request bodies checked field by field (so a wrong type names its
//! `param`, and unknown fields are ignored as OpenAI clients send extras) and the response
//! and stream-chunk objects.

use bulkhead_protocol::Sampling;
use bulkhead_tokenizer::ChatMessage;
use serde::Serialize;
use serde_json::{Map, Number, Value};
use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema, Type};
use utoipa::{PartialSchema, ToSchema};

use crate::backend::{FinishReason, ModelCard, Prompt};
use crate::error::ApiError;

/// Most stop strings a request may give (OpenAI's limit).
pub const MAX_STOP: usize = 4;
/// Longest accepted `cache_salt`, in bytes.
pub const MAX_CACHE_SALT: usize = 256;
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
    pub sampling: Sampling,
    /// Stop strings (empty ones dropped).
    pub stop: Vec<String>,
    /// Whether to answer with server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`: send a usage chunk before `[DONE]`.
    pub include_usage: bool,
    /// `cache_salt` (vLLM's): splits the tenant's prefix cache further.
    pub cache_salt: Option<String>,
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
            items if items.iter().all(|v| v.is_number() || v.is_array()) => {
                return Err(ApiError::invalid_request(
                    "prompt",
                    "Invalid 'prompt': token-id prompts are not supported yet; send the prompt as a string (or an array of one string).",
                ));
            }
            [_] => {
                return Err(ApiError::invalid_request(
                    "prompt",
                    "Invalid 'prompt': only a string (or an array of one string) is supported.",
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
    // Nothing to continue from (vLLM refuses it too); the workers would refuse it later.
    if prompt.is_empty() {
        return Err(ApiError::invalid_request(
            "prompt",
            "Invalid 'prompt': it is empty. Send at least one character.",
        ));
    }
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
    let mut sampling = Sampling::default();
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
    let cache_salt = match field(obj, "cache_salt") {
        None => None,
        Some(Value::String(s)) if s.len() <= MAX_CACHE_SALT => Some(s.clone()),
        Some(Value::String(s)) => {
            return Err(ApiError::invalid_request("cache_salt", format!("cache_salt is {} bytes; the most is {MAX_CACHE_SALT}.", s.len())));
        }
        Some(v) => return Err(type_error("cache_salt", "a string", v)),
    };
    Ok(CompletionParams {
        model,
        prompt,
        max_tokens,
        sampling,
        stop,
        stream,
        include_usage,
        cache_salt,
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
    n.as_f64()
        .filter(|f| f.is_finite() && f.fract() == 0.0)
        .map(|f| f as i128)
}

/// A JSON integer (or whole decimal) `>= min`, or 400 naming `param`.
fn int(v: &Value, param: &str, min: u64) -> Result<u64, ApiError> {
    let Value::Number(n) = v else {
        return Err(type_error(param, "an integer", v));
    };
    match whole(n) {
        None => Err(type_error(param, "an integer", v)),
        Some(x) if x < i128::from(min) => Err(range_error(param, format!("a value >= {min}"), v)),
        Some(x) => {
            u64::try_from(x).map_err(|_| range_error(param, format!("a value <= {}", u64::MAX), v))
        }
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
        Some(x) => {
            Ok(u64::try_from(x).unwrap_or_else(|_| n.as_f64().map_or(u64::MAX, f64::to_bits)))
        }
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
    /// Settings shared with text completions.
    #[serde(flatten)]
    pub options: CompletionOptions,
}

/// The body of `POST /v1/completions`.
#[derive(Debug, Clone, ToSchema)]
pub struct CompletionRequest {
    /// The model to use (see `GET /v1/models`).
    pub model: String,
    /// The text to continue, tokenised as is.
    pub prompt: PromptParam,
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
    /// Number of choices; only 1 is supported.
    #[schema(minimum = 1, maximum = 1)]
    pub n: Option<u32>,
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
            ArrayBuilder::new()
                .max_items(Some(MAX_STOP))
                .description(Some("Up to 4 stop strings.")),
        )
    }
}

impl ToSchema for StopParam {}

/// The prompt of a text completion: a string, or an array holding one string.
#[derive(Debug, Clone)]
pub enum PromptParam {
    /// The prompt.
    Text(String),
    /// An array of exactly one prompt (token-id prompts are not supported).
    Batch(Vec<String>),
}

impl PartialSchema for PromptParam {
    fn schema() -> RefOr<Schema> {
        string_or_array(
            ObjectBuilder::new()
                .min_length(Some(1))
                .description(Some("The prompt (not empty).")),
            ArrayBuilder::new()
                .min_items(Some(1))
                .max_items(Some(1))
                .description(Some(
                    "An array of exactly one prompt (token-id prompts are not supported).",
                )),
        )
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

/// The schema of a field that is always `null` (`logprobs`: not supported).
fn null_schema() -> ObjectBuilder {
    ObjectBuilder::new().schema_type(Type::Null)
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
    /// The single choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
}

/// One choice of a [`ChatCompletion`].
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChoice {
    /// Always 0 (n = 1).
    pub index: u32,
    /// The reply.
    pub message: AssistantMessage,
    /// Always null (logprobs are not supported).
    #[schema(schema_with = null_schema, required = true)]
    pub logprobs: Option<()>,
    /// `stop` or `length`.
    #[schema(value_type = FinishReason)]
    pub finish_reason: &'static str,
}

/// The assistant's reply.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: &'static str,
    /// The generated text.
    pub content: String,
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
    /// The single choice.
    pub choices: Vec<TextChoice>,
    /// Token counts (absent in stream chunks unless `include_usage`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// One choice of a [`TextCompletion`] (also a stream chunk's choice).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextChoice {
    /// Always 0.
    pub index: u32,
    /// The generated text (a delta in stream chunks).
    pub text: String,
    /// Always null.
    #[schema(schema_with = null_schema, required = true)]
    pub logprobs: Option<()>,
    /// `stop` or `length`; null in stream chunks before the last.
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
    /// Always 0.
    pub index: u32,
    /// What changed.
    pub delta: Delta,
    /// Always null.
    #[schema(schema_with = null_schema, required = true)]
    pub logprobs: Option<()>,
    /// Null until the last content chunk.
    #[schema(value_type = Option<FinishReason>, required = true)]
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
        let p = text(json!({ "max_tokens": 4.0, "n": 1.0, "top_k": 3.0, "seed": 7.0 }))
            .expect("accepted");
        assert_eq!(p.max_tokens, Some(4));
        assert_eq!(p.sampling.top_k, 3);
        assert_eq!(p.sampling.seed, Some(7));
        assert_eq!(
            text(json!({ "top_k": -1.0 })).expect("off").sampling.top_k,
            0
        );
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
        assert_eq!(
            text(json!({ "seed": 1e30 })).expect("seed").sampling.seed,
            Some(1e30f64.to_bits())
        );
    }

    // Found by schemathesis: the decode worker refused it with its own wording, no `param`.
    #[test]
    fn an_empty_prompt_is_refused_naming_prompt() {
        for prompt in [json!(""), json!([""])] {
            let e = parse_completion(&json!({"model": "m", "prompt": prompt})).expect_err("empty");
            assert_eq!(e.param.as_deref(), Some("prompt"));
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn token_id_prompts_are_refused_saying_so_and_special_tokens_are_skipped_unless_asked() {
        for prompt in [json!([1, 2, 3]), json!([7]), json!([[1, 2], [3]])] {
            let e = parse_completion(&json!({"model": "m", "prompt": prompt})).expect_err("token ids");
            assert!(e.message.contains("token-id prompts are not supported"), "{prompt}: {}", e.message);
        }
        let e = parse_completion(&json!({"model": "m", "prompt": ["a", "b"]})).expect_err("two prompts");
        assert!(e.message.contains("only one prompt"), "{}", e.message);
        assert!(text(json!({})).expect("default").sampling.skip_special_tokens);
        assert!(!text(json!({ "skip_special_tokens": false })).expect("off").sampling.skip_special_tokens);
        assert_eq!(refused(json!({ "skip_special_tokens": 1 })).as_deref(), Some("skip_special_tokens"));
    }
}
