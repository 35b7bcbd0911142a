//! Chat template and tokenizer applied to an API prompt, and the other services of the
//! model's vocabulary the API needs: decoding ids, naming tokens for log-probabilities and
//! compiling grammars before a request is queued.

use std::sync::{Arc, OnceLock};

use bulkhead_grammar::{GrammarError, Grammars};
use bulkhead_protocol::GrammarSpec;
use bulkhead_tokenizer::{ChatMessage, ChatTemplate, Tokenizer, TokenizerError};

use crate::tools::{self, Tools};
use crate::{ApiError, Prompt};

/// Turns an API prompt into token ids.
pub struct PromptEncoder {
    tokenizer: Arc<Tokenizer>,
    /// `None` for a base model: chat requests are refused.
    chat: Option<ChatTemplate>,
    grammars: OnceLock<Result<Grammars, GrammarError>>,
}

impl PromptEncoder {
    /// An encoder over the model's tokenizer and chat template (`None`: a base model).
    pub fn new(tokenizer: Arc<Tokenizer>, chat: Option<ChatTemplate>) -> Self {
        PromptEncoder { tokenizer, chat, grammars: OnceLock::new() }
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Template (for chat) and tokenise; token-id prompts are checked against the
    /// vocabulary.
    pub fn encode(&self, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
        self.encode_with(prompt, true)
    }

    /// [`PromptEncoder::encode`], adding the model's BOS (where its tokenizer asks for one)
    /// only when `add_special_tokens`; special tokens written in the text are parsed either way.
    pub fn encode_with(&self, prompt: &Prompt, add_special_tokens: bool) -> Result<Vec<u32>, ApiError> {
        let text = match prompt {
            Prompt::Chat { messages, tools } => self.render(messages, tools.as_ref())?,
            Prompt::Text(t) => t.clone(),
            Prompt::Tokens(ids) => {
                let vocab = self.tokenizer.vocab_size();
                if let Some((i, &id)) = ids.iter().enumerate().find(|(_, id)| **id as usize >= vocab) {
                    return Err(ApiError::invalid_request(
                        "prompt",
                        format!("Invalid 'prompt': token id {id} at position {i} is not in the vocabulary of {vocab} tokens."),
                    ));
                }
                return Ok(ids.clone());
            }
        };
        let mut ids = self.tokenizer.encode(&text, true);
        if let Some(bos) = self.tokenizer.bos_id().filter(|_| add_special_tokens && self.tokenizer.add_bos())
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    /// The chat prompt's text. Tools reach the template's `tools` variable, or, for a
    /// template that does not read it, the default preamble in the system message; calls and
    /// tool results are written in the call form for templates that do not render them.
    fn render(&self, messages: &[ChatMessage], tools: Option<&Tools>) -> Result<String, ApiError> {
        let Some(chat) = &self.chat else {
            return Err(ApiError::invalid_request(
                "messages",
                "This model has no chat template (it is a base model): send the text to /v1/completions, or start the server with --chat-template FILE.",
            )
            .with_code("no_chat_template"));
        };
        let shown = tools.map_or(&[][..], Tools::in_prompt);
        let mut messages = messages.to_vec();
        if !chat.uses_tool_calls() {
            for m in &mut messages {
                if let Some(calls) = m.tool_calls.take() {
                    let text = tools::render_calls(&calls);
                    m.content = if m.content.is_empty() { text } else { format!("{}\n{text}", m.content) };
                }
                if m.role == "tool" {
                    m.content = format!("<tool_response>\n{}\n</tool_response>", m.content);
                }
            }
        }
        let rendered = if !shown.is_empty() && !chat.uses_tools() {
            let preamble = tools.map(Tools::preamble).unwrap_or_default();
            match messages.first_mut() {
                Some(first) if first.role == "system" => first.content = format!("{}\n\n{preamble}", first.content),
                _ => messages.insert(0, ChatMessage::new("system", preamble)),
            }
            chat.render(&messages, true)
        } else {
            chat.render_with_tools(&messages, true, shown)
        };
        rendered.map_err(|e| match e {
            TokenizerError::TemplateRaised { message } => ApiError::invalid_request("messages", message),
            e => ApiError::internal(format!("The chat template failed: {e}")),
        })
    }

    /// The text of `ids` (`/detokenize`); ids outside the vocabulary are refused.
    pub fn decode(&self, ids: &[u32]) -> Result<String, ApiError> {
        let vocab = self.tokenizer.vocab_size();
        if let Some(&id) = ids.iter().find(|id| **id as usize >= vocab) {
            return Err(ApiError::invalid_request("tokens", format!("token id {id} is not in the vocabulary of {vocab} tokens.")));
        }
        Ok(self.tokenizer.decode(ids))
    }

    /// One token's text and bytes, as log-probabilities report it.
    pub fn token_piece(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self.tokenizer.token_bytes(id).unwrap_or(&[]).to_vec();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    /// Compile `spec` over the vocabulary, or say why it is not a grammar (a 400 for the
    /// field it came from).
    pub fn check_grammar(&self, spec: &GrammarSpec) -> Result<(), GrammarError> {
        self.grammars.get_or_init(|| Grammars::new(Arc::clone(&self.tokenizer))).as_ref().map_err(Clone::clone)?.check(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bos_is_added_only_with_special_tokens() {
        let (tokenizer, chat) = crate::testing::byte_level_vocabulary_adding_bos(true);
        let e = PromptEncoder::new(Arc::new(tokenizer), Some(chat));
        let hi = Prompt::Text("hi".into());
        assert_eq!(e.encode(&hi).unwrap(), vec![256, 104, 105]);
        assert_eq!(e.encode_with(&hi, false).unwrap(), vec![104, 105]);
    }
}
