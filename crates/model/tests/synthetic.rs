//! Tiny synthetic models written as GGUF files: every supported tensor type and every
//! architecture loads and runs (paged pass bit-identical to the reference), each family's
//! parts take effect, and bad files fail with errors that name what is wrong.

use bulkhead_gguf::{GgmlType, GgufFile, GgufWriter};
use bulkhead_kv::{KvChecks, KvPool, PoolConfig, RequestId, SequenceKv};
use bulkhead_model::reference::ReferenceState;
use bulkhead_model::{CoreShare, Isa, Llama, ModelError, SeqInput, Sums};

mod support;
use support::Shape;

const VOCAB: usize = 50;
const LAYERS: usize = 2;

/// Wide enough for the weight type's blocks (k-quants need 256 columns).
const SMALL: Shape = Shape { vocab: VOCAB, hidden: 64, ffn: 96, heads: 4, kv_heads: 2, layers: LAYERS };
const WIDE: Shape = Shape { vocab: VOCAB, hidden: 256, ffn: 256, heads: 4, kv_heads: 2, layers: LAYERS };

fn shape_for(ty: GgmlType) -> Shape {
    if ty.block().is_some_and(|b| b.0 == 256) { WIDE } else { SMALL }
}

fn synthetic(ty: GgmlType, arch: &str) -> GgufWriter {
    support::model(ty, arch, shape_for(ty), None)
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
    let got = m.forward(&mut pool, &mut [SeqInput { kv: &mut kv, tokens: prompt, logit_rows: 1 }]).unwrap();
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

/// `set_sums` re-lays the weights out where the arithmetic decides the layout (AVX2: packed
/// for block sums, rows for lane sums): a model switched either way computes what a model
/// loaded for that arithmetic computes, and switching back gives its first logits again.
#[test]
fn switching_the_arithmetic_relays_the_weights_out_losslessly() {
    for ty in [GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K] {
        let w = synthetic(ty, "llama");
        for isa in Isa::available() {
            let logits = |m: &Llama| paged_and_reference(m, &prompt()).0;
            let mut m = load(&w).unwrap().with_isa(isa.with_sums(Sums::Blocks));
            let blocks = logits(&m);
            m.set_sums(Sums::Lanes);
            let lanes = load(&w).unwrap().with_isa(isa.with_sums(Sums::Lanes));
            assert_eq!(logits(&m), logits(&lanes), "{ty} on {isa:?}: switched to lanes");
            m.set_sums(Sums::Blocks);
            assert_eq!(logits(&m), blocks, "{ty} on {isa:?}: switched back to blocks");
        }
    }
}

/// Counts its pauses and makes each one wait, as a prefill worker's does during a decode
/// step; narrows every other layer, as either worker's does while the other computes.
struct SlowShare {
    pauses: std::sync::atomic::AtomicUsize,
    asked: std::sync::atomic::AtomicUsize,
}

impl CoreShare for SlowShare {
    fn pause(&self) {
        self.pauses.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        std::thread::sleep(std::time::Duration::from_millis(1));
    }

    fn narrow(&self) -> bool {
        self.asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed).is_multiple_of(2)
    }
}

#[test]
fn the_forward_pass_pauses_before_each_region_and_narrows_layers_with_the_same_bits() {
    let w = synthetic(GgmlType::Q4_1, "llama");
    let (plain, _) = paged_and_reference(&load(&w).unwrap(), &prompt());
    let share = std::sync::Arc::new(SlowShare { pauses: Default::default(), asked: Default::default() });
    let mut m = load(&w).unwrap();
    m.set_core_share(share.clone()).unwrap();
    let (shared, want) = paged_and_reference(&m, &prompt());
    // Five regions a layer: QKV, attention, output, gate and up, down.
    assert_eq!(share.pauses.load(std::sync::atomic::Ordering::Relaxed), 5 * LAYERS);
    // Asked at every layer and once for the logits of the paged pass (the reference pass
    // runs on its own).
    assert_eq!(share.asked.load(std::sync::atomic::Ordering::Relaxed), LAYERS + 1);
    assert_eq!(shared, plain);
    assert_eq!(shared, want);
}

