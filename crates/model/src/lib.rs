//! A decoder of the llama family (llama, mistral, qwen2, qwen3, gemma3) from a GGUF file,
//! run over paged KV.
//!
//! # Layout
//! - [`config`]: hyperparameters from GGUF metadata.
//! - [`weights`]: weight tensors, checked for shape and type.
//! - [`kquant`]: ggml's k-quant superblocks in one integer form.
//! - [`quant`]: ggml block formats; 8-bit activation quantisation.
//! - [`kernels`]: dot products and attention helpers, portable, AVX2 and AVX-512 VNNI
//!   (detected at run time; an [`Isa`] can only be made by detection).
//! - [`matmul`]: batched, multi-threaded matrix products.
//! - [`forward`]: the forward pass for a batch of sequences over leased KV pages.
//! - [`reference`]: a plain contiguous forward pass, the oracle the paged one is tested against.
//!
//! The only `unsafe` is in `kernels/avx2.rs` and `kernels/vnni.rs` (SIMD intrinsics) and the
//! cache prefetch in `kernels/mod.rs`, each block with its `SAFETY:` argument (clippy's
//! `undocumented_unsafe_blocks` holds every block to one), the intrinsics reached only
//! through an [`Isa`] that detection made.

// The kernels index several arrays with one counter (scales, sums and lanes side by side);
// iterator chains there read worse and must not change the order of the sums.
#![allow(clippy::needless_range_loop)]

pub mod config;
pub mod forward;
pub mod kernels;
pub mod kquant;
pub mod matmul;
pub mod quant;
pub mod reference;
pub mod shared;
pub mod weights;

use std::path::{Path, PathBuf};

use bulkhead_gguf::{GgufError, GgufFile};
use bulkhead_kv::{KvError, KvLayout};

pub use config::{Activation, Arch, LlamaConfig, RopeStyle};
pub use forward::{KEY_SPAN, SeqInput};
pub use kernels::{Isa, IsaLevel, Sums};
pub use weights::Weights;

/// Why a model could not be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    InFile { path: PathBuf, source: Box<ModelError> },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported architecture `{arch}` (general.architecture); Bulkhead runs: llama, mistral, qwen2, qwen3, gemma3")]
    UnsupportedArchitecture { arch: String },
    #[error(
        "tensor `{tensor}` has unsupported type {ty} (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)"
    )]
    UnsupportedTensorType { tensor: String, ty: String },
    #[error("tensor `{tensor}`: {why}")]
    BadShape { tensor: String, why: String },
    #[error("metadata key `{key}`: {why}")]
    InvalidConfig { key: String, why: String },
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("sequence would need {needed} positions, the model's context is {context}")]
    ContextOverflow { needed: usize, context: usize },
    #[error("position {pos} has no reserved KV page")]
    NotReserved { pos: usize },
    #[error("page {page} layer {layer} holds {written} written slots, attention needs {needed}")]
    MissingKv { page: u32, layer: usize, written: usize, needed: usize },
    /// A read check failed for sequence `seq` (its index in the forward call) before
    /// anything was computed or written: that sequence must not run; the others may.
    #[error("sequence {seq} of the batch failed a KV read check: {source}")]
    ReadCheck { seq: usize, source: KvError },
    #[error("forward pass called with no tokens")]
    EmptyBatch,
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("cannot start {threads} compute threads: {why}")]
    Threads { threads: usize, why: String },
}

/// A loaded model with its compute threads.
pub struct Llama {
    /// Shape.
    pub config: LlamaConfig,
    /// Weights.
    pub weights: Weights,
    isa: Isa,
    threads: rayon::ThreadPool,
    /// One compute thread, for the layers a [`CoreShare`] narrows (made with the share).
    narrow: Option<rayon::ThreadPool>,
    /// The forward pass's reusable buffers.
    scratch: std::sync::Mutex<forward::ForwardScratch>,
    /// How a forward pass shares the cores with another worker's (see [`CoreShare`]).
    share: Option<std::sync::Arc<dyn CoreShare>>,
    /// Positions per attention key span ([`KEY_SPAN`]).
    key_span: usize,
}

/// How a forward pass shares this host's cores with another worker process's (the core
/// budget: `bulkhead_worker::core_budget`). Neither method decides what is computed: a
/// pause between regions holds no lock and no KV page beyond what the pass already holds,
/// and a layer gives the same bits on one thread as on many (every kernel's result for a
/// row does not depend on how rows are split into tasks), so sharing changes when a result
/// appears, never what it is.
pub trait CoreShare: Send + Sync {
    /// Return when this forward pass may go on; called before each parallel region (every
    /// matrix product and every attention pass of every layer).
    fn pause(&self);
    /// Whether the next layer should run on one compute thread, leaving the other cores to
    /// the other worker; asked at the start of each layer and before the logits.
    fn narrow(&self) -> bool;
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama").field("config", &self.config).field("isa", &self.isa).finish_non_exhaustive()
    }
}

