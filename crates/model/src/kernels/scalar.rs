//! Portable kernels: the reference the SIMD path is tested against.

use bulkhead_gguf::GgmlType;
use half::f16;

use crate::kquant::{self, KBlock, QK_K};
use crate::quant::{Q8Acts, QK, f16_at, q5_values};

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
                let dot = |g: usize, ys: &[i8]| -> i32 {
                    kb.q[g * 16..(g + 1) * 16].iter().zip(ys).map(|(&a, &b)| i32::from(a) * i32::from(b)).sum()
                };
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

/// `2^(i/32)` as f64 bits, less `i << 47` (so adding `k << 47` for `k ≡ i mod 32` also
/// scales by `2^(k div 32)`): the table of the `exp` algorithm below.
pub(super) const EXP_TABLE: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];
/// `32 / ln 2`.
pub(super) const EXP_INV_LN2_N: f64 = 46.16624130844683;
/// Adding it rounds a double below 2^51 in magnitude to an integer, in the low bits.
pub(super) const EXP_SHIFT: f64 = 6755399441055744.0;
/// The polynomial `2^(r/32) ≈ 1 + C2 r + C1 r² + C0 r³`.
pub(super) const EXP_C: [f64; 3] = [1.6938359250920212e-06, 0.00023459809789509004, 0.021660849396613134];

/// `e^x` rounded to f32 exactly as glibc's `expf` (the algorithm of Arm's
/// optimized-routines, in glibc's FMA build) rounds it, for every f32: `x · 32/ln 2 = k + r`,
/// `e^x = 2^(k/32) · 2^(r/32)` in f64, with the same fused operations in the same order.
/// The softmax's weights depend on these bits, and the llama.cpp fixtures were checked with
/// them; the vector form in `vnni.rs` computes the same function eight lanes at a time.
#[inline(always)]
pub(super) fn expf(x: f32) -> f32 {
    let abstop = (x.to_bits() >> 20) & 0x7ff;
    if abstop >= 0x42b {
        // |x| >= 88, or x is not a number.
        if x == f32::NEG_INFINITY {
            return 0.0;
        }
        if abstop >= 0x7f8 {
            return x + x;
        }
        if x > f32::from_bits(0x42b1_7217) {
            // above ln(2^128)
            return f32::INFINITY;
        }
        if x < f32::from_bits(0xc2cf_f1b4) {
            // below ln(2^-150)
            return 0.0;
        }
        if x < f32::from_bits(0xc2ce_8ecf) {
            // below ln(2^-149): glibc's may-underflow value, the least subnormal.
            return f32::from_bits(1);
        }
    }
    exp_core(x)
}

/// [`expf`]'s main path, for `|x| < 88` (and the ranges it passes on).
#[inline(always)]
fn exp_core(x: f32) -> f32 {
    let xd = f64::from(x);
    let kd = EXP_INV_LN2_N.mul_add(xd, EXP_SHIFT);
    let ki = kd.to_bits();
    let kd = kd - EXP_SHIFT;
    let r = EXP_INV_LN2_N.mul_add(xd, -kd);
    let s = f64::from_bits(EXP_TABLE[(ki % 32) as usize].wrapping_add(ki << 47));
    let z = EXP_C[0].mul_add(r, EXP_C[1]);
    let y = EXP_C[2].mul_add(r, 1.0);
    let y = z.mul_add(r * r, y);
    (y * s) as f32
}

/// `v[i] = e^(v[i] - max)` with [`expf`].
#[inline(always)]
pub(super) fn exp_shifted(v: &mut [f32], max: f32) {
    v.iter_mut().for_each(|x| *x = expf(*x - max));
}

/// ggml's CPU GELU (tanh approximation), which evaluates it on the input rounded to f16 and
/// rounds the result to f16 (its lookup table, [`gelu_table`]), and is exact outside [-10, 10].
pub(super) fn gelu(x: f32) -> f32 {
    if x <= -10.0 {
        return 0.0;
    }
    if x >= 10.0 {
        return x;
    }
    gelu_table()[usize::from(f16::from_f32(x).to_bits())]
}

/// GELU of every f16 input (by its bits), rounded to f16, as ggml keeps: tanh per element
/// cost more than the matrix products it sits between.
pub(super) fn gelu_table() -> &'static [f32] {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044_715;
    static TABLE: std::sync::OnceLock<Box<[f32]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| {
                let h = f16::from_bits(bits).to_f32();
                f16::from_f32(0.5 * h * (1.0 + (SQRT_2_OVER_PI * h * (1.0 + COEF_A * h * h)).tanh())).to_f32()
            })
            .collect()
    })
}

/// `gate[i] = gelu(gate[i]) * up[i]`.
pub(super) fn gelu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = gelu(*g) * u;
    }
}
