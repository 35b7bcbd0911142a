//! Tiny random-weight models written as GGUF files, built from a fixed seed so every run
//! writes the same bytes: the synthetic tests use them, and the comparison with llama.cpp
//! replays the files `cargo run -p bulkhead-model --example tiny-models DIR` wrote for
//! `scripts/llamacpp-fixtures.py` (its fixture records each file's digest).
#![allow(dead_code)] // each test binary uses its part

use bulkhead_gguf::{GgmlType, GgufWriter, Value};
use bulkhead_model::quant::quantize_row;

/// A tiny model's shape.
#[derive(Clone, Copy)]
pub struct Shape {
    pub vocab: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub layers: usize,
}

/// xorshift64: deterministic across platforms, no dependency.
pub struct Rng(pub u64);

impl Rng {
    /// Uniform in [-1, 1).
    pub fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn matrix(w: &mut GgufWriter, rng: &mut Rng, name: &str, rows: usize, cols: usize, ty: GgmlType) {
    let vals: Vec<f32> = (0..rows * cols).map(|_| rng.f() * 0.3).collect();
    let bytes: Vec<u8> = vals.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
    w.tensor(name, &[cols as u64, rows as u64], ty, bytes);
}

fn vector(w: &mut GgufWriter, rng: &mut Rng, name: &str, len: usize, around: f32) {
    let v: Vec<f32> = (0..len).map(|_| around + 0.2 * rng.f()).collect();
    w.tensor_f32(name, &[len as u64], &v);
}

/// A tiny random model of `arch` (llama, mistral, qwen2, qwen3, gemma3) with its layer
/// matrices in `ty`, and a sliding window of `window` tokens where given. `llama` carries
/// Llama 3's RoPE factors; gemma3's global layers use RoPE base 10^6, its local ones 10^4.
pub fn model(ty: GgmlType, arch: &str, sh: Shape, window: Option<u32>) -> GgufWriter {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut w = GgufWriter::new();
    let hd = sh.hidden / sh.heads;
    let rope_base = if arch == "gemma3" { 1e6 } else { 1e4 };
    w.meta("general.architecture", Value::String(arch.into()))
        .meta(&format!("{arch}.block_count"), Value::U32(sh.layers as u32))
        .meta(&format!("{arch}.context_length"), Value::U32(256))
        .meta(&format!("{arch}.embedding_length"), Value::U32(sh.hidden as u32))
        .meta(&format!("{arch}.feed_forward_length"), Value::U32(sh.ffn as u32))
        .meta(&format!("{arch}.attention.head_count"), Value::U32(sh.heads as u32))
        .meta(&format!("{arch}.attention.head_count_kv"), Value::U32(sh.kv_heads as u32))
        .meta(&format!("{arch}.rope.freq_base"), Value::F32(rope_base))
        .meta(&format!("{arch}.attention.layer_norm_rms_epsilon"), Value::F32(1e-5));
    if let Some(win) = window {
        w.meta(&format!("{arch}.attention.sliding_window"), Value::U32(win));
    }
    matrix(&mut w, &mut rng, "token_embd.weight", sh.vocab, sh.hidden, GgmlType::Q8_0);
    let ones = vec![1.0f32; sh.hidden];
    w.tensor_f32("output_norm.weight", &[sh.hidden as u64], &ones);
    // Gemma 3 ties the output to the embedding.
    if arch != "gemma3" {
        matrix(&mut w, &mut rng, "output.weight", sh.vocab, sh.hidden, ty);
    }
    if arch == "llama" {
        // Llama 3's RoPE factors: the low frequencies slowed down.
        let f: Vec<f32> = (0..hd / 2).map(|i| if i < hd / 4 { 1.0 } else { 4.0 }).collect();
        w.tensor_f32("rope_freqs.weight", &[(hd / 2) as u64], &f);
    }
    for l in 0..sh.layers {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        w.tensor_f32(&n("attn_norm"), &[sh.hidden as u64], &ones);
        w.tensor_f32(&n("ffn_norm"), &[sh.hidden as u64], &ones);
        matrix(&mut w, &mut rng, &n("attn_q"), sh.heads * hd, sh.hidden, ty);
        matrix(&mut w, &mut rng, &n("attn_k"), sh.kv_heads * hd, sh.hidden, ty);
        matrix(&mut w, &mut rng, &n("attn_v"), sh.kv_heads * hd, sh.hidden, ty);
        matrix(&mut w, &mut rng, &n("attn_output"), sh.hidden, sh.heads * hd, ty);
        matrix(&mut w, &mut rng, &n("ffn_gate"), sh.ffn, sh.hidden, ty);
        matrix(&mut w, &mut rng, &n("ffn_up"), sh.ffn, sh.hidden, ty);
        matrix(&mut w, &mut rng, &n("ffn_down"), sh.hidden, sh.ffn, ty);
        if arch == "qwen2" {
            let b = |s: &str| format!("blk.{l}.{s}.bias");
            vector(&mut w, &mut rng, &b("attn_q"), sh.heads * hd, 0.0);
            vector(&mut w, &mut rng, &b("attn_k"), sh.kv_heads * hd, 0.0);
            vector(&mut w, &mut rng, &b("attn_v"), sh.kv_heads * hd, 0.0);
        }
        if arch == "qwen3" || arch == "gemma3" {
            vector(&mut w, &mut rng, &n("attn_q_norm"), hd, 1.0);
            vector(&mut w, &mut rng, &n("attn_k_norm"), hd, 1.0);
        }
        if arch == "gemma3" {
            vector(&mut w, &mut rng, &n("post_attention_norm"), sh.hidden, 1.0);
            vector(&mut w, &mut rng, &n("post_ffw_norm"), sh.hidden, 1.0);
        }
    }
    w
}

/// The models compared with llama.cpp: the architectures with no small real model here.
/// llama.cpp ignores a sliding window on `llama`/`mistral`, so the window is checked on
/// gemma3 (whose three layers are all local ones).
pub const LLAMACPP_TINY: [(&str, Option<u32>); 4] = [("qwen2", None), ("qwen3", None), ("llama", None), ("gemma3", Some(8))];

/// `arch`'s model in [`LLAMACPP_TINY`] with a SentencePiece vocabulary llama.cpp loads
/// (specials, the 256 byte tokens, filler pieces): llama.cpp is driven by token ids, so
/// only its presence matters.
pub fn llamacpp_tiny(arch: &str, window: Option<u32>) -> GgufWriter {
    let sh = Shape { vocab: 300, hidden: 64, ffn: 128, heads: 4, kv_heads: 2, layers: 3 };
    let mut w = model(GgmlType::Q8_0, arch, sh, window);
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    let first_piece = tokens.len();
    tokens.extend((first_piece..sh.vocab).map(|i| format!("\u{2581}p{i}")));
    let types = (0..sh.vocab).map(|i| {
        Value::I32(match i {
            0 => 2,
            1 | 2 => 3,
            _ if i < first_piece => 6,
            _ => 1,
        })
    });
    w.meta("tokenizer.ggml.model", Value::String("llama".into()))
        .meta("tokenizer.ggml.tokens", Value::Array(tokens.into_iter().map(Value::String).collect()))
        .meta("tokenizer.ggml.scores", Value::Array((0..sh.vocab).map(|i| Value::F32(-(i as f32))).collect()))
        .meta("tokenizer.ggml.token_type", Value::Array(types.collect()))
        .meta("tokenizer.ggml.unknown_token_id", Value::U32(0))
        .meta("tokenizer.ggml.bos_token_id", Value::U32(1))
        .meta("tokenizer.ggml.eos_token_id", Value::U32(2));
    w
}
