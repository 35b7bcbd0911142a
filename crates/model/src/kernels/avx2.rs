//! AVX2 + FMA + F16C kernels. Every function here is `#[target_feature]`: callers in
//! `kernels/mod.rs` reach them only after `Isa::detect` confirmed all three features.
//!
//! Integer dot products follow ggml: 4-bit weights are unpacked to bytes, multiplied with
//! 8-bit activations by `maddubs` (u8 x i8 -> i16 pairs, no saturation: |15 * 127 * 2| and
//! |128 * 127 * 2| < 2^15), widened by `madd`, converted and scaled with one FMA per block.

use std::arch::x86_64::*;

use bulkhead_gguf::GgmlType;
use half::f16;

use super::TILE;
use crate::quant::{Q8Acts, QK};

/// Thirty-two bytes from the start of `s` (bounds-checked).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load32(s: &[u8]) -> __m256i {
    let s = &s[..32];
    // SAFETY: `s` has exactly 32 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// Sixteen 4-bit pairs unpacked to 32 bytes: low nibbles (elements 0..16), then high (16..32).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn nibbles(s: &[u8]) -> __m256i {
    let s = &s[..16];
    // SAFETY: `s` has exactly 16 readable bytes; loadu has no alignment requirement.
    let lo = unsafe { _mm_loadu_si128(s.as_ptr().cast()) };
    let hi = _mm_srli_epi16(lo, 4);
    _mm256_and_si256(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(0x0F))
}

/// The f16 at `b[0..2]` (and the one at `b[2..4]` when `b` has four bytes).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn f16s(b: &[u8]) -> __m128 {
    let bits = if b.len() >= 4 { i32::from_le_bytes([b[0], b[1], b[2], b[3]]) } else { i32::from(u16::from_le_bytes([b[0], b[1]])) };
    _mm_cvtph_ps(_mm_cvtsi32_si128(bits))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Sum of products of unsigned bytes `ax` and signed bytes `sy`, as 8 floats.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn mul_sum_us8(ax: __m256i, sy: __m256i) -> __m256 {
    let dot = _mm256_maddubs_epi16(ax, sy);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(dot, _mm256_set1_epi16(1)))
}

/// Sum of products of signed bytes, as 8 floats (sign moved onto `y`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn mul_sum_i8(x: __m256i, y: __m256i) -> __m256 {
    mul_sum_us8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
}

/// The 32 quantised activations of block `ab`, as a vector.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn act_block(acts: &Q8Acts, ab: usize) -> __m256i {
    let q = &acts.qs[ab * QK..(ab + 1) * QK];
    // SAFETY: `q` has exactly 32 readable i8; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(q.as_ptr().cast()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn tile<const N: usize>(ty: GgmlType, w: &[u8], acts: &Q8Acts, first: usize, out: &mut [f32]) {
    let nb = acts.blocks_per_row();
    let mut acc = [_mm256_setzero_ps(); N];
    let mut summ = [0.0f32; N];
    for b in 0..nb {
        match ty {
            GgmlType::Q4_1 => {
                let blk = &w[b * 20..(b + 1) * 20];
                let dm = f16s(blk);
                let (d, m) = (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)));
                let qx = nibbles(&blk[4..]);
                for n in 0..N {
                    let ab = (first + n) * nb + b;
                    let xy = mul_sum_us8(qx, act_block(acts, ab));
                    acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(d * acts.d[ab]), xy, acc[n]);
                    summ[n] += m * acts.s[ab];
                }
            }
            GgmlType::Q4_0 | GgmlType::Q8_0 => {
                let (d, qx) = if ty == GgmlType::Q4_0 {
                    let blk = &w[b * 18..(b + 1) * 18];
                    (_mm_cvtss_f32(f16s(&blk[..2])), _mm256_sub_epi8(nibbles(&blk[2..]), _mm256_set1_epi8(8)))
                } else {
                    let blk = &w[b * 34..(b + 1) * 34];
                    (_mm_cvtss_f32(f16s(&blk[..2])), load32(&blk[2..]))
                };
                for n in 0..N {
                    let ab = (first + n) * nb + b;
                    let xy = mul_sum_i8(qx, act_block(acts, ab));
                    acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(d * acts.d[ab]), xy, acc[n]);
                }
            }
            other => unreachable!("{other} is not a quantised block type"),
        }
    }
    for n in 0..N {
        out[n] = hsum(acc[n]) + summ[n];
    }
}

