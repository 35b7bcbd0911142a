//! A deliberately plain forward pass: one sequence, one token at a time, a contiguous f16 KV
//! cache in a `Vec`, no pages, no leases, no batch. It shares the arithmetic primitives with
//! the paged pass (matrix products, the f16 dot/axpy kernels, norms, RoPE, the softmax
//! order), so for a correct paged pass the two agree bit for bit: any slot read from the
//! wrong page, position or generation shows up as a difference.
//!
//! Why bit-identical rather than "close": activations are quantised to 8 bits before every
//! matrix product, so a last-bit difference in an attention sum can flip one quantised value
//! and move logits by tenths. Equal arithmetic removes that noise and leaves only real bugs.

use half::f16;

use crate::Llama;
use crate::forward::{ROW_EXTRA, activate, fold_span, fold_start, rms_norm, rope, softmax_in_place};
use crate::kernels::{axpy_kv, dot_kv};
use crate::matmul::{MatmulScratch, matmul};

/// Contiguous per-sequence state for [`Llama::reference_step`].
#[derive(Debug, Default)]
pub struct ReferenceState {
    /// `[layer][pos * kv_dim + i]`.
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
    pos: usize,
}

impl Llama {
    /// Feed one token at the next position; returns its logits.
    pub fn reference_step(&self, st: &mut ReferenceState, token: u32) -> Vec<f32> {
        self.threads.install(|| self.reference_step_inner(st, token))
    }

    fn reference_step_inner(&self, st: &mut ReferenceState, token: u32) -> Vec<f32> {
        let c = &self.config;
        let (hd, q_dim, kv_dim) = (c.head_dim, c.heads * c.head_dim, c.kv_heads * c.head_dim);
        if st.k.is_empty() {
            st.k = vec![Vec::new(); c.layers];
            st.v = vec![Vec::new(); c.layers];
        }
        let pos = st.pos;
        let mut s = MatmulScratch::default();
        let mut x = vec![0.0; c.hidden];
        self.embed(token, &mut x);
        let mut tmp = Vec::new();
        let mut xn = vec![0.0; c.hidden];
        let (mut q, mut k, mut v) = (vec![0.0; q_dim], vec![0.0; kv_dim], vec![0.0; kv_dim]);
        for (li, l) in self.weights.layers.iter().enumerate() {
            rms_norm(&x, &l.attn_norm, c.norm_eps, &mut xn);
            matmul(self.isa, &[&l.wq, &l.wk, &l.wv], &xn, 1, &mut s, &mut [&mut q, &mut k, &mut v]);
            self.prepare_qkv(li, &mut q, &mut k, &mut v, &mut tmp);
            let r = self.rope_of(li);
            rope(&mut q, hd, pos, r);
            rope(&mut k, hd, pos, r);
            let lo = c.window(li).map_or(0, |w| (pos + 1).saturating_sub(w));
            st.k[li].extend(k.iter().map(|&a| f16::from_f32(a)));
            st.v[li].extend(v.iter().map(|&a| f16::from_f32(a)));
            let mut att = vec![0.0; q_dim];
            let span = self.key_span;
            for h in 0..c.heads {
                let g = h / c.group();
                let qh = &q[h * hd..(h + 1) * hd];
                let at = |p: usize| p * kv_dim + g * hd..p * kv_dim + (g + 1) * hd;
                // Positions outside a sliding window take no part; the rest in key spans,
                // each a softmax of its own, folded in order.
                let mut acc = vec![0.0; hd + ROW_EXTRA];
                fold_start(&mut acc);
                for s in lo / span..=pos / span {
                    let keys = (s * span).max(lo)..((s + 1) * span).min(pos + 1);
                    let mut w: Vec<f32> = keys.clone().map(|p| dot_kv(self.isa, &st.k[li][at(p)], qh) * c.attn_scale).collect();
                    let stats = softmax_in_place(self.isa, &mut w);
                    let mut o = vec![0.0; hd];
                    for (p, &wp) in keys.zip(&w) {
                        axpy_kv(self.isa, &mut o, wp, &st.v[li][at(p)]);
                    }
                    fold_span(self.isa, &mut acc, &o, stats);
                }
                att[h * hd..(h + 1) * hd].copy_from_slice(&acc[..hd]);
            }
            let mut o = vec![0.0; c.hidden];
            matmul(self.isa, &[&l.wo], &att, 1, &mut s, &mut [&mut o]);
            self.post_norm(l.post_attn_norm.as_deref(), &mut o, &mut xn);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            rms_norm(&x, &l.ffn_norm, c.norm_eps, &mut xn);
            let (mut gate, mut up) = (vec![0.0; c.ffn], vec![0.0; c.ffn]);
            matmul(self.isa, &[&l.w_gate, &l.w_up], &xn, 1, &mut s, &mut [&mut gate, &mut up]);
            activate(self.isa, c.activation, &mut gate, &up);
            matmul(self.isa, &[&l.w_down], &gate, 1, &mut s, &mut [&mut o]);
            self.post_norm(l.post_ffn_norm.as_deref(), &mut o, &mut xn);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        }
        rms_norm(&x.clone(), &self.weights.out_norm, c.norm_eps, &mut x);
        let mut logits = vec![0.0; c.vocab];
        matmul(self.isa, &[self.weights.output()], &x, 1, &mut s, &mut [&mut logits]);
        self.soft_cap(&mut logits);
        st.pos += 1;
        logits
    }
}
