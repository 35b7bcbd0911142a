//! The request bodies of the completion endpoints, as the OpenAPI document describes them and
//! as they are read: the types derive both `ToSchema` and `Deserialize`, each field with its
//! rule from `de` (a wrong type or a value out of range is refused naming its `param`).
//! Fields a type does not name land in its `extra` and are refused by name (unsupported or
//! unknown) where a body is parsed; object-valued fields the document leaves free-form
//! (`tools`, `response_format`, ...) are kept as JSON and checked by their own modules.

use bulkhead_tokenizer::ChatMessage;
use serde::{Deserialize, Deserializer};
use serde_json::{Map, Value};
use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema, Type};
use utoipa::{PartialSchema, ToSchema};

use super::de::{self, Fault};
use super::{MAX_GENERATIONS, MAX_STOP};
use crate::backend::Prompt;

/// The body of `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatCompletionRequest {
    /// The model to use (see `GET /v1/models`).
    #[schema(value_type = String, required = true)]
    #[serde(default, deserialize_with = "de::string")]
    pub model: Option<String>,
    /// The conversation so far; the model's chat template is applied to it.
    #[schema(value_type = Vec<ChatMessageParam>, required = true, min_items = 1)]
    #[serde(default, deserialize_with = "messages")]
    pub messages: Option<Vec<ChatMessageParam>>,
    /// Functions the model may call (`{"type": "function", "function": {name, description,
    /// parameters}}`). They reach the chat template's `tools`, or a default tool preamble in
    /// the system message where the template has none.
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Value>,
    /// `none` (tools left out), `auto` (the default), `required`, or
    /// `{"type": "function", "function": {"name": ...}}`; the last two are enforced by a
    /// grammar, so the call always parses against the function's schema.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// Whether several calls may come in one reply (default true).
    #[schema(value_type = Option<bool>)]
    pub parallel_tool_calls: Option<Value>,
    /// Return each generated token's log-probability.
    #[serde(default, deserialize_with = "de::boolean")]
    pub logprobs: Option<bool>,
    /// With `logprobs`: this many most likely alternatives per token.
    #[schema(minimum = 0, maximum = 20)]
    #[serde(default, deserialize_with = "de::top_logprobs")]
    pub top_logprobs: Option<u32>,
    /// Settings shared with text completions.
    // Also read on their own first (`openai::read_body`): flatten loses an error's path.
    #[serde(flatten)]
    pub options: CompletionOptions,
    /// Fields this type does not name, refused by name where the body is parsed
    /// (`openai::refuse_extra`): serde's `deny_unknown_fields` does not work beside `flatten`.
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// The body of `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    /// The model to use (see `GET /v1/models`).
    #[schema(value_type = String, required = true)]
    #[serde(default, deserialize_with = "de::string")]
    pub model: Option<String>,
    /// The text to continue, tokenised as is: a string, token ids, or a batch of either.
    #[schema(value_type = PromptParam, required = true)]
    #[serde(default, deserialize_with = "prompt")]
    pub prompt: Option<PromptParam>,
    /// Return each generated token's log-probability and this many most likely
    /// alternatives.
    #[schema(minimum = 0, maximum = 5)]
    #[serde(default, deserialize_with = "de::text_logprobs")]
    pub logprobs: Option<u32>,
    /// Start each choice's text with the prompt's (not with `logprobs`).
    #[serde(default, deserialize_with = "de::boolean")]
    pub echo: Option<bool>,
    /// Generate this many per prompt and return the `n` most likely (by the sum of their
    /// tokens' log-probabilities); not with `stream`.
    #[schema(minimum = 1, maximum = 16)]
    #[serde(default, deserialize_with = "de::choices")]
    pub best_of: Option<u32>,
    /// Settings shared with chat completions.
    // Also read on their own first (`openai::read_body`): flatten loses an error's path.
    #[serde(flatten)]
    pub options: CompletionOptions,
    /// Fields this type does not name, refused by name where the body is parsed
    /// (`openai::refuse_extra`): serde's `deny_unknown_fields` does not work beside `flatten`.
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// Generation settings both completion endpoints take; `null` means not given.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct CompletionOptions {
    /// Most tokens to generate (default: what the context leaves after the prompt). A value
    /// larger than the model's context is refused with `context_length_exceeded`.
    #[schema(value_type = Option<u64>, minimum = 1)]
    // Read only where `max_completion_tokens` is absent (`openai::common`): a body with both
    // was never refused for its `max_tokens`.
    pub max_tokens: Option<Value>,
    /// Takes precedence over `max_tokens`.
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "de::positive")]
    pub max_completion_tokens: Option<u64>,
    /// Sampling temperature; 0 is greedy.
    #[schema(minimum = 0.0, maximum = 2.0)]
    #[serde(default, deserialize_with = "de::temperature")]
    pub temperature: Option<f64>,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches `top_p`.
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    #[serde(default, deserialize_with = "de::top_p")]
    pub top_p: Option<f64>,
    /// Keep only the `top_k` most likely tokens; 0 or -1 means no limit (not OpenAI's: vLLM's).
    #[schema(value_type = Option<i64>, minimum = -1)]
    #[serde(default, deserialize_with = "de::top_k")]
    pub top_k: Option<u32>,
    /// Same seed, same parameters, same prompt: same output, also with `temperature > 0`.
    #[schema(minimum = 0)]
    #[serde(default, deserialize_with = "de::seed")]
    pub seed: Option<u64>,
    /// Choices per prompt, each sampled independently (a seed gives each its own
    /// derived seed).
    #[schema(minimum = 1, maximum = 16)]
    #[serde(default, deserialize_with = "de::choices")]
    pub n: Option<u32>,
    /// vLLM's `priority`: lower values are served first within the request's own tenant's
    /// queue (a tenant cannot outrank another). Default 0.
    #[serde(default, deserialize_with = "de::priority")]
    pub priority: Option<i64>,
    /// Keep only tokens at least this fraction as likely as the most likely one (vLLM's).
    #[schema(minimum = 0.0, maximum = 1.0)]
    #[serde(default, deserialize_with = "de::unit")]
    pub min_p: Option<f64>,
    /// Lowers the logit of every token already generated, once.
    #[schema(minimum = -2.0, maximum = 2.0)]
    #[serde(default, deserialize_with = "de::penalty")]
    pub presence_penalty: Option<f64>,
    /// Lowers the logit of every token already generated, per occurrence.
    #[schema(minimum = -2.0, maximum = 2.0)]
    #[serde(default, deserialize_with = "de::penalty")]
    pub frequency_penalty: Option<f64>,
    /// Divides the positive logits (multiplies the negative ones) of tokens in the prompt
    /// or generated so far (vLLM's); 1 is off.
    #[schema(exclusive_minimum = 0.0, maximum = 2.0)]
    #[serde(default, deserialize_with = "de::repetition_penalty")]
    pub repetition_penalty: Option<f64>,
    /// Token ids (as strings) to a bias in [-100, 100] added to their logits.
    #[schema(value_type = Option<HashMap<String, f64>>)]
    #[serde(default, deserialize_with = "de::logit_bias")]
    pub logit_bias: Option<Vec<(u32, f32)>>,
    /// End-of-generation and `stop_token_ids` tokens are held back until this many tokens
    /// were generated (vLLM's).
    #[schema(value_type = Option<u64>, minimum = 0)]
    #[serde(default, deserialize_with = "de::min_tokens")]
    pub min_tokens: Option<u32>,
    /// Tokens that end the generation like the end-of-generation token (vLLM's).
    #[serde(default, deserialize_with = "de::stop_token_ids")]
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
    #[schema(value_type = Option<String>)]
    pub guided_regex: Option<Value>,
    /// vLLM's: the output is exactly one of these strings.
    #[schema(value_type = Option<Vec<String>>)]
    pub guided_choice: Option<Value>,
    /// vLLM's: the output follows this Lark grammar (llguidance's dialect).
    #[schema(value_type = Option<String>)]
    pub guided_grammar: Option<Value>,
    /// vLLM's: `auto`, `llguidance` or `guidance` (all llguidance here).
    #[schema(value_type = Option<String>)]
    pub guided_decoding_backend: Option<Value>,
    /// vLLM's newer form: one of `json`, `regex`, `choice`, `grammar` or `json_object`.
    #[schema(value_type = Option<Object>)]
    pub structured_outputs: Option<Value>,
    /// Only `["text"]`.
    #[serde(default, deserialize_with = "de::modalities")]
    pub modalities: Option<Vec<String>>,
    /// Only false: completions are not stored.
    #[serde(default, deserialize_with = "de::store")]
    pub store: Option<bool>,
    /// Only `auto` or `default`.
    #[serde(default, deserialize_with = "de::service_tier")]
    pub service_tier: Option<String>,
    /// An end-user id, for the logs.
    #[schema(max_length = 256)]
    #[serde(default, deserialize_with = "de::string")]
    pub user: Option<String>,
    /// Up to 16 string pairs, for the logs.
    #[schema(value_type = Option<HashMap<String, String>>)]
    #[serde(default, deserialize_with = "de::metadata")]
    pub metadata: Option<Value>,
    /// Answer with server-sent events (`text/event-stream`), one chunk object per `data:`
    /// line, ending with `data: [DONE]`.
    #[serde(default, deserialize_with = "de::boolean")]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default, deserialize_with = "stream_options")]
    pub stream_options: Option<StreamOptions>,
    /// Up to 4 strings; generation ends before the first one, which is not returned.
    #[serde(default, deserialize_with = "stop")]
    pub stop: Option<StopParam>,
    /// Keep generating past the end-of-generation token until `max_tokens` (not OpenAI's:
    /// llama.cpp's and vLLM's, for fixed-length benchmarks).
    #[serde(default, deserialize_with = "de::boolean")]
    pub ignore_eos: Option<bool>,
    /// Leave special tokens such as `<|im_start|>` out of the text (default true; vLLM's).
    #[serde(default, deserialize_with = "de::boolean")]
    pub skip_special_tokens: Option<bool>,
    /// Splits your prefix cache further (vLLM's): requests share cached prompt pages only
    /// with requests of the same tenant (API key) and the same salt.
    #[schema(max_length = 256)]
    #[serde(default, deserialize_with = "de::cache_salt")]
    pub cache_salt: Option<String>,
}

