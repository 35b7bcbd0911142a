//! Model, tokenizer and chat template from one GGUF file, read once.

use std::path::{Path, PathBuf};

use bulkhead_gguf::{GgufError, GgufFile};
use bulkhead_model::{Llama, ModelError};
use bulkhead_tokenizer::{ChatTemplate, Tokenizer, TokenizerError};

/// Everything a GGUF file provides for serving.
#[derive(Debug)]
pub struct LoadedModel {
    /// Weights and forward pass.
    pub model: Llama,
    /// Text to tokens and back.
    pub tokenizer: Tokenizer,
    /// The file's chat template.
    pub chat: ChatTemplate,
}

/// A GGUF file that could not be loaded; the message names the file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{path}: {source}")]
    Model { path: PathBuf, source: ModelError },
    #[error("{path}: {source}")]
    Tokenizer { path: PathBuf, source: TokenizerError },
}

/// Load a model file with `threads` compute threads (0 = one per core).
pub fn load_model(path: &Path, threads: usize) -> Result<LoadedModel, LoadError> {
    let f = GgufFile::open(path)?;
    let p = || path.to_path_buf();
    let model = Llama::from_gguf(&f, threads).map_err(|source| LoadError::Model { path: p(), source })?;
    let tokenizer = Tokenizer::from_gguf(&f).map_err(|source| LoadError::Tokenizer { path: p(), source })?;
    let chat = ChatTemplate::from_gguf(&f).map_err(|source| LoadError::Tokenizer { path: p(), source })?;
    Ok(LoadedModel { model, tokenizer, chat })
}
