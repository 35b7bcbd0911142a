//! The model's chat template (`tokenizer.chat_template`, a Hugging Face Jinja template),
//! rendered with minijinja under Hugging Face's conventions: `trim_blocks` and `lstrip_blocks`
//! on, loop controls, Python string/dict/list methods (`.strip()`, `.items()`, ...) through
//! minijinja-contrib's pycompat, and the variables `messages`, `add_generation_prompt`,
//! `bos_token`, `eos_token` plus the function `raise_exception(message)`.

use bulkhead_gguf::{GgufFile, Value as GgufValue};
use minijinja::{Environment, ErrorKind, context};
use serde::{Deserialize, Serialize};

use crate::TokenizerError;
use crate::error::{optional, required};

const KEY_TEMPLATE: &str = "tokenizer.chat_template";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const TEMPLATE_NAME: &str = "chat_template";

/// One chat message, as in an OpenAI-style request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message text.
    pub content: String,
    /// An assistant turn's tool calls, as OpenAI sends them (`id`, `type`, `function` with
    /// `name` and `arguments`; the arguments parsed into an object where they are JSON,
    /// which is what templates that loop over `tool_calls` expect).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool result's call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool result's function name, or a participant's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into(), tool_calls: None, tool_call_id: None, name: None }
    }
}

/// The error `raise_exception` attaches, so that rendering can tell it from other failures.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Raised(String);

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Read and compile `tokenizer.chat_template`. `bos_token` and `eos_token` are the texts of
    /// the tokens `tokenizer.ggml.bos_token_id` / `eos_token_id` name (empty when absent).
    pub fn from_gguf(gguf: &GgufFile) -> Result<ChatTemplate, TokenizerError> {
        let source = required(KEY_TEMPLATE, gguf.get_str(KEY_TEMPLATE))?;
        Self::with_tokens_of(gguf, source)
    }

    /// The file's template, or `None` when it has none (a base model).
    pub fn from_gguf_if_any(gguf: &GgufFile) -> Result<Option<ChatTemplate>, TokenizerError> {
        match optional(KEY_TEMPLATE, gguf.get_str(KEY_TEMPLATE))? {
            Some(source) => Self::with_tokens_of(gguf, source).map(Some),
            None => Ok(None),
        }
    }

    /// Compile `source` with the BOS and EOS texts of `gguf`'s vocabulary (`--chat-template`
    /// gives a template for a model that has none, or another one).
    pub fn with_tokens_of(gguf: &GgufFile, source: impl Into<String>) -> Result<ChatTemplate, TokenizerError> {
        let token_text = |key: &'static str| -> Result<String, TokenizerError> {
            let Some(id) = optional(key, gguf.get_u64(key))? else {
                return Ok(String::new());
            };
            let tokens = required(KEY_TOKENS, gguf.get_array(KEY_TOKENS))?;
            match usize::try_from(id).ok().and_then(|i| tokens.get(i)) {
                Some(GgufValue::String(s)) => Ok(s.clone()),
                _ => Err(TokenizerError::InvalidValue { key, why: format!("token id {id} is not a string entry of `{KEY_TOKENS}`") }),
            }
        };
        let (bos, eos) = (token_text(KEY_BOS)?, token_text(KEY_EOS)?);
        ChatTemplate::new(source, bos, eos)
    }

    /// Compile a template given as source text.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<ChatTemplate, TokenizerError> {
        let source = source.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<minijinja::Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
        });
        env.add_template_owned(TEMPLATE_NAME, source.clone()).map_err(TokenizerError::TemplateSyntax)?;
        Ok(ChatTemplate { env, source, bos_token: bos_token.into(), eos_token: eos_token.into() })
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Render the prompt for `messages`; with `add_generation_prompt` the template appends the
    /// opening of the assistant's turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TokenizerError> {
        self.render_with_tools(messages, add_generation_prompt, &[])
    }

    /// [`ChatTemplate::render`] with the request's tools (OpenAI's `tools` entries) in the
    /// template's `tools` variable (left undefined when there are none, as Hugging Face's
    /// renderer does).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: &[serde_json::Value],
    ) -> Result<String, TokenizerError> {
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(TokenizerError::TemplateRender)?;
        let tools = (!tools.is_empty()).then_some(tools);
        let ctx = context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            tools => tools,
        };
        tmpl.render(ctx).map_err(|e| match raised_message(&e) {
            Some(message) => TokenizerError::TemplateRaised { message },
            None => TokenizerError::TemplateRender(e),
        })
    }

    /// Whether the template reads the `tools` variable (else a caller must put the tools
    /// into the prompt itself).
    pub fn uses_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// Whether the template renders assistant `tool_calls` and `tool` messages itself.
    pub fn uses_tool_calls(&self) -> bool {
        self.source.contains("tool_calls")
    }
}

/// The message of a `raise_exception` call somewhere in `e`'s source chain.
fn raised_message(e: &minijinja::Error) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<Raised>() {
            return Some(r.0.clone());
        }
        cur = err.source();
    }
    None
}
