//! Hyperparameters of a decoder of the llama family, read from GGUF metadata: `llama` (Llama
//! 2 and 3, with Llama 3's per-dimension RoPE factors), `mistral` (llama with a sliding
//! window), `qwen2` (biases on Q, K and V), `qwen3` (QK-norm) and `gemma3` (scaled
//! embeddings, QK-norm, pre- and post-norms, a GELU MLP, interleaved sliding-window and
//! global layers with their own RoPE bases).

use bulkhead_gguf::{GgufError, GgufFile};

use crate::ModelError;

/// The architectures Bulkhead runs, by their `general.architecture` names.
pub const SUPPORTED: &[&str] = &["llama", "mistral", "qwen2", "qwen3", "gemma3"];

/// Which family a model is: what its layers compute beyond llama's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3, SmolLM2 and most others.
    Llama,
    /// Llama with a sliding window.
    Mistral,
    /// Biases on Q, K and V.
    Qwen2,
    /// RMS norms on each head of Q and K.
    Qwen3,
    /// Gemma 3.
    Gemma3,
}

/// How RoPE pairs a head's dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i + 1)` (llama.cpp's "normal": GGUF stores llama's Q and K
    /// permuted for it).
    Adjacent,
    /// Halves `(i, i + d/2)` (GPT-NeoX's, used by Qwen and Gemma).
    Halves,
}

/// The MLP's activation, applied to the gate before it multiplies the up projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU).
    Silu,
    /// GELU, tanh approximation (GeGLU).
    GeluTanh,
}

/// What the forward pass needs to know about the model's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// The family.
    pub arch: Arch,
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
    /// RoPE frequency base of global (full-attention) layers.
    pub rope_base: f32,
    /// RoPE frequency base of sliding-window layers.
    pub rope_base_local: f32,
    /// Positions are multiplied by this before RoPE on global layers (linear scaling:
    /// `1 / factor`; 1 = none).
    pub rope_scale: f32,
    /// How RoPE pairs dimensions.
    pub rope_style: RopeStyle,
    /// RMS-norm epsilon.
    pub norm_eps: f32,
    /// Context length the model was trained for (the most it can advertise).
    pub context_length: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab: usize,
    /// Tokens each sliding-window layer attends to (its own position included); `None`
    /// when every layer is global.
    pub sliding_window: Option<usize>,
    /// Per layer: whether it is a sliding-window layer.
    pub swa_layers: Vec<bool>,
    /// Embeddings are multiplied by this (Gemma: √hidden); 1 = none.
    pub embed_scale: f32,
    /// Attention scores are multiplied by this (1/√head_dim unless the model says).
    pub attn_scale: f32,
    /// The MLP's activation.
    pub activation: Activation,
    /// Final logits soft-capped to `cap · tanh(logit / cap)`, if set.
    pub final_softcap: Option<f32>,
}

