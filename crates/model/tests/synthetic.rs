//! Tiny synthetic models written as GGUF files: every supported tensor type and every
//! architecture loads and runs (paged pass bit-identical to the reference), each family's
//! parts take effect, and bad files fail with errors that name what is wrong.

use bulkhead_gguf::{GgmlType, GgufFile, GgufWriter, Value};
use bulkhead_kv::{KvPool, KvChecks, PoolConfig, RequestId, SequenceKv};
use bulkhead_model::quant::quantize_row;
use bulkhead_model::reference::ReferenceState;
use bulkhead_model::{Isa, Llama, ModelError, SeqInput};

const VOCAB: usize = 50;
const LAYERS: usize = 2;

/// A tiny model's shape: wide enough for its weight type's blocks (k-quants need 256
/// columns).
#[derive(Clone, Copy)]
struct Shape {
    hidden: usize,
    ffn: usize,
    heads: usize,
    kv_heads: usize,
    layers: usize,
}

const SMALL: Shape = Shape { hidden: 64, ffn: 96, heads: 4, kv_heads: 2, layers: LAYERS };
const WIDE: Shape = Shape { hidden: 256, ffn: 256, heads: 4, kv_heads: 2, layers: LAYERS };

fn shape_for(ty: GgmlType) -> Shape {
    if ty.block().is_some_and(|b| b.0 == 256) { WIDE } else { SMALL }
}

struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
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

fn synthetic(ty: GgmlType, arch: &str) -> GgufWriter {
    synthetic_shaped(ty, arch, shape_for(ty), None)
}

