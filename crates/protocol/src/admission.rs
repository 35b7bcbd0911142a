//! The admission decision (I3, I5): whether a request fits a context limit, made by one
//! function that the gateway, the prefill and decode roles, the engine and the colocated
//! API all call. Defence in depth stays: every one of them still checks, each against its
//! own limit; they only share the decision, so they cannot drift apart.

use crate::msg::RejectReason;

/// How many tokens a request may generate, as the checker sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Generate {
    /// Up to this many tokens, counted against the limit with the prompt.
    Tokens(usize),
    /// Generation is not this checker's to hold (a prefill worker computes the prompt
    /// only; the decode worker admits the generation).
    Elsewhere,
}

/// Why a request is refused before anything is reserved for it. Terminal (I3).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No prompt tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` of zero.
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    /// Prompt plus generation exceed the limit.
    #[error("{prompt} prompt + {max_tokens} max tokens = {needed} exceeds the context of {limit}")]
    ContextLength {
        /// Prompt tokens.
        prompt: usize,
        /// Tokens asked for.
        max_tokens: usize,
        /// Their sum (saturating).
        needed: usize,
        /// The limit.
        limit: usize,
    },
    /// The prompt alone exceeds the limit (a prefill worker's view).
    #[error("prompt of {prompt} tokens exceeds the limit of {limit}")]
    PromptTooLong {
        /// Prompt tokens.
        prompt: usize,
        /// The limit.
        limit: usize,
    },
}

impl Refusal {
    /// The protocol's reason for this refusal (what the client's status code follows).
    pub fn reason(&self) -> RejectReason {
        match self {
            Refusal::EmptyPrompt | Refusal::ZeroMaxTokens => RejectReason::Invalid,
            Refusal::ContextLength { .. } | Refusal::PromptTooLong { .. } => RejectReason::ContextLength,
        }
    }
}

/// Admit a request of `prompt` tokens generating `generate` against `limit` tokens of
/// context. Returns the tokens it needs (prompt + generation, or the prompt alone).
pub fn admit(prompt: usize, generate: Generate, limit: usize) -> Result<usize, Refusal> {
    if prompt == 0 {
        return Err(Refusal::EmptyPrompt);
    }
    match generate {
        Generate::Tokens(0) => Err(Refusal::ZeroMaxTokens),
        Generate::Tokens(max_tokens) => {
            let needed = prompt.saturating_add(max_tokens);
            if needed > limit {
                return Err(Refusal::ContextLength { prompt, max_tokens, needed, limit });
            }
            Ok(needed)
        }
        Generate::Elsewhere if prompt > limit => Err(Refusal::PromptTooLong { prompt, limit }),
        Generate::Elsewhere => Ok(prompt),
    }
}

/// `max_tokens` when a client sends none (the official OpenAI client does not): whatever
/// context the prompt leaves, and at least one, so that a prompt filling the context is
/// refused by [`admit`] rather than asked to generate nothing.
pub fn default_max_tokens(prompt: usize, limit: usize) -> usize {
    limit.saturating_sub(prompt).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_that_exactly_fills_the_context_is_admitted_and_one_more_token_is_not() {
        assert_eq!(admit(6, Generate::Tokens(2), 8), Ok(8));
        assert_eq!(admit(6, Generate::Tokens(3), 8), Err(Refusal::ContextLength { prompt: 6, max_tokens: 3, needed: 9, limit: 8 }));
        assert_eq!(admit(8, Generate::Elsewhere, 8), Ok(8));
        assert_eq!(admit(9, Generate::Elsewhere, 8), Err(Refusal::PromptTooLong { prompt: 9, limit: 8 }));
    }

    #[test]
    fn empty_prompts_and_zero_max_tokens_are_invalid_not_over_context() {
        assert_eq!(admit(0, Generate::Tokens(1), 8), Err(Refusal::EmptyPrompt));
        assert_eq!(admit(0, Generate::Elsewhere, 8), Err(Refusal::EmptyPrompt));
        assert_eq!(admit(3, Generate::Tokens(0), 8), Err(Refusal::ZeroMaxTokens));
        assert_eq!(Refusal::EmptyPrompt.reason(), RejectReason::Invalid);
        assert_eq!(Refusal::PromptTooLong { prompt: 9, limit: 8 }.reason(), RejectReason::ContextLength);
    }

    #[test]
    fn huge_max_tokens_saturate_instead_of_wrapping() {
        let r = admit(5, Generate::Tokens(usize::MAX), 8);
        assert_eq!(r, Err(Refusal::ContextLength { prompt: 5, max_tokens: usize::MAX, needed: usize::MAX, limit: 8 }));
    }

    #[test]
    fn a_missing_max_tokens_takes_what_the_prompt_leaves_and_at_least_one() {
        assert_eq!(default_max_tokens(3, 8), 5);
        assert_eq!(default_max_tokens(8, 8), 1);
        assert_eq!(default_max_tokens(9, 8), 1);
    }
}