/// `stream_options` of a completion request.
#[derive(Debug, Clone, Default, ToSchema)]
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

impl StopParam {
    /// The stop strings, empty ones dropped: an empty stop string would end every
    /// generation at once; it is no stop at all.
    pub fn into_strings(self) -> Vec<String> {
        let all = match self {
            StopParam::One(s) => vec![s],
            StopParam::Many(v) => v,
        };
        all.into_iter().filter(|s| !s.is_empty()).collect()
    }
}

/// The prompt of a text completion: a string, token ids, or a batch of either (a batch may
/// mix the two), read as one prompt each.
#[derive(Debug, Clone)]
pub struct PromptParam(pub Vec<Prompt>);

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

/// A chat message's fields that the official clients send back when a response's message is
/// appended to the conversation: accepted only empty (`null` or `[]`).
const ECHOED: &[&str] = &["refusal", "annotations", "audio", "function_call"];

/// One message of a chat request.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatMessageParam {
    /// Who wrote it.
    #[schema(value_type = Role, required = true)]
    pub role: Option<Role>,
    /// Its text, or text parts (joined with newlines). An `assistant` message may omit it.
    #[schema(value_type = MessageContent, required = true)]
    pub content: Option<MessageContent>,
    /// An assistant message's tool calls (`id`, `type`, `function` with `name` and
    /// `arguments`).
    #[schema(value_type = Option<Vec<Object>>)]
    #[serde(default, deserialize_with = "de::array")]
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message: the call it answers.
    #[serde(default, deserialize_with = "de::string")]
    pub tool_call_id: Option<String>,
    /// A participant's or function's name.
    #[serde(default, deserialize_with = "de::string")]
    pub name: Option<String>,
    /// Fields this type does not name: [`ECHOED`] ones when empty, else refused.
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// `messages`: a non-empty array of messages, each checked.
pub(super) fn messages_of(v: &Value) -> Result<Vec<ChatMessageParam>, Fault> {
    let Value::Array(items) = v else { return Err(Fault::type_error("an array", v)) };
    if items.is_empty() {
        let says = "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead.";
        return Err(Fault::says(&[says]));
    }
    de::each(items, |m| match m {
        Value::Object(_) => de::nested::<ChatMessageParam>(m)?.checked(),
        m => Err(Fault::type_error("an object", m)),
    })
}