#[test]
fn every_architecture_runs_and_the_paged_pass_equals_the_reference() {
    for arch in bulkhead_model::config::SUPPORTED {
        for (ty, window) in [(GgmlType::Q8_0, None), (GgmlType::Q4_K, Some(9))] {
            for isa in Isa::available() {
                let m = load(&support::model(ty, arch, shape_for(ty), window)).unwrap().with_isa(isa);
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
    let windowed = support::model(GgmlType::Q8_0, "mistral", SMALL, Some(9));
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

/// A tensor of the wrong shape for its architecture (here K with Q's rows, which a GQA
/// model must not have) is a start-up error naming it.
#[test]
fn a_tensor_whose_shape_does_not_match_the_architecture_is_named() {
    let f = GgufFile::parse(synthetic(GgmlType::Q8_0, "qwen3").to_bytes()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata() {
        w.meta(k, v.clone());
    }
    let (q_info, q_bytes) = f.tensor("blk.0.attn_q.weight").unwrap();
    for t in f.tensors() {
        if t.name == "blk.0.attn_k.weight" {
            w.tensor(&t.name, &q_info.dims, q_info.ty, q_bytes.to_vec());
        } else {
            w.tensor(&t.name, &t.dims, t.ty, f.tensor(&t.name).unwrap().1.to_vec());
        }
    }
    let err = load(&w).unwrap_err().to_string();
    assert!(err.contains("blk.0.attn_k.weight") && err.contains("expected"), "{err}");
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
    let e = m.forward(&mut pool, &mut [SeqInput { kv: &mut kv, tokens: &long, logit_rows: 1 }]).unwrap_err();
    assert!(matches!(e, ModelError::ContextOverflow { needed: 257, context: 256 }), "{e}");
    let e = m.forward(&mut pool, &mut [SeqInput { kv: &mut kv, tokens: &[VOCAB as u32], logit_rows: 1 }]).unwrap_err();
    assert!(matches!(e, ModelError::TokenOutOfRange { .. }), "{e}");
    let mut small = SequenceKv::new(RequestId(2));
    small.reserve(&mut pool, 4).unwrap();
    let e = m.forward(&mut pool, &mut [SeqInput { kv: &mut small, tokens: &[1; 20], logit_rows: 1 }]).unwrap_err();
    assert!(matches!(e, ModelError::Kv(_)), "{e}");
}

/// Logits at every position of `tokens` from the paged pass: prefill in chunks of `chunk`
/// (each row's logits), then one token a step, `seqs` copies of the sequence decoding side
/// by side in one batch. Every copy must give the same logits; the first copy's returned.
fn paged_every_position(m: &Llama, tokens: &[u32], page_size: usize, chunk: usize, decoded: usize, seqs: usize) -> Vec<Vec<f32>> {
    let vocab = m.config.vocab;
    let mut pool = KvPool::new(PoolConfig { layout: m.kv_layout(page_size), pages: 64, checks: KvChecks::all() }).unwrap();
    let mut kvs: Vec<SequenceKv> = (0..seqs).map(|i| SequenceKv::new(RequestId(i as u64))).collect();
    for kv in &mut kvs {
        kv.reserve(&mut pool, tokens.len()).unwrap();
    }
    let prefilled = tokens.len() - decoded;
    let mut out = Vec::new();
    for c in tokens[..prefilled].chunks(chunk) {
        for (i, kv) in kvs.iter_mut().enumerate() {
            let l = m.forward(&mut pool, &mut [SeqInput { kv, tokens: c, logit_rows: c.len() }]).unwrap();
            if i == 0 {
                out.extend(l.chunks(vocab).map(<[f32]>::to_vec));
            }
        }
    }
    for t in &tokens[prefilled..] {
        let one = [*t];
        let mut inputs: Vec<SeqInput> = kvs.iter_mut().map(|kv| SeqInput { kv, tokens: &one, logit_rows: 1 }).collect();
        let l = m.forward(&mut pool, &mut inputs).unwrap();
        assert!(l.chunks(vocab).all(|r| r == &l[..vocab]), "copies of one sequence differ in a batch");
        out.push(l[..vocab].to_vec());
    }
    out
}

/// A row's keys split at fixed positions (the key span), each span's softmax folded into
/// the next: prefill whole or in chunks (a task's spans folded in it), decode alone or
/// batched (a task a span, folded after), on one thread or two, with pages
/// that do not divide the span, all give the reference pass's bits; and rows past the first
/// span differ from an unsplit softmax (the split is reached), rows within it do not.
/// Gemma 3's seven layers put its one global layer (the sixth) between windowed ones, whose
/// rows split into other spans.
#[test]
fn key_spans_fold_to_the_same_bits_in_every_path_and_every_split() {
    let tokens: Vec<u32> = (0..45).map(|i| (i * 11 % VOCAB) as u32).collect();
    for (arch, window, layers) in [("llama", None, LAYERS), ("gemma3", Some(13), 7)] {
        // F32 weights: no 8-bit activations between layers to round a fold's last bits away.
        let w = support::model(GgmlType::F32, arch, Shape { layers, ..SMALL }, window);
        let f = GgufFile::parse(w.to_bytes()).unwrap();
        let unsplit = paged_every_position(&Llama::from_gguf(&f, 2).unwrap(), &tokens, 8, 45, 0, 1);
        for threads in [1, 2] {
            let mut m = Llama::from_gguf(&f, threads).unwrap();
            m.set_key_span(8);
            let mut st = ReferenceState::default();
            let want: Vec<Vec<f32>> = tokens.iter().map(|&t| m.reference_step(&mut st, t)).collect();
            assert!(want[..8] == unsplit[..8], "{arch}: rows within the first span keep an unsplit softmax's bits");
            // (Gemma 3's GELU goes through an f16 table, which can round a fold's last bits away.)
            assert!((8..45).any(|p| want[p] != unsplit[p]), "{arch}: rows past it fold spans");
            for (page_size, chunk, decoded, seqs) in [(8, 45, 0, 1), (5, 7, 20, 1), (3, 45, 12, 3)] {
                let got = paged_every_position(&m, &tokens, page_size, chunk, decoded, seqs);
                for (p, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        g == w,
                        "{arch} {threads} threads, pages of {page_size}, chunks of {chunk}, {decoded} decoded, batch {seqs}: position {p}"
                    );
                }
            }
        }
    }
}
