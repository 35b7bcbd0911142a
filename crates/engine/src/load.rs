//! Model, tokenizer, chat template and digest from one GGUF file, read a tensor at a time:
//! each matrix is laid out (packed) from its own bytes, which are then dropped, so a load
//! holds the laid-out weights and one tensor, not the whole file beside them; the digest is
//! one more pass over the file, a few megabytes at a time.

use std::path::{Path, PathBuf};

use bulkhead_gguf::{GgufError, GgufFile};
use bulkhead_model::shared::Shared;
use bulkhead_model::{Llama, ModelError};
use bulkhead_tokenizer::{ChatTemplate, Tokenizer, TokenizerError};

/// Everything a GGUF file provides for serving.
#[derive(Debug)]
pub struct LoadedModel {
    /// Weights and forward pass.
    pub model: Llama,
    /// Text to tokens and back.
    pub tokenizer: Tokenizer,
    /// The chat template: the file's, or the one given instead; `None` for a base model
    /// that has none.
    pub chat: Option<ChatTemplate>,
    /// xxh3-64 of the file: the identity gateway and workers compare.
    pub digest: u64,
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
    #[error("chat template {path}: {why}")]
    ChatTemplate { path: PathBuf, why: String },
    #[error("{path}: could not be read again for its digest")]
    Digest { path: PathBuf },
}

/// Load a model file with `threads` compute threads (0 = one per core).
pub fn load_model(path: &Path, threads: usize) -> Result<LoadedModel, LoadError> {
    load_model_with(path, threads, None, None)
}

/// [`load_model`], with the chat template read from `chat_template` (a Jinja file) instead
/// of the model's, and the laid-out weights shared through `weights_cache` with the other
/// processes of this host that load the same file ([`bulkhead_model::shared`]).
pub fn load_model_with(
    path: &Path,
    threads: usize,
    chat_template: Option<&Path>,
    weights_cache: Option<&Path>,
) -> Result<LoadedModel, LoadError> {
    let f = GgufFile::open(path)?;
    let p = || path.to_path_buf();
    let digest = f.digest().ok_or_else(|| LoadError::Digest { path: p() })?;
    let model = match weights_cache {
        Some(dir) => {
            let (m, how) = Llama::from_gguf_shared(&f, threads, digest, dir).map_err(|source| LoadError::Model { path: p(), source })?;
            match how {
                Shared::Mapped(at) => tracing::info!(file = %at.display(), "weights mapped from this host's shared copy"),
                Shared::Written(at) => tracing::info!(file = %at.display(), "weights laid out and shared for this host's other workers"),
                Shared::Own(why) => tracing::warn!(%why, "weights not shared: this process holds its own copy"),
            }
            m
        }
        None => Llama::from_gguf(&f, threads).map_err(|source| LoadError::Model { path: p(), source })?,
    };
    let tokenizer = Tokenizer::from_gguf(&f).map_err(|source| LoadError::Tokenizer { path: p(), source })?;
    let chat = chat_template_of(&f, path, chat_template)?;
    Ok(LoadedModel { model, tokenizer, chat, digest })
}

/// The chat template of the model file `f` (at `path`): from `file` if given, else the
/// model's own, else none (a base model).
pub fn chat_template_of(f: &GgufFile, path: &Path, file: Option<&Path>) -> Result<Option<ChatTemplate>, LoadError> {
    match file {
        Some(t) => {
            let source = std::fs::read_to_string(t).map_err(|e| LoadError::ChatTemplate { path: t.to_path_buf(), why: e.to_string() })?;
            ChatTemplate::with_tokens_of(f, source)
                .map(Some)
                .map_err(|e| LoadError::ChatTemplate { path: t.to_path_buf(), why: e.to_string() })
        }
        None => ChatTemplate::from_gguf_if_any(f).map_err(|source| LoadError::Tokenizer { path: path.to_path_buf(), source }),
    }
}