impl ChatMessageParam {
    /// What serde cannot say: the fields present by the role, refused extras, and the tool
    /// calls' shape (their `arguments` parsed into an object where they are one).
    fn checked(mut self) -> Result<Self, Fault> {
        Fault::unknown_key(&self.extra, |k| ECHOED.contains(&k))?;
        for (key, v) in &self.extra {
            if !(v.is_null() || v.as_array().is_some_and(Vec::is_empty)) {
                return Err(Fault::says(&["'", "' is not supported in a request."]).unsupported().within(&format!(".{key}")));
            }
        }
        let Some(role) = self.role else { return Err(Fault::missing().within(".role")) };
        // An assistant turn that only called tools has no content.
        if self.content.is_none() && !matches!(role, Role::Assistant) {
            return Err(Fault::missing().within(".content"));
        }
        if let Some(calls) = &self.tool_calls {
            if !matches!(role, Role::Assistant) {
                return Err(Fault::says(&["Only assistant messages carry tool_calls."]).within(".tool_calls"));
            }
            self.tool_calls = Some(de::each(calls, tool_call).map_err(|f| f.within(".tool_calls"))?);
        }
        if matches!(role, Role::Tool) && self.tool_call_id.is_none() {
            return Err(Fault::missing().within(".tool_call_id"));
        }
        Ok(self)
    }

