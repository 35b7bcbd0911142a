//! The shapes: hyperparameters of public models, from each model's published Hugging Face
//! `config.json`, written as llama.cpp's `convert_hf_to_gguf.py` writes them.
//!
//! Each number was checked against a second public copy of the same `config.json` (or a
//! module print of the loaded model, which shows every matrix's shape); where the GGUF form
//! differs from the config (the architecture name, Llama 3's RoPE scaling as a tensor,
//! Gemma 3's fixed local RoPE base and layer pattern) llama.cpp's converter and loader
//! (`src/llama-model.cpp`) decide, and Bulkhead's loader (`bulkhead_model::config`) reads
//! the same keys.

use std::fmt;
use std::str::FromStr;

use crate::SynthError;

/// A shape by its `--shape` name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum ShapeName {
    /// Llama 3.2 1B (meta-llama/Llama-3.2-1B): 16 layers, hidden 2048, tied, Llama 3 RoPE scaling.
    #[value(name = "llama-3.2-1b")]
    Llama32_1b,
    /// Llama 3.1 8B (meta-llama/Llama-3.1-8B): 32 layers, hidden 4096, Llama 3 RoPE scaling.
    #[value(name = "llama-3.1-8b")]
    Llama31_8b,
    /// Qwen 2.5 7B (Qwen/Qwen2.5-7B-Instruct): 28 layers, hidden 3584, biases on Q/K/V.
    #[value(name = "qwen2.5-7b")]
    Qwen25_7b,
    /// Gemma 3 1B (google/gemma-3-1b-it): 26 layers, hidden 1152, head 256, window 512 on 5 layers of 6.
    #[value(name = "gemma-3-1b")]
    Gemma3_1b,
    /// Mistral 7B v0.3 (mistralai/Mistral-7B-v0.3): 32 layers, hidden 4096, 32k vocabulary.
    #[value(name = "mistral-7b")]
    Mistral7b,
}

impl ShapeName {
    /// Every shape, in `--help` order.
    pub const ALL: [ShapeName; 5] =
        [ShapeName::Llama32_1b, ShapeName::Llama31_8b, ShapeName::Qwen25_7b, ShapeName::Gemma3_1b, ShapeName::Mistral7b];

    /// The `--shape` name.
    pub fn name(self) -> &'static str {
        match self {
            ShapeName::Llama32_1b => "llama-3.2-1b",
            ShapeName::Llama31_8b => "llama-3.1-8b",
            ShapeName::Qwen25_7b => "qwen2.5-7b",
            ShapeName::Gemma3_1b => "gemma-3-1b",
            ShapeName::Mistral7b => "mistral-7b",
        }
    }

    /// The full-size shape.
    pub fn shape(self) -> Shape {
        match self {
            ShapeName::Llama32_1b => LLAMA_3_2_1B,
            ShapeName::Llama31_8b => LLAMA_3_1_8B,
            ShapeName::Qwen25_7b => QWEN_2_5_7B,
            ShapeName::Gemma3_1b => GEMMA_3_1B,
            ShapeName::Mistral7b => MISTRAL_7B,
        }
    }

    /// The model whose vocabulary the shape takes by default: Gemma 3 270M's (the same
    /// 262,144 SentencePiece tokens as Gemma 3 1B) for `gemma-3-1b`, Bulkhead's default model
    /// (SmolLM2's 49,152-token byte-level BPE, padded or cut to size) for the others.
    pub fn default_donor(self) -> &'static bulkhead_fetch::KnownModel {
        match self {
            ShapeName::Gemma3_1b => &bulkhead_fetch::GEMMA3_270M,
            _ => &bulkhead_fetch::SMOLLM2,
        }
    }
}

impl fmt::Display for ShapeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ShapeName {
    type Err = SynthError;