pub(super) fn dot_q_row(ty: GgmlType, w: &[u8], acts: &Q8Acts, first: usize, out: &mut [f32]) {
    let mut i = 0;
    while i < out.len() {
        let n = (out.len() - i).min(TILE);
        let o = &mut out[i..i + n];
        // SAFETY: only reached with Isa::Avx2, i.e. after AVX2, FMA and F16C were detected.
        unsafe {
            match n {
                4 => tile::<4>(ty, w, acts, first + i, o),
                3 => tile::<3>(ty, w, acts, first + i, o),
                2 => tile::<2>(ty, w, acts, first + i, o),
                _ => tile::<1>(ty, w, acts, first + i, o),
            }
        }
        i += n;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f16_impl(k: &[u16], q: &[f32]) -> f32 {
    let n8 = k.len() / 8 * 8;
    let mut acc = _mm256_setzero_ps();
    for i in (0..n8).step_by(8) {
        let (kk, qq) = (&k[i..i + 8], &q[i..i + 8]);
        // SAFETY: `kk` has 8 u16 (16 bytes) and `qq` 8 f32 (32 bytes), both readable.
        let (kv, qv) = unsafe { (_mm256_cvtph_ps(_mm_loadu_si128(kk.as_ptr().cast())), _mm256_loadu_ps(qq.as_ptr())) };
        acc = _mm256_fmadd_ps(kv, qv, acc);
    }
    let mut s = hsum(acc);
    for i in n8..k.len() {
        s += f16::from_bits(k[i]).to_f32() * q[i];
    }
    s
}

#[target_feature(enable = "avx2,fma,f16c")]
fn axpy_f16_impl(acc: &mut [f32], a: f32, v: &[u16]) {
    let n8 = v.len() / 8 * 8;
    let av = _mm256_set1_ps(a);
    for i in (0..n8).step_by(8) {
        let (vv, oo) = (&v[i..i + 8], &mut acc[i..i + 8]);
        // SAFETY: `vv` has 16 readable bytes, `oo` 32 readable and writable bytes.
        unsafe {
            let x = _mm256_cvtph_ps(_mm_loadu_si128(vv.as_ptr().cast()));
            _mm256_storeu_ps(oo.as_mut_ptr(), _mm256_fmadd_ps(av, x, _mm256_loadu_ps(oo.as_ptr())));
        }
    }
    for i in n8..v.len() {
        acc[i] += a * f16::from_bits(v[i]).to_f32();
    }
}

fn f16_bits(k: &[f16]) -> &[u16] {
    // SAFETY: half::f16 is #[repr(transparent)] over u16.
    unsafe { std::slice::from_raw_parts(k.as_ptr().cast::<u16>(), k.len()) }
}

pub(super) fn dot_f16(k: &[f16], q: &[f32]) -> f32 {
    // SAFETY: only reached with Isa::Avx2 (features detected).
    unsafe { dot_f16_impl(f16_bits(k), q) }
}

pub(super) fn axpy_f16(acc: &mut [f32], a: f32, v: &[f16]) {
    // SAFETY: only reached with Isa::Avx2 (features detected).
    unsafe { axpy_f16_impl(acc, a, f16_bits(v)) }
}

pub(super) fn dot_f16_bytes(w: &[u8], x: &[f32]) -> f32 {
    let bits: Vec<u16> = w.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    // SAFETY: only reached with Isa::Avx2 (features detected).
    unsafe { dot_f16_impl(&bits, x) }
}