    /// The message the chat template reads (`developer` is `system`).
    pub(super) fn into_message(self) -> ChatMessage {
        let role = match self.role {
            Some(Role::System | Role::Developer) => "system",
            Some(Role::User) => "user",
            Some(Role::Assistant) | None => "assistant",
            Some(Role::Tool) => "tool",
        };
        let content = match self.content {
            None => String::new(),
            Some(MessageContent::Text(s)) => s,
            Some(MessageContent::Parts(parts)) => parts.into_iter().filter_map(|p| p.text).collect::<Vec<_>>().join("\n"),
        };
        let mut msg = ChatMessage::new(role, content);
        msg.tool_calls = self.tool_calls.map(Value::Array);
        msg.tool_call_id = self.tool_call_id;
        msg.name = self.name;
        msg
    }
}

/// An assistant message's tool call, checked: an `id` and a `function` with a `name` and
/// `arguments` (a JSON text, parsed into an object for the template where it is one, as
/// Hugging Face templates expect).
fn tool_call(c: &Value) -> Result<Value, Fault> {
    let bad = |what: &str| Fault::says(&["Invalid '", &format!("': {what}.")]);
    let f = c.get("function").and_then(Value::as_object).ok_or_else(|| bad("'function' must be an object"))?;
    let name = f.get("name").and_then(Value::as_str).ok_or_else(|| bad("'function.name' must be a string"))?;
    let arguments = match f.get("arguments") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).unwrap_or_else(|_| Value::String(s.clone())),
        Some(v) => v.clone(),
    };
    let id = c.get("id").and_then(Value::as_str).unwrap_or_default();
    Ok(serde_json::json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}))
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

impl<'de> Deserialize<'de> for Role {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        de::read(d, |v| match v.as_str() {
            Some("system") => Ok(Role::System),
            Some("developer") => Ok(Role::Developer),
            Some("user") => Ok(Role::User),
            Some("assistant") => Ok(Role::Assistant),
            Some("tool") => Ok(Role::Tool),
            Some(other) => Err(Fault::says(&[&format!(
                "Invalid value: '{other}'. Supported values are: 'system', 'developer', 'user', 'assistant' and 'tool'."
            )])),
            None => Err(Fault::type_error("a string", v)),
        })
    }
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

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        de::read(d, |v| match v {
            Value::String(s) => Ok(MessageContent::Text(s.clone())),
            Value::Array(parts) => de::each(parts, |p| match p {
                Value::Object(_) => de::nested::<ContentPart>(p)?.checked(),
                p => Err(Fault::type_error("an object", p)),
            })
            .map(MessageContent::Parts),
            v => Err(Fault::type_error("a string or an array of content parts", v)),
        })
    }
}

/// One part of a message's content.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ContentPart {
    /// Always `text`.
    #[serde(rename = "type")]
    #[schema(value_type = ContentPartType, required = true)]
    pub kind: Option<ContentPartType>,
    /// The text.
    #[schema(value_type = String, required = true)]
    #[serde(default, deserialize_with = "de::string")]
    pub text: Option<String>,
    /// Fields this type does not name, refused.
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

