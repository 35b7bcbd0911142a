//! Portable kernels: the reference the SIMD path is tested against.

use bulkhead_gguf::GgmlType;
use half::f16;

use crate::kquant::{self, KBlock, QK_K};
use crate::quant::{f16_at, q5_values, Q8Acts, QK};

pub(super) fn dot_q_rows(ty: GgmlType, w: &[u8], row_bytes: usize, acts: &Q8Acts, first: usize, n: usize, out: &mut [f32]) {
    for (row, o) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(n)) {
        if kquant::is_kquant(ty) {
            dot_k_row(ty, row, acts, first, o);
        } else {
            dot_q_row(ty, row, acts, first, o);
        }
    }
}

/// A k-quant row against activation rows: per 32-element activation block (two scale
/// groups), `d_a * (d * (sc0 * I0 + sc1 * I1) - dmin * (mn0 * A0 + mn1 * A1))` with `I` the
/// integer dot products and `A` the activations' integer sums of each group.
fn dot_k_row(ty: GgmlType, w: &[u8], acts: &Q8Acts, first: usize, out: &mut [f32]) {
    let nb = acts.blocks_per_row();
    let bb = ty.block().map_or(0, |b| b.1);
    let mut kb = KBlock::default();
    for o in out.iter_mut() {
        *o = 0.0;
    }
    for (sb, blk) in w.chunks_exact(bb).enumerate() {
        kquant::unpack(ty, blk, &mut kb);
        for (i, o) in out.iter_mut().enumerate() {
            let row = first + i;
            let mut sum = 0.0f32;
            for j in 0..QK_K / QK {
                let ab = row * nb + sb * (QK_K / QK) + j;
                let y = &acts.qs[ab * QK..(ab + 1) * QK];
                let (g0, g1) = (2 * j, 2 * j + 1);
                let dot = |g: usize, ys: &[i8]| -> i32 { kb.q[g * 16..(g + 1) * 16].iter().zip(ys).map(|(&a, &b)| i32::from(a) * i32::from(b)).sum() };
                let isum = kb.sc[g0] * dot(g0, &y[..16]) + kb.sc[g1] * dot(g1, &y[16..]);
                let msum = kb.mn[g0] * acts.sums[ab * 2] + kb.mn[g1] * acts.sums[ab * 2 + 1];
                sum += acts.d[ab] * (kb.d * isum as f32 - kb.dmin * msum as f32);
            }
            *o += sum;
        }
    }
}

/// Quantise blocks of 32 floats to 8 bits as ggml's reference `quantize_row_q8_1_ref` does;
/// the AVX2 path gives identical results.
pub(super) fn quantize(x: &[f32], d: &mut [f32], s: &mut [f32], qs: &mut [i8]) {
    for (((xb, qb), db), sb) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).zip(d.iter_mut()).zip(s.iter_mut()) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let dd = amax / 127.0;
        let id = if dd != 0.0 { 1.0 / dd } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in qb.iter_mut().zip(xb) {
            // |v * id| <= 127 by construction, so the cast cannot saturate.
            *q = (v * id).round() as i8;
            sum += i32::from(*q);
        }
        *db = f16::from_f32(dd).to_f32();
        *sb = f16::from_f32(sum as f32 * dd).to_f32();
    }
}

fn dot_q_row(ty: GgmlType, w: &[u8], acts: &Q8Acts, first: usize, out: &mut [f32]) {
    let nb = acts.blocks_per_row();
    for (i, o) in out.iter_mut().enumerate() {
        let row = first + i;
        let mut sum = 0.0f32;
        for b in 0..nb {
            let ab = row * nb + b;
            let y = &acts.qs[ab * QK..(ab + 1) * QK];
            let dy = acts.d[ab];
            sum += match ty {
                GgmlType::Q4_0 => {
                    let blk = &w[b * 18..(b + 1) * 18];
                    let mut si = 0i32;
                    for j in 0..16 {
                        si += (i32::from(blk[2 + j] & 0x0F) - 8) * i32::from(y[j]);
                        si += (i32::from(blk[2 + j] >> 4) - 8) * i32::from(y[j + 16]);
                    }
                    f16_at(blk) * dy * si as f32
                }
                GgmlType::Q4_1 => {
                    let blk = &w[b * 20..(b + 1) * 20];
                    let mut si = 0i32;
                    for j in 0..16 {
                        si += i32::from(blk[4 + j] & 0x0F) * i32::from(y[j]);
                        si += i32::from(blk[4 + j] >> 4) * i32::from(y[j + 16]);
                    }
                    f16_at(blk) * dy * si as f32 + f16_at(&blk[2..]) * acts.s[ab]
                }
                GgmlType::Q5_0 | GgmlType::Q5_1 => {
                    let has_min = ty == GgmlType::Q5_1;
                    let bs = if has_min { 24 } else { 22 };
                    let blk = &w[b * bs..(b + 1) * bs];
                    let (q, _) = q5_values(blk, has_min);
                    let si: i32 = q.iter().zip(y).map(|(&a, &b)| i32::from(a) * i32::from(b)).sum();
                    let v = f16_at(blk) * dy * si as f32;
                    if has_min { v + f16_at(&blk[2..]) * acts.s[ab] } else { v }
                }
                GgmlType::Q8_0 => {
                    let blk = &w[b * 34..(b + 1) * 34];
                    let si: i32 = (0..QK).map(|j| i32::from(blk[2 + j] as i8) * i32::from(y[j])).sum();
                    f16_at(blk) * dy * si as f32
                }
                other => unreachable!("{other} is not a quantised block type"),
            };
        }
        *o = sum;
    }
}

pub(super) fn dot_f16_bytes(w: &[u8], x: &[f32]) -> f32 {
    w.chunks_exact(2).zip(x).map(|(c, v)| f16_at(c) * v).sum()
}

pub(super) fn dot_bf16_bytes(w: &[u8], x: &[f32]) -> f32 {
    w.chunks_exact(2).zip(x).map(|(c, v)| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16) * v).sum()
}

pub(super) fn dot_f32_bytes(w: &[u8], x: &[f32]) -> f32 {
    w.chunks_exact(4).zip(x).map(|(c, v)| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * v).sum()
}

/// Element types attention reads.
pub trait Scalar: Copy {
    fn f(self) -> f32;
}
impl Scalar for f16 {
    fn f(self) -> f32 {
        self.to_f32()
    }
}
impl Scalar for f32 {
    fn f(self) -> f32 {
        self
    }
}

pub(super) fn dot<T: Scalar>(k: &[T], q: &[f32]) -> f32 {
    k.iter().zip(q).map(|(a, b)| a.f() * b).sum()
}

pub(super) fn axpy<T: Scalar>(acc: &mut [f32], a: f32, v: &[T]) {
    for (o, x) in acc.iter_mut().zip(v) {
        *o += a * x.f();
    }
}

pub(super) fn dot_rows<T: Scalar>(k: &[T], q: &[f32], out: &mut [f32]) {
    for (row, o) in k.chunks_exact(q.len()).zip(out.iter_mut()) {
        *o = dot(row, q);
    }
}

pub(super) fn weighted_sum<T: Scalar>(out: &mut [f32], w: &[f32], v: &[T]) {
    let cols = out.len();
    for (row, &wj) in v.chunks_exact(cols).zip(w) {
        axpy(out, wj, row);
    }
}
