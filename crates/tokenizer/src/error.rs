//! The one error type of this crate. Every variant that comes from the model file names the
//! GGUF key that is missing or invalid, so a bad model is diagnosed from the message alone.

use bulkhead_gguf::GgufError;

/// Why a tokenizer or chat template could not be built from a GGUF file, or a template could
/// not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required metadata key is absent.
    #[error("missing GGUF key `{key}`")]
    MissingKey {
        /// The GGUF metadata key.
        key: &'static str,
    },
    /// A metadata key is present but could not be read as the expected type.
    #[error("GGUF key `{key}`: {source}")]
    BadKey {
        /// The GGUF metadata key.
        key: &'static str,
        /// What the GGUF reader reported.
        source: GgufError,
    },
    /// A metadata key has a value of the right type that is nonetheless unusable.
    #[error("GGUF key `{key}` is invalid: {why}")]
    InvalidValue {
        /// The GGUF metadata key.
        key: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// `tokenizer.ggml.model` names a tokenizer other than byte-level BPE (`gpt2`) or
    /// SentencePiece (`llama`).
    #[error("unsupported tokenizer model `{value}` in GGUF key `tokenizer.ggml.model` (supported: \"gpt2\", \"llama\")")]
    UnsupportedModel {
        /// The value found.
        value: String,
    },
    /// `tokenizer.ggml.pre` names a pre-tokenizer this crate does not know.
    #[error("unknown pre-tokenizer `{value}` in GGUF key `tokenizer.ggml.pre`")]
    UnknownPre {
        /// The value found.
        value: String,
    },
    /// A pre-tokenizer regex did not compile (a bug in this crate, not in the model).
    #[error("pre-tokenizer regex for `tokenizer.ggml.pre` = `{pre}` does not compile: {source}")]
    Regex {
        /// The pre-tokenizer name.
        pre: String,
        /// The regex compiler's error.
        source: Box<fancy_regex::Error>,
    },
    /// The chat template in `tokenizer.chat_template` does not parse.
    #[error("chat template in GGUF key `tokenizer.chat_template` does not compile: {0:#}")]
    TemplateSyntax(minijinja::Error),
    /// The chat template called `raise_exception(message)`, e.g. for an unsupported role order.
    #[error("chat template raised an exception: {message}")]
    TemplateRaised {
        /// The message the template passed.
        message: String,
    },
    /// Rendering the chat template failed for another reason.
    #[error("chat template rendering failed: {0:#}")]
    TemplateRender(minijinja::Error),
}

/// Map a GGUF read of a required key: absence becomes [`TokenizerError::MissingKey`].
pub(crate) fn required<T>(key: &'static str, r: Result<T, GgufError>) -> Result<T, TokenizerError> {
    r.map_err(|e| match e {
        GgufError::MissingKey { .. } => TokenizerError::MissingKey { key },
        source => TokenizerError::BadKey { key, source },
    })
}

/// Map a GGUF read of an optional key: absence becomes `None`.
pub(crate) fn optional<T>(key: &'static str, r: Result<T, GgufError>) -> Result<Option<T>, TokenizerError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(GgufError::MissingKey { .. }) => Ok(None),
        Err(source) => Err(TokenizerError::BadKey { key, source }),
    }
}
