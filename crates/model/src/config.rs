//! Hyperparameters of a llama-architecture model, read from GGUF metadata.

use bulkhead_gguf::GgufFile;

use crate::ModelError;

/// What the forward pass needs to know about the model's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Transformer blocks.
    pub layers: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Inner width of the feed-forward block.
    pub ffn: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// RoPE frequency base.
    pub rope_base: f32,
    /// RMS-norm epsilon.
    pub norm_eps: f32,
    /// Context length the model was trained for (the most it can advertise).
    pub context_length: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab: usize,
}

impl LlamaConfig {
    /// Read and validate; errors name the key.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, ModelError> {
        let arch = f.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(ModelError::UnsupportedArchitecture { arch: arch.to_string() });
        }
        let k = |s: &str| format!("{arch}.{s}");
        let hidden = f.get_count(&k("embedding_length"))?;
        let heads = f.get_count(&k("attention.head_count"))?;
        let kv_heads = match f.get_count(&k("attention.head_count_kv")) {
            Err(bulkhead_gguf::GgufError::MissingKey { .. }) => heads,
            r => r?,
        };
        let head_dim = match f.get_count(&k("attention.key_length")) {
            Err(bulkhead_gguf::GgufError::MissingKey { .. }) => hidden / heads,
            r => r?,
        };
        let invalid = |key: String, why: String| ModelError::InvalidConfig { key, why };
        if heads % kv_heads != 0 {
            return Err(invalid(k("attention.head_count_kv"), format!("{kv_heads} does not divide head_count {heads}")));
        }
        if head_dim % 2 != 0 || head_dim == 0 {
            return Err(invalid(k("attention.key_length"), format!("head dimension {head_dim} must be even")));
        }
        match f.get_count(&k("rope.dimension_count")) {
            Ok(d) if d != head_dim => {
                return Err(invalid(k("rope.dimension_count"), format!("partial RoPE ({d} of {head_dim}) is not supported")));
            }
            Err(bulkhead_gguf::GgufError::MissingKey { .. }) | Ok(_) => {}
            Err(e) => return Err(e.into()),
        }
        let rope_base = match f.get_f64(&k("rope.freq_base")) {
            Err(bulkhead_gguf::GgufError::MissingKey { .. }) => 10_000.0,
            r => r?,
        } as f32;
        let norm_eps = f.get_f64(&k("attention.layer_norm_rms_epsilon"))? as f32;
        if !(rope_base.is_finite() && rope_base > 1.0) {
            return Err(invalid(k("rope.freq_base"), format!("{rope_base}")));
        }
        if !(norm_eps.is_finite() && norm_eps >= 0.0) {
            return Err(invalid(k("attention.layer_norm_rms_epsilon"), format!("{norm_eps}")));
        }
        let (embd, _) = f.tensor("token_embd.weight").map_err(ModelError::from)?;
        let vocab = embd.dims.get(1).copied().unwrap_or(0) as usize;
        Ok(LlamaConfig {
            layers: f.get_count(&k("block_count"))?,
            hidden,
            ffn: f.get_count(&k("feed_forward_length"))?,
            heads,
            kv_heads,
            head_dim,
            rope_base,
            norm_eps,
            context_length: f.get_count(&k("context_length"))?,
            vocab,
        })
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Bytes of KV cache one token needs at `bytes_per_elem` bytes per element.
    pub fn kv_bytes_per_token(&self, bytes_per_elem: usize) -> usize {
        2 * self.layers * self.kv_heads * self.head_dim * bytes_per_elem
    }
}
