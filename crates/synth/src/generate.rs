//! The generator: a plan of every tensor (metadata and table first, so that the file's size
//! and every offset are known before a weight exists), then each matrix generated and
//! quantised a block of rows at a time and written straight out.
//!
//! Weights are uniform with standard deviation `1/√fan_in` (`fan_in` = the matrix's input
//! features), norms 1, Qwen's biases small. Every row draws from its own SplitMix64 stream,
//! seeded from the seed, the tensor's name and the row, so rows are generated in parallel
//! and the bytes depend only on the seed, never on the thread count.

use std::io::{self, Write};

use bulkhead_gguf::{GgmlType, GgufFile, GgufWriter, Value};
use bulkhead_model::quant::quantize_row;
use rayon::prelude::*;

use crate::quant::Role;
use crate::{Quant, Shape, SynthError, vocab};

/// What to generate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spec {
    /// The shape.
    pub shape: Shape,
    /// The quantisation.
    pub quant: Quant,
    /// Seed of every weight.
    pub seed: u64,
    /// The context length to write instead of the shape's (a smaller one keeps a server's
    /// KV reservation small).
    pub context: Option<usize>,
}

/// A matrix whose bytes are generated when the stream reaches it.
#[derive(Debug, Clone)]
pub(crate) struct MatrixPlan {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub ty: GgmlType,
}

impl MatrixPlan {
    pub fn bytes(&self) -> u64 {
        self.ty.bytes_for((self.rows * self.cols) as u64).unwrap_or(0)
    }
}

/// The file: its writer (metadata, vectors held, matrices declared for later, or held too
/// with `held`) and its matrices in table order.
pub(crate) struct Plan {
    pub writer: GgufWriter,
    pub matrices: Vec<MatrixPlan>,
}

/// Elements generated per parallel batch of rows (a few MB of floats).
const BATCH_ELEMS: usize = 1 << 20;

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of a tensor's name: its stream id, so that adding a tensor moves no other's bytes.
fn name_id(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3))
}

/// Row `row` of tensor `id`: `n` values uniform in `[-amp, amp)`.
fn row_values(seed: u64, id: u64, row: usize, n: usize, amp: f32, out: &mut Vec<f32>) {
    let mut s = seed;
    let mut s = splitmix(&mut s) ^ id;
    let mut s = splitmix(&mut s) ^ row as u64;
    out.clear();
    out.extend((0..n).map(|_| {
        let u = (splitmix(&mut s) >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * u - 1.0) * amp
    }));
}

/// Generate `m`'s rows a batch at a time (in parallel within a batch), quantised, handing
/// each batch's bytes to `sink` in row order.
pub(crate) fn generate_matrix(seed: u64, m: &MatrixPlan, mut sink: impl FnMut(&[u8]) -> io::Result<()>) -> io::Result<()> {
    let id = name_id(&m.name);
    // Uniform on [-a, a) has standard deviation a/√3.
    let amp = (3.0 / m.cols as f32).sqrt();
    let batch = (BATCH_ELEMS / m.cols).max(1);
    let mut bytes = Vec::new();
    for r0 in (0..m.rows).step_by(batch) {
        let rows: Vec<Vec<u8>> = (r0..(r0 + batch).min(m.rows))
            .into_par_iter()
            .map_init(Vec::new, |vals, r| {
                row_values(seed, id, r, m.cols, amp, vals);
                quantize_row(m.ty, vals)
            })
            .collect();
        bytes.clear();
        rows.iter().for_each(|r| bytes.extend_from_slice(r));
        sink(&bytes)?;
    }
    Ok(())
}

