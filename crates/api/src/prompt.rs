//! Chat template and tokenizer applied to an API prompt.

use std::sync::Arc;

use crate::{ApiError, Prompt};
use bulkhead_tokenizer::{ChatTemplate, Tokenizer, TokenizerError};

/// Turns an API prompt into token ids.
pub struct PromptEncoder {
    tokenizer: Arc<Tokenizer>,
    chat: ChatTemplate,
}

impl PromptEncoder {
    /// An encoder over the model's tokenizer and chat template.
    pub fn new(tokenizer: Arc<Tokenizer>, chat: ChatTemplate) -> Self {
        PromptEncoder { tokenizer, chat }
    }

    /// Template (for chat) and tokenise.
    pub fn encode(&self, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
        let text = match prompt {
            Prompt::Chat(messages) => self.chat.render(messages, true).map_err(|e| match e {
                TokenizerError::TemplateRaised { message } => ApiError::invalid_request("messages", message),
                e => ApiError::internal(format!("The chat template failed: {e}")),
            })?,
            Prompt::Text(t) => t.clone(),
        };
        let mut ids = self.tokenizer.encode(&text, true);
        if let Some(bos) = self.tokenizer.bos_id().filter(|_| self.tokenizer.add_bos())
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }
}
