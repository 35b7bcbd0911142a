//! The forward pass over paged KV for a batch of sequences.
//!
//! One call takes any mix of prefill chunks (many tokens of one sequence) and decode steps
//! (one token each of many sequences): every token is a row of the same matrix products, so
//! each weight is read once per call. KV is written and read only through the sequence's
//! leases ([`bulkhead_kv::KvPool::write`] / [`bulkhead_kv::KvPool::read`]): a stale lease or a
//! slot past a page's watermark is an error, never a read.

use bulkhead_kv::{KvPool, SequenceKv};
use rayon::prelude::*;

use crate::kernels::{dot_f16_rows, weighted_sum_f16, Isa};
use crate::matmul::{matmul, MatmulScratch};
use crate::{Llama, ModelError};

/// One sequence's part of a forward call.
pub struct SeqInput<'a> {
    /// The sequence's pages; `tokens` go at positions `kv.len()..kv.len() + tokens.len()`,
    /// which must already be reserved.
    pub kv: &'a mut SequenceKv,
    /// New tokens (a prefill chunk, or one decode token).
    pub tokens: &'a [u32],
    /// Whether to return logits for the last of `tokens`.
    pub want_logits: bool,
}

/// Row-wise RMS norm (sum of squares in f64, as ggml does), then scale by `w`.
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let ss: f64 = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let scale = 1.0 / ((ss / n as f64) as f32 + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = (v * scale) * g;
        }
    }
}

/// Rotate adjacent pairs of each head by position (llama's "normal" RoPE; GGUF stores Q and
/// K already permuted for it). Angles are built iteratively in f32, as ggml does.
pub(crate) fn rope(x: &mut [f32], head_dim: usize, pos: usize, base: f32) {
    let scale = base.powf(-2.0 / head_dim as f32);
    for head in x.chunks_exact_mut(head_dim) {
        let mut theta = pos as f32;
        for pair in head.chunks_exact_mut(2) {
            let (s, c) = theta.sin_cos();
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * c - b * s;
            pair[1] = a * s + b * c;
            theta *= scale;
        }
    }
}

/// Softmax of attention scores, max-subtracted.
pub(crate) fn softmax_in_place(s: &mut [f32]) {
    let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in s.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    s.iter_mut().for_each(|v| *v *= inv);
}