/// A tiny random model of `arch` (llama, mistral, qwen2, qwen3, gemma3) with its layer
/// matrices in `ty`, and a sliding window of `window` tokens where given.
fn synthetic_shaped(ty: GgmlType, arch: &str, sh: Shape, window: Option<u32>) -> GgufWriter {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut w = GgufWriter::new();
    let hd = sh.hidden / sh.heads;
    w.meta("general.architecture", Value::String(arch.into()))
        .meta(&format!("{arch}.block_count"), Value::U32(sh.layers as u32))
        .meta(&format!("{arch}.context_length"), Value::U32(256))
        .meta(&format!("{arch}.embedding_length"), Value::U32(sh.hidden as u32))
        .meta(&format!("{arch}.feed_forward_length"), Value::U32(sh.ffn as u32))
        .meta(&format!("{arch}.attention.head_count"), Value::U32(sh.heads as u32))
        .meta(&format!("{arch}.attention.head_count_kv"), Value::U32(sh.kv_heads as u32))
        .meta(&format!("{arch}.rope.freq_base"), Value::F32(10000.0))
        .meta(&format!("{arch}.attention.layer_norm_rms_epsilon"), Value::F32(1e-5));
    if let Some(win) = window {
        w.meta(&format!("{arch}.attention.sliding_window"), Value::U32(win));
    }
    matrix(&mut w, &mut rng, "token_embd.weight", VOCAB, sh.hidden, GgmlType::Q8_0);
    let ones = vec![1.0f32; sh.hidden];
    w.tensor_f32("output_norm.weight", &[sh.hidden as u64], &ones);
    // Gemma 3 ties the output to the embedding.
    if arch != "gemma3" {
        matrix(&mut w, &mut rng, "output.weight", VOCAB, sh.hidden, ty);
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

fn load(w: &GgufWriter) -> Result<Llama, ModelError> {
    Llama::from_gguf(&GgufFile::parse(w.to_bytes())?, 2)
}

/// The paged pass's logits for `prompt` (one call) and the reference pass's, on `m`.
fn paged_and_reference(m: &Llama, prompt: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let mut st = ReferenceState::default();
    let mut want = Vec::new();
    for &t in prompt {
        want = m.reference_step(&mut st, t);
    }
    let mut pool = KvPool::new(PoolConfig { layout: m.kv_layout(8), pages: 8, checks: KvChecks::all() }).unwrap();
    let mut kv = SequenceKv::new(RequestId(1));
    kv.reserve(&mut pool, prompt.len()).unwrap();
    let got = m.forward(&mut pool, &mut [SeqInput { kv: &mut kv, tokens: prompt, want_logits: true }]).unwrap();
    (got, want)
}

fn prompt() -> Vec<u32> {
    (0..37).map(|i| (i * 7 % VOCAB) as u32).collect()
}

#[test]
fn every_supported_tensor_type_runs_and_the_paged_pass_equals_the_reference() {
    for ty in GgmlType::known() {
        for isa in Isa::available() {
            let m = load(&synthetic(ty, "llama")).unwrap().with_isa(isa);
            let (got, want) = paged_and_reference(&m, &prompt());
            assert!(want.iter().all(|v| v.is_finite()));
            assert_eq!(got, want, "{ty} on {isa:?}: paged logits differ from the reference");
        }
    }
}

#[test]
fn every_architecture_runs_and_the_paged_pass_equals_the_reference() {
    for arch in bulkhead_model::config::SUPPORTED {
        for (ty, window) in [(GgmlType::Q8_0, None), (GgmlType::Q4_K, Some(9))] {
            for isa in Isa::available() {
                let m = load(&synthetic_shaped(ty, arch, shape_for(ty), window)).unwrap().with_isa(isa);
                let (got, want) = paged_and_reference(&m, &prompt());
                assert!(want.iter().all(|v| v.is_finite()), "{arch}");
                assert_eq!(got, want, "{arch} {ty} window {window:?} on {isa:?}: paged logits differ from the reference");
            }
        }
    }
}

/// Each family's extra parts change the output (they are read and applied), and a sliding
/// window changes it only once the prompt is longer than the window.
#[test]
fn every_family_part_and_the_sliding_window_take_effect() {
    let logits = |w: &GgufWriter, prompt: &[u32]| paged_and_reference(&load(w).unwrap(), prompt).0;
    let p = prompt();
    let plain = logits(&synthetic(GgmlType::Q8_0, "mistral"), &p);
    for arch in ["llama", "qwen2", "qwen3", "gemma3"] {
        assert_ne!(logits(&synthetic(GgmlType::Q8_0, arch), &p), plain, "{arch} computes what mistral (plain llama) does");
    }
    let windowed = synthetic_shaped(GgmlType::Q8_0, "mistral", SMALL, Some(9));
    assert_eq!(logits(&windowed, &p[..9]), logits(&synthetic(GgmlType::Q8_0, "mistral"), &p[..9]), "within the window nothing is masked");
    assert_ne!(logits(&windowed, &p), plain, "past the window, early positions are masked");
}

#[test]
fn an_unsupported_architecture_is_named() {
    let err = load(&synthetic(GgmlType::Q8_0, "mamba")).unwrap_err().to_string();
    assert!(err.contains("mamba") && err.contains("general.architecture"), "{err}");
}

#[test]
fn an_unsupported_tensor_type_names_the_tensor_and_type() {
    let mut w = synthetic(GgmlType::Q8_0, "llama");
    // IQ2_XXS (ggml type 16): a layout this reader does not know.
    w.tensor("blk.1.ffn_up.weight.bogus", &[32], GgmlType::Other(16), vec![0; 22]);
    let f = GgufFile::parse(w.to_bytes()).unwrap();
    assert!(f.tensor("blk.1.ffn_up.weight.bogus").is_err());
    let mut w = GgufWriter::new();
    let good = synthetic(GgmlType::Q8_0, "llama").to_bytes();
    let f = GgufFile::parse(good).unwrap();
    for (k, v) in f.metadata() {
        w.meta(k, v.clone());
    }
    for t in f.tensors() {
        let (_, b) = f.tensor(&t.name).unwrap();
        if t.name == "blk.0.attn_q.weight" {
            w.tensor(&t.name, &t.dims, GgmlType::Other(16), vec![0; 22 * (t.elems() as usize / 32)]);
        } else {
            w.tensor(&t.name, &t.dims, t.ty, b.to_vec());
        }
    }
    let err = load(&w).unwrap_err().to_string();
    assert!(err.contains("blk.0.attn_q.weight") && err.contains("type 16"), "{err}");
}

#[test]
fn a_missing_hyperparameter_or_tensor_is_named() {
    let good = synthetic(GgmlType::Q8_0, "llama").to_bytes();
    let f = GgufFile::parse(good).unwrap();
    for drop in ["llama.attention.head_count", "blk.1.ffn_down.weight"] {
        let mut w = GgufWriter::new();
        for (k, v) in f.metadata().iter().filter(|(k, _)| *k != drop) {
            w.meta(k, v.clone());
        }
        for t in f.tensors().iter().filter(|t| t.name != drop) {
            w.tensor(&t.name, &t.dims, t.ty, f.tensor(&t.name).unwrap().1.to_vec());
        }
        let err = load(&w).unwrap_err().to_string();
        assert!(err.contains(drop), "dropping {drop}: {err}");
    }
}

#[test]
fn a_truncated_model_file_is_an_error_naming_the_file() {
    let bytes = synthetic(GgmlType::Q4_1, "llama").to_bytes();
    let dir = std::env::temp_dir().join(format!("bulkhead-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for cut in [10, bytes.len() / 3, bytes.len() - 40] {
        let p = dir.join(format!("cut{cut}.gguf"));
        std::fs::write(&p, &bytes[..cut]).unwrap();
        let err = Llama::load(&p, 1).unwrap_err().to_string();
        assert!(err.contains(&p.display().to_string()), "{err}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn positions_past_the_context_or_unreserved_and_bad_tokens_are_errors_not_panics() {
    let m = load(&synthetic(GgmlType::Q8_0, "llama")).unwrap();
    let mut pool = KvPool::new(PoolConfig { layout: m.kv_layout(16), pages: 32, checks: KvChecks::all() }).unwrap();
    let mut kv = SequenceKv::new(RequestId(1));
    kv.reserve(&mut pool, 300).unwrap();
    let long = vec![1u32; 257];
    let e = m.forward(&mut pool, &mut [SeqInput { kv: &mut kv, tokens: &long, want_logits: true }]).unwrap_err();
    assert!(matches!(e, ModelError::ContextOverflow { needed: 257, context: 256 }), "{e}");
    let e = m.forward(&mut pool, &mut [SeqInput { kv: &mut kv, tokens: &[VOCAB as u32], want_logits: true }]).unwrap_err();
    assert!(matches!(e, ModelError::TokenOutOfRange { .. }), "{e}");
    let mut small = SequenceKv::new(RequestId(2));
    small.reserve(&mut pool, 4).unwrap();
    let e = m.forward(&mut pool, &mut [SeqInput { kv: &mut small, tokens: &[1; 20], want_logits: true }]).unwrap_err();
    assert!(matches!(e, ModelError::Kv(_)), "{e}");
}
