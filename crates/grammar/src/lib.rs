//! Constrained decoding (structured outputs): a request's [`GrammarSpec`] compiled by
//! llguidance over the model's own vocabulary, giving at each step the set of tokens the
//! grammar allows.
//!
//! [`Grammars`] holds what every request's grammar shares: a token trie built from the
//! tokenizer's bytes (special tokens marked as llguidance expects, so no grammar can
//! produce one by spelling it) and llguidance's parser factory. The gateway compiles each
//! grammar once to refuse a bad one with 400 before anything is queued
//! ([`Grammars::check`]); every worker that samples builds a [`Matcher`] from the same spec
//! and feeds it every token, so the prefill worker's first token and the decode worker's
//! later ones are masked by one grammar state.

use std::sync::Arc;

use bulkhead_protocol::GrammarSpec;
use bulkhead_tokenizer::{TokenType, Tokenizer};
use llguidance::ParserFactory;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

/// Why a grammar could not be compiled or followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The spec is not a grammar llguidance accepts (a bad schema, regex or Lark text).
    #[error("invalid grammar: {0}")]
    Invalid(String),
    /// The matcher failed while following the output (a token it did not allow, or an
    /// internal limit).
    #[error("grammar matcher failed: {0}")]
    Matcher(String),
    /// The vocabulary could not be turned into llguidance's token trie.
    #[error("cannot build the grammar vocabulary: {0}")]
    Vocabulary(String),
}

/// The model's tokenizer as llguidance's tokenizer environment: the trie of every token's
/// bytes and our own tokenisation (canonical, so forced text is tokenised as the model
/// would).
struct Env {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        // Grammar text is UTF-8 (it came from JSON); the trie handles any byte string, and
        // llguidance falls back on it for bytes that are not text.
        match std::str::from_utf8(s) {
            Ok(text) => self.tokenizer.encode(text, false),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// What every grammar over one vocabulary shares; cheap to clone.
#[derive(Clone)]
pub struct Grammars {
    factory: Arc<ParserFactory>,
    vocab: usize,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").field("vocab", &self.vocab).finish_non_exhaustive()
    }
}

impl Grammars {
    /// The trie and parser factory for `tokenizer`'s vocabulary. Control tokens (and every
    /// end-of-generation token) are special: llguidance names them with its marker byte, so
    /// a grammar's text never matches one by its spelling; the end-of-generation tokens are
    /// what a finished grammar allows.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Grammars, GrammarError> {
        let vocab = tokenizer.vocab_size();
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                let bytes = tokenizer.token_bytes(id).unwrap_or(&[]);
                let special = tokenizer.is_eog(id) || matches!(tokenizer.token_type(id), Some(TokenType::Control | TokenType::Unused));
                if special {
                    let mut w = Vec::with_capacity(bytes.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    w.extend_from_slice(bytes);
                    w
                } else {
                    bytes.to_vec()
                }
            })
            .collect();
        let eos = tokenizer.eos_id();
        let mut info = TokRxInfo::new(vocab as u32, eos);
        info.tok_bos = tokenizer.bos_id();
        let trie = TokTrie::from(&info, &words).with_eos_tokens(tokenizer.eog_ids());
        let env: TokEnv = Arc::new(Env { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        // Errors come back to the caller; llguidance's own logging stays quiet.
        factory.quiet();
        Ok(Grammars { factory: Arc::new(factory), vocab })
    }

    /// Compile `spec`, or say why it is not a grammar.
    pub fn check(&self, spec: &GrammarSpec) -> Result<(), GrammarError> {
        self.matcher(spec).map(drop)
    }

    /// A fresh matcher for one output under `spec`.
    pub fn matcher(&self, spec: &GrammarSpec) -> Result<Matcher, GrammarError> {
        let grammar = top_level(spec)?;
        let parser = self.factory.create_parser(grammar).map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let inner = llguidance::Matcher::new(Ok(parser));
        if let Some(e) = inner.get_error() {
            return Err(GrammarError::Invalid(e));
        }
        Ok(Matcher { inner })
    }
}

/// `spec` as llguidance's grammar.
fn top_level(spec: &GrammarSpec) -> Result<TopLevelGrammar, GrammarError> {
    Ok(match spec {
        GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"})),
        GrammarSpec::JsonSchema(text) => {
            let schema: serde_json::Value =
                serde_json::from_str(text).map_err(|e| GrammarError::Invalid(format!("the JSON schema is not JSON: {e}")))?;
            TopLevelGrammar::from_json_schema(schema)
        }
        GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
        GrammarSpec::Choice(choices) => {
            if choices.is_empty() {
                return Err(GrammarError::Invalid("a choice needs at least one string".into()));
            }
            // Each choice as a Lark string literal (JSON string syntax is Lark's).
            let alts: Vec<String> = choices.iter().map(|c| serde_json::Value::String(c.clone()).to_string()).collect();
            TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
        }
        GrammarSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
    })
}

/// One output's position in its grammar.
pub struct Matcher {
    inner: llguidance::Matcher,
}

impl std::fmt::Debug for Matcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Matcher").field("stopped", &self.inner.is_stopped()).finish_non_exhaustive()
    }
}

/// The tokens a grammar allows at one step.
#[derive(Debug, Clone)]
pub struct Mask(SimpleVob);

impl Mask {
    /// Whether `token` may be picked.
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }

    /// Set every disallowed entry of `logits` (one per vocabulary id) to negative infinity.
    pub fn apply(&self, logits: &mut [f32]) {
        for (id, l) in logits.iter_mut().enumerate() {
            if !(id < self.0.len() && self.0.get(id)) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.0.num_set()
    }
}

impl Matcher {
    /// The tokens allowed next. A finished grammar allows only end-of-generation tokens.
    pub fn mask(&mut self) -> Result<Mask, GrammarError> {
        let m = self.inner.compute_mask_or_eos().map_err(|e| GrammarError::Matcher(e.to_string()))?;
        Ok(Mask(m))
    }

    /// Follow the picked `token`; a token the grammar does not allow is an error.
    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        self.inner.consume_token(token).map_err(|e| GrammarError::Matcher(e.to_string()))
    }

    /// Whether the grammar is complete and allows nothing more than ending.
    pub fn is_stopped(&self) -> bool {
        self.inner.is_stopped()
    }

    /// Whether ending here leaves a complete match.
    pub fn is_accepting(&mut self) -> bool {
        self.inner.is_accepting().unwrap_or(false)
    }
}