pub(crate) fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Attention of one query head at position `pos` (its sequence's KV head `g`) over the
/// positions `0..=pos`, read page by page through the sequence's leases. `scores` is scratch.
#[allow(clippy::too_many_arguments)]
fn attend(
    isa: Isa,
    pool: &KvPool,
    kv: &SequenceKv,
    layer: usize,
    g: usize,
    pos: usize,
    q: &[f32],
    out: &mut [f32],
    scores: &mut Vec<f32>,
) -> Result<(), ModelError> {
    let head_dim = q.len();
    let page_size = pool.layout().page_size;
    let n = pos + 1;
    let pages = n.div_ceil(page_size);
    if kv.leases().len() < pages {
        return Err(ModelError::NotReserved { pos });
    }
    let scale = 1.0 / (head_dim as f32).sqrt();
    scores.clear();
    scores.resize(n, 0.0);
    for (pi, lease) in kv.leases().iter().take(pages).enumerate() {
        let page = pool.read(lease, layer)?;
        let need = (n - pi * page_size).min(page_size);
        if page.len() < need {
            return Err(ModelError::MissingKv { page: lease.page().0, layer, written: page.len(), needed: need });
        }
        let s = &mut scores[pi * page_size..pi * page_size + need];
        dot_f16_rows(isa, &page.k_head(g)[..need * head_dim], q, s);
        s.iter_mut().for_each(|v| *v *= scale);
    }
    softmax_in_place(scores);
    out.fill(0.0);
    for (pi, lease) in kv.leases().iter().take(pages).enumerate() {
        let page = pool.read(lease, layer)?;
        let need = (n - pi * page_size).min(page_size);
        weighted_sum_f16(isa, out, &scores[pi * page_size..pi * page_size + need], &page.v_head(g)[..need * head_dim]);
    }
    Ok(())
}

impl Llama {
    /// Run one forward step over `seqs`, writing their new tokens' KV into `pool` and
    /// returning logits (`vocab` values each) for every sequence with `want_logits`, in order.
    /// On success each sequence's committed length grows by its token count.
    pub fn forward(&self, pool: &mut KvPool, seqs: &mut [SeqInput<'_>]) -> Result<Vec<f32>, ModelError> {
        self.threads.install(|| self.forward_inner(pool, seqs))
    }

    fn forward_inner(&self, pool: &mut KvPool, seqs: &mut [SeqInput<'_>]) -> Result<Vec<f32>, ModelError> {
        let c = &self.config;
        let (hd, group) = (c.head_dim, c.group());
        let (q_dim, kv_dim) = (c.heads * hd, c.kv_heads * hd);
        // Row t of every activation matrix is token t; remember whose and where.
        let mut rows: Vec<(usize, usize)> = Vec::new();
        for (s, seq) in seqs.iter().enumerate() {
            let start = seq.kv.len();
            let end = start + seq.tokens.len();
            if end > c.context_length {
                return Err(ModelError::ContextOverflow { needed: end, context: c.context_length });
            }
            if !seq.tokens.is_empty() {
                seq.kv.locate(end - 1)?;
            }
            for (i, &tok) in seq.tokens.iter().enumerate() {
                if tok as usize >= c.vocab {
                    return Err(ModelError::TokenOutOfRange { token: tok, vocab: c.vocab });
                }
                rows.push((s, start + i));
            }
        }
        let t = rows.len();
        if t == 0 {
            return Err(ModelError::EmptyBatch);
        }
        let mut x = vec![0.0f32; t * c.hidden];
        for (xr, tok) in x.chunks_exact_mut(c.hidden).zip(seqs.iter().flat_map(|s| s.tokens.iter())) {
            self.weights.embedding.dequantize_row(*tok as usize, xr);
        }
        let mut xn = vec![0.0f32; t * c.hidden];
        let (mut q, mut k, mut v) = (vec![0.0f32; t * q_dim], vec![0.0f32; t * kv_dim], vec![0.0f32; t * kv_dim]);
        let mut att = vec![0.0f32; t * q_dim];
        let mut o = vec![0.0f32; t * c.hidden];
        let (mut gate, mut up) = (vec![0.0f32; t * c.ffn], vec![0.0f32; t * c.ffn]);
        let mut scratch = MatmulScratch::default();
        let isa = self.isa;

        for (li, l) in self.weights.layers.iter().enumerate() {
            rms_norm(&x, &l.attn_norm, c.norm_eps, &mut xn);
            matmul(isa, &[&l.wq, &l.wk, &l.wv], &xn, t, &mut scratch, &mut [&mut q, &mut k, &mut v]);
            for (r, &(_, pos)) in rows.iter().enumerate() {
                rope(&mut q[r * q_dim..(r + 1) * q_dim], hd, pos, c.rope_base);
                rope(&mut k[r * kv_dim..(r + 1) * kv_dim], hd, pos, c.rope_base);
            }
            for (r, &(s, pos)) in rows.iter().enumerate() {
                let (lease, slot) = seqs[s].kv.locate(pos)?;
                pool.write(lease, li, slot, &k[r * kv_dim..(r + 1) * kv_dim], &v[r * kv_dim..(r + 1) * kv_dim])?;
            }
            {
                let pool: &KvPool = pool;
                let kvs: Vec<&SequenceKv> = seqs.iter().map(|s| &*s.kv).collect();
                let (rows, q) = (&rows, &q);
                // One task per (token, query head): enough parallelism even for one decode token.
                att.par_chunks_mut(hd).enumerate().try_for_each_init(Vec::new, |scores, (i, out)| {
                    let (r, h) = (i / c.heads, i % c.heads);
                    let (s, pos) = rows[r];
                    let qh = &q[r * q_dim + h * hd..r * q_dim + (h + 1) * hd];
                    attend(isa, pool, kvs[s], li, h / group, pos, qh, out, scores)
                })?;
            }
            matmul(isa, &[&l.wo], &att, t, &mut scratch, &mut [&mut o]);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            rms_norm(&x, &l.ffn_norm, c.norm_eps, &mut xn);
            matmul(isa, &[&l.w_gate, &l.w_up], &xn, t, &mut scratch, &mut [&mut gate, &mut up]);
            silu_mul(&mut gate, &up);
            matmul(isa, &[&l.w_down], &gate, t, &mut scratch, &mut [&mut o]);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        }

        // Logits only for the last token of the sequences that asked.
        let mut last = Vec::new();
        let mut r = 0;
        for seq in seqs.iter() {
            r += seq.tokens.len();
            if seq.want_logits && !seq.tokens.is_empty() {
                last.push(r - 1);
            }
        }
        let mut logits = vec![0.0f32; last.len() * c.vocab];
        if !last.is_empty() {
            let mut sel = Vec::with_capacity(last.len() * c.hidden);
            for &r in &last {
                sel.extend_from_slice(&x[r * c.hidden..(r + 1) * c.hidden]);
            }
            let mut seln = vec![0.0f32; sel.len()];
            rms_norm(&sel, &self.weights.out_norm, c.norm_eps, &mut seln);
            matmul(isa, &[self.weights.output()], &seln, last.len(), &mut scratch, &mut [&mut logits]);
        }
        for seq in seqs.iter_mut() {
            let n = seq.tokens.len();
            seq.kv.commit(pool, n)?;
        }
        Ok(logits)
    }
}