    /// A shape by its name; an unknown name is an error listing the known ones.
    fn from_str(s: &str) -> Result<Self, SynthError> {
        ShapeName::ALL
            .into_iter()
            .find(|n| n.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| SynthError::UnknownShape { name: s.to_string(), known: ShapeName::ALL.map(ShapeName::name).join(", ") })
    }
}

/// Llama 3's RoPE scaling (`rope_scaling` with `rope_type: llama3`). GGUF files carry it as
/// the tensor `rope_freqs.weight` of per-pair factors ([`Shape::rope_factors`]), not as
/// metadata.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Rope {
    /// `factor`.
    pub factor: f32,
    /// `low_freq_factor`.
    pub low_freq_factor: f32,
    /// `high_freq_factor`.
    pub high_freq_factor: f32,
    /// `original_max_position_embeddings`.
    pub original_context: usize,
}

/// A decoder's shape: what the generator writes and what a loader derives from it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    /// The `--shape` name (a scaled-down copy keeps it).
    pub name: &'static str,
    /// `general.architecture`: `llama` (Mistral's GGUFs are `llama` too), `qwen2`, `gemma3`.
    pub arch: &'static str,
    /// `hidden_size`.
    pub hidden: usize,
    /// `num_hidden_layers`.
    pub layers: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `num_key_value_heads`.
    pub kv_heads: usize,
    /// `head_dim` (written as `attention.key_length` and `value_length`).
    pub head_dim: usize,
    /// `intermediate_size`.
    pub ffn: usize,
    /// `vocab_size`: rows of the embedding, and tokens of the written vocabulary.
    pub vocab: usize,
    /// `tie_word_embeddings`: no `output.weight`, the embedding is the output projection.
    pub tied: bool,
    /// `rope_theta` (of the global layers).
    pub rope_theta: f32,
    /// Gemma 3's `rope_local_base_freq`, of its sliding-window layers. Not written: llama.cpp
    /// and Bulkhead both fix it at 10,000 for `gemma3`.
    pub rope_theta_local: Option<f32>,
    /// Llama 3's RoPE scaling.
    pub llama3_rope: Option<Llama3Rope>,
    /// Biases on Q, K and V (Qwen 2).
    pub qkv_bias: bool,
    /// `sliding_window` of the sliding-window layers. For `gemma3` every sixth layer is
    /// global (layers 5, 11, ...): both loaders fix that pattern, so it is not written.
    pub sliding_window: Option<usize>,
    /// `max_position_embeddings`: the context length written.
    pub context: usize,
    /// `rms_norm_eps`.
    pub norm_eps: f32,
}

/// Llama 3.2 1B: hidden 2048, 16 layers, 32 heads, 8 KV heads, head 64, FFN 8192, vocab
/// 128256, tied, θ 500000 with Llama 3 scaling (factor 32, low 1, high 4, original 8192),
/// context 131072, ε 1e-5.
pub const LLAMA_3_2_1B: Shape = Shape {
    name: "llama-3.2-1b",
    arch: "llama",
    hidden: 2048,
    layers: 16,
    heads: 32,
    kv_heads: 8,
    head_dim: 64,
    ffn: 8192,
    vocab: 128_256,
    tied: true,
    rope_theta: 500_000.0,
    rope_theta_local: None,
    llama3_rope: Some(Llama3Rope { factor: 32.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_context: 8192 }),
    qkv_bias: false,
    sliding_window: None,
    context: 131_072,
    norm_eps: 1e-5,
};

/// Llama 3.1 8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, head 128, FFN 14336, vocab
/// 128256, untied, θ 500000 with Llama 3 scaling (factor 8, low 1, high 4, original 8192),
/// context 131072, ε 1e-5.
pub const LLAMA_3_1_8B: Shape = Shape {
    name: "llama-3.1-8b",
    arch: "llama",
    hidden: 4096,
    layers: 32,
    heads: 32,
    kv_heads: 8,
    head_dim: 128,
    ffn: 14_336,
    vocab: 128_256,
    tied: false,
    rope_theta: 500_000.0,
    rope_theta_local: None,
    llama3_rope: Some(Llama3Rope { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_context: 8192 }),
    qkv_bias: false,
    sliding_window: None,
    context: 131_072,
    norm_eps: 1e-5,
};