impl Llama {
    /// Load a GGUF file; every error names the file.
    pub fn load(path: impl AsRef<Path>, threads: usize) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let f = GgufFile::open(path)?;
        Self::from_gguf(&f, threads).map_err(|e| ModelError::InFile { path: path.to_path_buf(), source: Box::new(e) })
    }

    /// Build from a parsed file, with `threads` compute threads (0 = one per core).
    pub fn from_gguf(f: &GgufFile, threads: usize) -> Result<Self, ModelError> {
        let config = LlamaConfig::from_gguf(f)?;
        let isa = Isa::detect();
        let weights = Weights::load(f, &config, isa)?;
        Self::with_weights(config, weights, isa, threads)
    }

    /// [`Llama::from_gguf`], the laid-out weights shared with the other processes of this
    /// host through `dir` ([`shared`]); `digest` is the file's.
    pub fn from_gguf_shared(f: &GgufFile, threads: usize, digest: u64, dir: &Path) -> Result<(Self, shared::Shared), ModelError> {
        let config = LlamaConfig::from_gguf(f)?;
        let isa = Isa::detect();
        let (weights, how) = shared::load(f, &config, isa, digest, dir)?;
        Ok((Self::with_weights(config, weights, isa, threads)?, how))
    }

    fn with_weights(config: LlamaConfig, weights: Weights, isa: Isa, threads: usize) -> Result<Self, ModelError> {
        let threads = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("bulkhead-compute-{i}"))
            .build()
            .map_err(|e| ModelError::Threads { threads, why: e.to_string() })?;
        Ok(Llama { config, weights, isa, threads: pool, narrow: None, scratch: Default::default(), share: None, key_span: KEY_SPAN })
    }

    /// Use another instruction set (tests compare the portable path with the SIMD one).
    pub fn with_isa(mut self, isa: Isa) -> Self {
        self.weights.set_layout(isa);
        self.isa = isa;
        self
    }

    /// Use another arithmetic for the quantised dot products. On AVX2 the weights' layout
    /// follows it (block sums multiply packed weights there, lane sums rows); lossless.
    pub fn set_sums(&mut self, sums: Sums) {
        let isa = self.isa.with_sums(sums);
        if isa.packs_weights() != self.isa.packs_weights() {
            self.weights.set_layout(isa);
        }
        self.isa = isa;
    }

    /// Split attention's keys every `span` positions instead of [`KEY_SPAN`]. The span
    /// decides the bits of rows past the first span (in the paged pass and the reference
    /// pass alike): tests shrink it to reach several spans with short sequences.
    pub fn set_key_span(&mut self, span: usize) {
        self.key_span = span.max(1);
    }

    /// Share the cores with another worker's forward passes through `share` (workers on one
    /// host: `bulkhead_worker::core_budget`). With more than one compute thread this makes
    /// the one-thread pool that narrowed layers run on.
    pub fn set_core_share(&mut self, share: std::sync::Arc<dyn CoreShare>) -> Result<(), ModelError> {
        if self.threads() > 1 && self.narrow.is_none() {
            let one = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .thread_name(|_| "bulkhead-compute-narrow".into())
                .build()
                .map_err(|e| ModelError::Threads { threads: 1, why: e.to_string() })?;
            self.narrow = Some(one);
        }
        self.share = Some(share);
        Ok(())
    }

    /// Wait at the core share's pause point, if there is one.
    fn pause(&self) {
        if let Some(s) = &self.share {
            s.pause();
        }
    }

    /// Run `f` (a layer, called on the compute threads) on one thread while the core share
    /// narrows, else where it is: a pass of many layers enters the thread pool once.
    fn narrowed<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match (&self.share, &self.narrow) {
            (Some(s), Some(one)) if s.narrow() => one.install(f),
            _ => f(),
        }
    }

    /// Each weight type's kernel family, its sums ([`Sums`]) and parameter count, as one line
    /// for logs and benchmarks: `Q5_0 vnni512/blocks 63.4M, Q4_K vnni512/blocks 23.6M, ...`.
    pub fn kernels_line(&self) -> String {
        let sums = |k: &str| if k == "scalar" { Sums::Blocks } else { self.isa.sums() };
        let parts: Vec<String> = self
            .weights
            .kernels(self.isa())
            .into_iter()
            .map(|(ty, k, n)| format!("{ty} {k}/{} {:.1}M", sums(k).name(), n as f64 / 1e6))
            .collect();
        parts.join(", ")
    }

    /// The instruction set in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Compute threads.
    pub fn threads(&self) -> usize {
        self.threads.current_num_threads()
    }

    /// The KV page layout this model needs, for a pool of `page_size`-token pages.
    pub fn kv_layout(&self, page_size: usize) -> KvLayout {
        KvLayout { layers: self.config.layers, kv_heads: self.config.kv_heads, head_dim: self.config.head_dim, page_size }
    }
}