/// The plan of `spec`'s file with `donor`'s vocabulary; `held` generates the matrices now
/// and holds them in the writer (small files, tests), else declares them for streaming.
pub(crate) fn plan(spec: &Spec, donor: &GgufFile, held: bool) -> Result<Plan, SynthError> {
    let s = &spec.shape;
    let context = spec.context.unwrap_or(s.context);
    if context == 0 {
        return Err(SynthError::BadContext { context });
    }
    let mut w = GgufWriter::new();
    let a = s.arch;
    let k = |key: &str| format!("{a}.{key}");
    let u = |n: usize| Value::U32(n as u32);
    w.meta("general.architecture", Value::String(a.into()))
        .meta("general.type", Value::String("model".into()))
        .meta("general.name", Value::String(format!("synthetic {} {} (random weights, seed {})", s.name, spec.quant, spec.seed)))
        .meta("general.file_type", Value::U32(spec.quant.file_type()))
        .meta("general.quantization_version", Value::U32(2))
        .meta("bulkhead.synth.shape", Value::String(s.name.into()))
        .meta("bulkhead.synth.seed", Value::U64(spec.seed))
        .meta(&k("context_length"), u(context))
        .meta(&k("embedding_length"), u(s.hidden))
        .meta(&k("block_count"), u(s.layers))
        .meta(&k("feed_forward_length"), u(s.ffn))
        .meta(&k("attention.head_count"), u(s.heads))
        .meta(&k("attention.head_count_kv"), u(s.kv_heads))
        .meta(&k("attention.key_length"), u(s.head_dim))
        .meta(&k("attention.value_length"), u(s.head_dim))
        .meta(&k("rope.dimension_count"), u(s.head_dim))
        .meta(&k("rope.freq_base"), Value::F32(s.rope_theta))
        .meta(&k("attention.layer_norm_rms_epsilon"), Value::F32(s.norm_eps))
        .meta(&k("vocab_size"), u(s.vocab));
    if let Some(win) = s.sliding_window {
        w.meta(&k("attention.sliding_window"), u(win));
    }
    for (key, v) in vocab::fit(donor, s.vocab)? {
        w.meta(&key, v);
    }

    let mut matrices = Vec::new();
    let mut matrix = |w: &mut GgufWriter, name: String, rows: usize, cols: usize, role: Role, layer: usize| -> Result<(), SynthError> {
        let ty = spec.quant.tensor_type(role, layer, s.layers, cols, s.tied);
        let m = MatrixPlan { name, rows, cols, ty };
        if held {
            let mut bytes = Vec::with_capacity(m.bytes() as usize);
            generate_matrix(spec.seed, &m, |b| {
                bytes.extend_from_slice(b);
                Ok(())
            })
            .map_err(|e| SynthError::Generate { why: e.to_string() })?;
            w.tensor(&m.name, &[cols as u64, rows as u64], ty, bytes);
        } else {
            w.tensor_later(&m.name, &[cols as u64, rows as u64], ty)?;
        }
        matrices.push(m);
        Ok(())
    };
    let ones = |w: &mut GgufWriter, name: &str, n: usize| {
        w.tensor_f32(name, &[n as u64], &vec![1.0; n]);
    };
    let (h, q, kv) = (s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim);
    matrix(&mut w, "token_embd.weight".into(), s.vocab, h, Role::Embedding, 0)?;
    if let Some(f) = s.rope_factors() {
        w.tensor_f32("rope_freqs.weight", &[f.len() as u64], &f);
    }
    for l in 0..s.layers {
        let n = |t: &str| format!("blk.{l}.{t}.weight");
        ones(&mut w, &n("attn_norm"), h);
        matrix(&mut w, n("attn_q"), q, h, Role::Other, l)?;
        matrix(&mut w, n("attn_k"), kv, h, Role::Other, l)?;
        matrix(&mut w, n("attn_v"), kv, h, Role::AttnV, l)?;
        if s.qkv_bias {
            for (t, len) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
                let name = format!("blk.{l}.{t}.bias");
                let mut v = Vec::new();
                row_values(spec.seed, name_id(&name), 0, len, 0.02, &mut v);
                w.tensor_f32(&name, &[len as u64], &v);
            }
        }
        if a == "gemma3" {
            ones(&mut w, &n("attn_q_norm"), s.head_dim);
            ones(&mut w, &n("attn_k_norm"), s.head_dim);
        }
        matrix(&mut w, n("attn_output"), h, q, Role::Other, l)?;
        if a == "gemma3" {
            ones(&mut w, &n("post_attention_norm"), h);
        }
        ones(&mut w, &n("ffn_norm"), h);
        matrix(&mut w, n("ffn_gate"), s.ffn, h, Role::Other, l)?;
        matrix(&mut w, n("ffn_up"), s.ffn, h, Role::Other, l)?;
        matrix(&mut w, n("ffn_down"), h, s.ffn, Role::FfnDown, l)?;
        if a == "gemma3" {
            ones(&mut w, &n("post_ffw_norm"), h);
        }
    }
    ones(&mut w, "output_norm.weight", h);
    if !s.tied {
        matrix(&mut w, "output.weight".into(), s.vocab, h, Role::Output, s.layers)?;
    }
    Ok(Plan { writer: w, matrices })
}

/// Stream `plan`'s file to `out`, generating each matrix as its turn comes; `progress` is
/// told the bytes of matrices written so far and their total after each matrix.
pub(crate) fn stream<W: Write>(plan: &Plan, seed: u64, out: W, progress: &mut dyn FnMut(u64, u64)) -> io::Result<W> {
    let total: u64 = plan.matrices.iter().map(MatrixPlan::bytes).sum();
    let mut done = 0;
    let mut s = plan.writer.stream(out)?;
    for m in &plan.matrices {
        match s.next_tensor()? {
            Some((name, _)) if name == m.name => {}
            other => {
                let next = other.map(|t| t.0.to_string());
                return Err(io::Error::other(format!("the stream wants {next:?}, the plan has `{}`", m.name)));
            }
        }
        generate_matrix(seed, m, |b| s.write(b))?;
        done += m.bytes();
        progress(done, total);
    }
    s.finish()
}