/// Qwen 2.5 7B (Instruct): hidden 3584, 28 layers, 28 heads, 4 KV heads, head 128, FFN
/// 18944, vocab 152064, untied, θ 10⁶, biases on Q/K/V, context 32768, ε 1e-6 (its
/// `sliding_window` is off: `use_sliding_window: false`).
pub const QWEN_2_5_7B: Shape = Shape {
    name: "qwen2.5-7b",
    arch: "qwen2",
    hidden: 3584,
    layers: 28,
    heads: 28,
    kv_heads: 4,
    head_dim: 128,
    ffn: 18_944,
    vocab: 152_064,
    tied: false,
    rope_theta: 1_000_000.0,
    rope_theta_local: None,
    llama3_rope: None,
    qkv_bias: true,
    sliding_window: None,
    context: 32_768,
    norm_eps: 1e-6,
};

/// Gemma 3 1B: hidden 1152, 26 layers, 4 heads, 1 KV head, head 256, FFN 6912, vocab
/// 262144, tied, sliding window 512 on five layers of every six, θ 10⁶ global and 10⁴
/// local, context 32768, ε 1e-6. Hidden 1152 is not a multiple of 256: a k-quant mix falls
/// back for the matrices it feeds (see [`crate::Quant`]).
pub const GEMMA_3_1B: Shape = Shape {
    name: "gemma-3-1b",
    arch: "gemma3",
    hidden: 1152,
    layers: 26,
    heads: 4,
    kv_heads: 1,
    head_dim: 256,
    ffn: 6912,
    vocab: 262_144,
    tied: true,
    rope_theta: 1_000_000.0,
    rope_theta_local: Some(10_000.0),
    llama3_rope: None,
    qkv_bias: false,
    sliding_window: Some(512),
    context: 32_768,
    norm_eps: 1e-6,
};

/// Mistral 7B v0.3: hidden 4096, 32 layers, 32 heads, 8 KV heads, head 128, FFN 14336,
/// vocab 32768, untied, θ 10⁶, no sliding window, context 32768, ε 1e-5. Its GGUFs say
/// `llama` (llama.cpp converts `MistralForCausalLM` as a llama).
pub const MISTRAL_7B: Shape = Shape {
    name: "mistral-7b",
    arch: "llama",
    hidden: 4096,
    layers: 32,
    heads: 32,
    kv_heads: 8,
    head_dim: 128,
    ffn: 14_336,
    vocab: 32_768,
    tied: false,
    rope_theta: 1_000_000.0,
    rope_theta_local: None,
    llama3_rope: None,
    qkv_bias: false,
    sliding_window: None,
    context: 32_768,
    norm_eps: 1e-5,
};

impl Shape {
    /// Parameters (matrices, embeddings and vectors).
    pub fn params(&self) -> u64 {
        let (h, q, kv, f) =
            (self.hidden as u64, (self.heads * self.head_dim) as u64, (self.kv_heads * self.head_dim) as u64, self.ffn as u64);
        let layer = 2 * h * q + 2 * h * kv + 3 * h * f + 2 * h;
        let out = if self.tied { 0 } else { self.vocab as u64 * h };
        self.layers as u64 * layer + self.vocab as u64 * h + out + h
    }

    /// A small copy for tests: the same head width, GQA ratio, architecture and features
    /// (tying, biases, window, RoPE scaling), with at most 2 KV heads (the hidden width
    /// shrunk in proportion), 2 layers, an FFN of 512, a vocabulary of 1024 and a context
    /// of 512.
    pub fn scaled_down(&self) -> Shape {
        let kv = self.kv_heads.min(2);
        Shape {
            hidden: self.hidden * kv / self.kv_heads,
            heads: self.heads / self.kv_heads * kv,
            kv_heads: kv,
            layers: 2,
            ffn: 512,
            vocab: 1024,
            context: 512,
            ..*self
        }
    }