impl ContentPart {
    fn checked(self) -> Result<Self, Fault> {
        if self.kind.is_none() {
            return Err(Fault::missing().within(".type"));
        }
        Fault::unknown_key(&self.extra, |_| false)?;
        if self.text.is_none() {
            return Err(Fault::missing().within(".text"));
        }
        Ok(self)
    }
}

/// The type of a [`ContentPart`]; only `text` is supported.
#[derive(Debug, Clone, Copy, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ContentPartType {
    /// A text part.
    Text,
}

impl<'de> Deserialize<'de> for ContentPartType {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        de::read(d, |v| match v.as_str() {
            Some("text") => Ok(ContentPartType::Text),
            Some(t) => Err(Fault::says(&[&format!("Unsupported content part type '{t}': only 'text' is supported.")])),
            None => Err(Fault::type_error("a string", v)),
        })
    }
}

// Deserializers of the fields whose types are defined here (the generic ones are in `de`).

/// `{"include_usage": bool}`.
pub(super) fn stream_options<'de, D: Deserializer<'de>>(d: D) -> Result<Option<StreamOptions>, D::Error> {
    de::optional(d, |v| {
        let Value::Object(o) = v else { return Err(Fault::type_error("an object", v)) };
        Fault::unknown_key(o, |k| k == "include_usage")?;
        let include_usage = match o.get("include_usage") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(v) => return Err(Fault::type_error("a boolean", v).within(".include_usage")),
        };
        Ok(StreamOptions { include_usage })
    })
}

/// One stop string or up to [`MAX_STOP`].
pub(super) fn stop<'de, D: Deserializer<'de>>(d: D) -> Result<Option<StopParam>, D::Error> {
    de::optional(d, |v| match v {
        Value::String(s) => Ok(StopParam::One(s.clone())),
        Value::Array(items) if items.len() > MAX_STOP => Err(Fault::says(&[&format!(
            "Invalid 'stop': array too long. Expected at most {MAX_STOP} stop sequences, but got {}.",
            items.len()
        )])),
        Value::Array(items) => {
            de::each(items, |s| s.as_str().map(str::to_owned).ok_or_else(|| Fault::type_error("a string", s))).map(StopParam::Many)
        }
        v => Err(Fault::type_error("a string or an array of strings", v)),
    })
}

/// A text completion's prompt or prompts.
pub(super) fn prompt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PromptParam>, D::Error> {
    de::optional(d, prompt_of)
}

/// A chat's messages.
pub(super) fn messages<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<ChatMessageParam>>, D::Error> {
    de::optional(d, messages_of)
}

fn prompt_of(v: &Value) -> Result<PromptParam, Fault> {
    let prompts = match v {
        Value::String(s) => vec![text_prompt(s)?],
        Value::Array(items) if items.is_empty() => return Err(Fault::says(&["Invalid 'prompt': empty array."])),
        Value::Array(items) if items.iter().all(Value::is_number) => vec![token_prompt(items)?],
        Value::Array(items) => de::each(items, |item| match item {
            Value::String(s) => text_prompt(s),
            Value::Array(ids) => token_prompt(ids),
            v => Err(Fault::type_error("a string or an array of token ids", v)),
        })?,
        v => {
            let expected = "a string, an array of strings, an array of token ids or an array of such arrays";
            return Err(Fault::type_error(expected, v));
        }
    };
    Ok(PromptParam(prompts))
}

/// A text prompt; empty is refused (nothing to continue from; vLLM refuses it too).
fn text_prompt(s: &str) -> Result<Prompt, Fault> {
    if s.is_empty() {
        return Err(Fault::says(&["Invalid '", "': it is empty. Send at least one character."]));
    }
    Ok(Prompt::Text(s.to_owned()))
}

/// A token-id prompt (checked against the vocabulary by the backend).
fn token_prompt(ids: &[Value]) -> Result<Prompt, Fault> {
    if ids.is_empty() {
        return Err(Fault::says(&["Invalid '", "': empty array of token ids."]));
    }
    de::each(ids, de::token_id).map(Prompt::Tokens)
}