fn missing_ok<T>(r: Result<T, GgufError>) -> Result<Option<T>, GgufError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(GgufError::MissingKey { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

impl LlamaConfig {
    /// Read and validate; errors name the key. Another architecture is refused with the
    /// list of those supported.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, ModelError> {
        let name = f.get_str("general.architecture")?;
        let arch = match name {
            "llama" => Arch::Llama,
            "mistral" => Arch::Mistral,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma3" => Arch::Gemma3,
            other => return Err(ModelError::UnsupportedArchitecture { arch: other.to_string() }),
        };
        let k = |s: &str| format!("{name}.{s}");
        let hidden = f.get_count(&k("embedding_length"))?;
        let heads = f.get_count(&k("attention.head_count"))?;
        let kv_heads = missing_ok(f.get_count(&k("attention.head_count_kv")))?.unwrap_or(heads);
        let head_dim = missing_ok(f.get_count(&k("attention.key_length")))?.unwrap_or(hidden / heads.max(1));
        let invalid = |key: String, why: String| ModelError::InvalidConfig { key, why };
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(invalid(k("attention.head_count_kv"), format!("{kv_heads} does not divide head_count {heads}")));
        }
        if head_dim % 2 != 0 || head_dim == 0 {
            return Err(invalid(k("attention.key_length"), format!("head dimension {head_dim} must be even")));
        }
        if let Some(v) = missing_ok(f.get_count(&k("attention.value_length")))?
            && v != head_dim
        {
            return Err(invalid(k("attention.value_length"), format!("{v} differs from the key length {head_dim}")));
        }
        match missing_ok(f.get_count(&k("rope.dimension_count")))? {
            Some(d) if d != head_dim => {
                return Err(invalid(k("rope.dimension_count"), format!("partial RoPE ({d} of {head_dim}) is not supported")));
            }
            _ => {}
        }
        let rope_base = missing_ok(f.get_f64(&k("rope.freq_base")))?.unwrap_or(10_000.0) as f32;
        let norm_eps = f.get_f64(&k("attention.layer_norm_rms_epsilon"))? as f32;
        if !(rope_base.is_finite() && rope_base > 1.0) {
            return Err(invalid(k("rope.freq_base"), format!("{rope_base}")));
        }
        if !(norm_eps.is_finite() && norm_eps >= 0.0) {
            return Err(invalid(k("attention.layer_norm_rms_epsilon"), format!("{norm_eps}")));
        }
        let rope_scale = match missing_ok(f.get_str(&k("rope.scaling.type")))? {
            None | Some("none") => 1.0,
            Some("linear") => {
                let factor = f.get_f64(&k("rope.scaling.factor"))? as f32;
                if !(factor.is_finite() && factor >= 1.0) {
                    return Err(invalid(k("rope.scaling.factor"), format!("{factor}")));
                }
                1.0 / factor
            }
            // Llama 3's scaling is the per-dimension factors of `rope_freqs.weight`.
            Some("llama3") => 1.0,
            Some(other) => {
                return Err(invalid(k("rope.scaling.type"), format!("RoPE scaling `{other}` is not supported (none, linear, llama3)")));
            }
        };
        let layers = f.get_count(&k("block_count"))?;
        let window = missing_ok(f.get_count(&k("attention.sliding_window")))?.filter(|&w| w > 0);
        // Gemma 3: five sliding-window layers, then one global (llama.cpp's pattern of 6).
        let swa_layers: Vec<bool> = match (arch, window) {
            (_, None) => vec![false; layers],
            (Arch::Gemma3, Some(_)) => (0..layers).map(|i| i % 6 < 5).collect(),
            (_, Some(_)) => vec![true; layers],
        };
        let (rope_style, activation) = match arch {
            Arch::Llama | Arch::Mistral => (RopeStyle::Adjacent, Activation::Silu),
            Arch::Qwen2 | Arch::Qwen3 => (RopeStyle::Halves, Activation::Silu),
            Arch::Gemma3 => (RopeStyle::Halves, Activation::GeluTanh),
        };
        let embd = f.tensor_info("token_embd.weight").map_err(ModelError::from)?;
        let vocab = embd.dims.get(1).copied().unwrap_or(0) as usize;
        let final_softcap = missing_ok(f.get_f64(&k("final_logit_softcapping")))?.map(|c| c as f32).filter(|c| *c > 0.0);
        Ok(LlamaConfig {
            arch,
            layers,
            hidden,
            ffn: f.get_count(&k("feed_forward_length"))?,
            heads,
            kv_heads,
            head_dim,
            rope_base,
            rope_base_local: if arch == Arch::Gemma3 { 10_000.0 } else { rope_base },
            rope_scale,
            rope_style,
            norm_eps,
            context_length: f.get_count(&k("context_length"))?,
            vocab,
            sliding_window: window,
            swa_layers,
            embed_scale: if arch == Arch::Gemma3 { (hidden as f32).sqrt() } else { 1.0 },
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            activation,
            final_softcap,
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

    /// The window layer `layer` attends within, if it is a sliding-window layer.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.sliding_window.filter(|_| self.swa_layers.get(layer).copied().unwrap_or(false))
    }

    /// RoPE base and position scale of layer `layer`.
    pub fn rope_of(&self, layer: usize) -> (f32, f32) {
        if self.window(layer).is_some() && self.arch == Arch::Gemma3 {
            (self.rope_base_local, 1.0)
        } else {
            (self.rope_base, self.rope_scale)
        }
    }
}