    /// Llama 3's per-pair RoPE factors (`rope_freqs.weight`, `head_dim / 2` of them), as
    /// llama.cpp's converter computes them (in f32, like its torch tensors): 1 for
    /// wavelengths under `original / high`, `factor` over `original / low`, a smooth
    /// blend between. `None` without Llama 3 scaling.
    pub fn rope_factors(&self) -> Option<Vec<f32>> {
        let r = self.llama3_rope?;
        let dim = self.head_dim as f32;
        let old = r.original_context as f32;
        let (low_wavelen, high_wavelen) = (old / r.low_freq_factor, old / r.high_freq_factor);
        let factors = (0..self.head_dim / 2)
            .map(|i| {
                let freq = 1.0 / self.rope_theta.powf((2 * i) as f32 / dim);
                let wavelen = 2.0 * std::f32::consts::PI / freq;
                if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    r.factor
                } else {
                    let smooth = (old / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
                    1.0 / ((1.0 - smooth) / r.factor + smooth)
                }
            })
            .collect();
        Some(factors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shape_is_consistent() {
        for n in ShapeName::ALL {
            let s = n.shape();
            assert_eq!(s.name, n.name());
            assert_eq!(n.name().parse::<ShapeName>().unwrap(), n);
            assert!(s.heads.is_multiple_of(s.kv_heads) && s.head_dim.is_multiple_of(2), "{s:?}");
            let small = s.scaled_down();
            assert_eq!(small.heads / small.kv_heads, s.heads / s.kv_heads, "{n}: GQA ratio");
            assert_eq!(small.head_dim, s.head_dim);
            assert!(small.hidden.is_multiple_of(32) && small.hidden > 0, "{n}: {small:?}");
        }
        // Parameter counts near the published sizes.
        let b = |n: ShapeName| n.shape().params() as f64 / 1e9;
        assert!((1.2..1.3).contains(&b(ShapeName::Llama32_1b)), "{}", b(ShapeName::Llama32_1b));
        assert!((8.0..8.1).contains(&b(ShapeName::Llama31_8b)), "{}", b(ShapeName::Llama31_8b));
        assert!((7.6..7.7).contains(&b(ShapeName::Qwen25_7b)), "{}", b(ShapeName::Qwen25_7b));
        assert!((0.99..1.01).contains(&b(ShapeName::Gemma3_1b)), "{}", b(ShapeName::Gemma3_1b));
        assert!((7.2..7.3).contains(&b(ShapeName::Mistral7b)), "{}", b(ShapeName::Mistral7b));
    }

    #[test]
    fn an_unknown_shape_name_lists_the_known_ones() {
        let e = "llama-9b".parse::<ShapeName>().unwrap_err().to_string();
        assert!(e.contains("llama-9b"), "{e}");
        for n in ShapeName::ALL {
            assert!(e.contains(n.name()), "{e}");
        }
    }

    #[test]
    fn llama3_rope_factors_run_from_1_to_the_factor() {
        let f = LLAMA_3_1_8B.rope_factors().unwrap();
        assert_eq!(f.len(), 64);
        // High frequencies untouched, the lowest slowed by the factor, monotone between.
        assert_eq!(f[0], 1.0);
        assert_eq!(f[63], 8.0);
        assert!(f.windows(2).all(|w| w[0] <= w[1]), "{f:?}");
        assert!(f.iter().any(|&x| x > 1.0 && x < 8.0), "a smooth band: {f:?}");
        let f = LLAMA_3_2_1B.rope_factors().unwrap();
        assert_eq!((f.len(), f[0], f[31]), (32, 1.0, 32.0));
        assert!(QWEN_2_5_7B.rope_factors().is_none());
    }
}
