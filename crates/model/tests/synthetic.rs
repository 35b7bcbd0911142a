//! Tiny synthetic llama models written as GGUF files: every supported tensor type loads and
//! runs (paged pass bit-identical to the reference), and bad files fail with errors that
//! name what is wrong.

use bulkhead_gguf::{GgmlType, GgufFile, GgufWriter, Value};
use bulkhead_kv::{KvPool, KvChecks, PoolConfig, RequestId, SequenceKv};
use bulkhead_model::quant::quantize_row;
use bulkhead_model::reference::ReferenceState;
use bulkhead_model::{Isa, Llama, ModelError, SeqInput};

const HIDDEN: usize = 64;
const FFN: usize = 96;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const VOCAB: usize = 50;
const LAYERS: usize = 2;

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

fn synthetic(ty: GgmlType, arch: &str) -> GgufWriter {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut w = GgufWriter::new();
    w.meta("general.architecture", Value::String(arch.into()))
        .meta(&format!("{arch}.block_count"), Value::U32(LAYERS as u32))
        .meta(&format!("{arch}.context_length"), Value::U32(256))
        .meta(&format!("{arch}.embedding_length"), Value::U32(HIDDEN as u32))
        .meta(&format!("{arch}.feed_forward_length"), Value::U32(FFN as u32))
        .meta(&format!("{arch}.attention.head_count"), Value::U32(HEADS as u32))
        .meta(&format!("{arch}.attention.head_count_kv"), Value::U32(KV_HEADS as u32))
        .meta(&format!("{arch}.rope.freq_base"), Value::F32(10000.0))
        .meta(&format!("{arch}.attention.layer_norm_rms_epsilon"), Value::F32(1e-5));
    matrix(&mut w, &mut rng, "token_embd.weight", VOCAB, HIDDEN, GgmlType::Q8_0);
    let ones = vec![1.0f32; HIDDEN];
    w.tensor_f32("output_norm.weight", &[HIDDEN as u64], &ones);
    matrix(&mut w, &mut rng, "output.weight", VOCAB, HIDDEN, ty);
    let hd = HIDDEN / HEADS;
    for l in 0..LAYERS {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        w.tensor_f32(&n("attn_norm"), &[HIDDEN as u64], &ones);
        w.tensor_f32(&n("ffn_norm"), &[HIDDEN as u64], &ones);
        matrix(&mut w, &mut rng, &n("attn_q"), HIDDEN, HIDDEN, ty);
        matrix(&mut w, &mut rng, &n("attn_k"), KV_HEADS * hd, HIDDEN, ty);
        matrix(&mut w, &mut rng, &n("attn_v"), KV_HEADS * hd, HIDDEN, ty);
        matrix(&mut w, &mut rng, &n("attn_output"), HIDDEN, HIDDEN, ty);
        matrix(&mut w, &mut rng, &n("ffn_gate"), FFN, HIDDEN, ty);
        matrix(&mut w, &mut rng, &n("ffn_up"), FFN, HIDDEN, ty);
        matrix(&mut w, &mut rng, &n("ffn_down"), HIDDEN, FFN, ty);
    }
    w
}

fn load(w: &GgufWriter) -> Result<Llama, ModelError> {
    Llama::from_gguf(&GgufFile::parse(w.to_bytes())?, 2)
}

#[test]
fn every_supported_tensor_type_runs_and_the_paged_pass_equals_the_reference() {
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::F16, GgmlType::F32] {
        for isa in Isa::available() {
            let m = load(&synthetic(ty, "llama")).unwrap().with_isa(isa);
            let prompt: Vec<u32> = (0..37).map(|i| (i * 7 % VOCAB) as u32).collect();
            let mut st = ReferenceState::default();
            let mut want = Vec::new();
            for &t in &prompt {
                want = m.reference_step(&mut st, t);
            }
            let mut pool = KvPool::new(PoolConfig { layout: m.kv_layout(8), pages: 8, checks: KvChecks::all() }).unwrap();
            let mut kv = SequenceKv::new(RequestId(1));
            kv.reserve(&mut pool, prompt.len()).unwrap();
            let got = m.forward(&mut pool, &mut [SeqInput { kv: &mut kv, tokens: &prompt, want_logits: true }]).unwrap();
            assert!(want.iter().all(|v| v.is_finite()));
            assert_eq!(got, want, "{ty} on {isa:?}: paged logits differ from the reference");
        }
    }
}

#[test]
fn an_unsupported_architecture_is_named() {
    let err = load(&synthetic(GgmlType::Q8_0, "mamba")).unwrap_err().to_string();
    assert!(err.contains("mamba") && err.contains("general.architecture"), "{err}");
}

#[test]
fn an_unsupported_tensor_type_names_the_tensor_and_type() {
    let mut w = synthetic(GgmlType::Q8_0, "llama");
    // Q5_0 (ggml type 6): 22 bytes per 32 elements.
    w.tensor("blk.1.ffn_up.weight.bogus", &[32], GgmlType::Other(6), vec![0; 22]);
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
            w.tensor(&t.name, &t.dims, GgmlType::Other(6), vec![0; 22 * (t.elems() as usize / 32)]);
        } else {
            w.tensor(&t.name, &t.dims, t.ty, b.to_vec());
        }
    }
    let err = load(&w).unwrap_err().to_string();
    assert!(err.contains("blk.0.attn_q.weight") && err.contains("type 6"), "{err}");
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
