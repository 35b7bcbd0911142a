//! AVX2 + FMA + F16C kernels. Every function here is `#[target_feature]`: callers in
//! `kernels/mod.rs` reach them only through an `Isa` at level `Avx2` or `Avx512Vnni` (which
//! uses these for everything but packed weights), and only detection of all three features
//! makes one.
//!
//! Integer dot products follow ggml: 4-bit weights are unpacked to bytes, multiplied with
//! 8-bit activations by `maddubs` (u8 x i8 -> i16 pairs, no saturation: |15 * 127 * 2| and
//! |128 * 127 * 2| < 2^15), widened by `madd`, converted and scaled with one FMA per block.

use std::arch::x86_64::*;

use bulkhead_gguf::GgmlType;
use half::f16;

use super::{Sums, TILE};
use crate::kquant::{self, KBlock};
use crate::quant::{Q8Acts, QK, f16_at};

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Pointers to the first activation row of a tile, with the row stride in blocks.
#[derive(Clone, Copy)]
struct ActPtrs {
    qs: *const i8,
    d: *const f32,
    s: *const f32,
    nb: usize,
}

/// One weight row against `N` activation rows with lane sums ([`Sums::Lanes`]).
///
/// # Safety
/// AVX2, FMA and F16C are available; `w` points to `a.nb` readable blocks of `ty`; `a` points
/// to `N` rows of `a.nb` blocks each (`qs`: 32 bytes a block, `d` and `s`: one f32 a block).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // `n` indexes acc, summ and the activation rows alike
unsafe fn tile<const N: usize>(ty: GgmlType, w: *const u8, a: ActPtrs, out: &mut [f32]) {
    let nb = a.nb;
    let mut acc = [_mm256_setzero_ps(); N];
    let mut summ = [0.0f32; N];
    let mask = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    // SAFETY: (whole body) every offset below is < nb blocks of the weight row or < N rows of
    // nb blocks of activations, as the caller guarantees; unaligned loads are used throughout.
    unsafe {
        match ty {
            GgmlType::Q4_1 => {
                for b in 0..nb {
                    let blk = w.add(b * 20);
                    let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(blk.cast::<i32>())));
                    let (d, m) = (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)));
                    let lo = _mm_loadu_si128(blk.add(4).cast());
                    let qx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(lo, 4), lo), mask);
                    for n in 0..N {
                        let ab = n * nb + b;
                        let qy = _mm256_loadu_si256(a.qs.add(ab * QK).cast());
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(qx, qy), ones);
                        acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(d * *a.d.add(ab)), _mm256_cvtepi32_ps(p), acc[n]);
                        summ[n] += m * *a.s.add(ab);
                    }
                }
            }
            GgmlType::Q4_0 | GgmlType::Q8_0 => {
                let q4 = ty == GgmlType::Q4_0;
                let bs = if q4 { 18 } else { 34 };
                for b in 0..nb {
                    let blk = w.add(b * bs);
                    let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(std::ptr::read_unaligned(blk.cast::<u16>())))));
                    let qx = if q4 {
                        let lo = _mm_loadu_si128(blk.add(2).cast());
                        let x = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(lo, 4), lo), mask);
                        _mm256_sub_epi8(x, _mm256_set1_epi8(8))
                    } else {
                        _mm256_loadu_si256(blk.add(2).cast())
                    };
                    signed_block_dots(&mut acc, qx, d, a, b);
                }
            }
            GgmlType::Q5_0 | GgmlType::Q5_1 => {
                let has_min = ty == GgmlType::Q5_1;
                let bs = if has_min { 24 } else { 22 };
                let at = if has_min { 4 } else { 2 };
                for b in 0..nb {
                    let blk = w.add(b * bs);
                    let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(std::ptr::read_unaligned(blk.cast::<u16>())))));
                    let m = if has_min {
                        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(std::ptr::read_unaligned(blk.add(2).cast::<u16>())))))
                    } else {
                        0.0
                    };
                    let qh = std::ptr::read_unaligned(blk.add(at).cast::<u32>());
                    let lo = _mm_loadu_si128(blk.add(at + 4).cast());
                    let nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(lo, 4), lo), mask);
                    let mut qx = _mm256_or_si256(nib, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
                    if !has_min {
                        qx = _mm256_sub_epi8(qx, _mm256_set1_epi8(16));
                    }
                    signed_block_dots(&mut acc, qx, d, a, b);
                    if has_min {
                        for n in 0..N {
                            summ[n] += m * *a.s.add(n * nb + b);
                        }
                    }
                }
            }
            other => unreachable!("{other} is not a quantised block type"),
        }
    }
    for n in 0..N {
        out[n] = hsum(acc[n]) + summ[n];
    }
}

/// Adds one block's dot products of signed weight bytes `qx` (scale `d`) with block `b` of
/// each of the `N` activation rows into `acc`.
///
/// # Safety
/// As [`tile`]: `a` holds `N` rows of `a.nb` blocks and `b < a.nb`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::needless_range_loop)]
unsafe fn signed_block_dots<const N: usize>(acc: &mut [__m256; N], qx: __m256i, d: f32, a: ActPtrs, b: usize) {
    let ax = _mm256_sign_epi8(qx, qx);
    let ones = _mm256_set1_epi16(1);
    for n in 0..N {
        let ab = n * a.nb + b;
        // SAFETY: `ab` is block `b` of row `n < N`, inside `a` as the caller guarantees.
        let (qy, da) = unsafe { (_mm256_loadu_si256(a.qs.add(ab * QK).cast()), *a.d.add(ab)) };
        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(qy, qx)), ones);
        acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(d * da), _mm256_cvtepi32_ps(p), acc[n]);
    }
}

/// Four floats as a vector, built in registers (four scalar stores read back as one vector
/// would stall store forwarding).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn vec4(x: [f32; 4]) -> __m128 {
    _mm_setr_ps(x[0], x[1], x[2], x[3])
}

/// `[Σ p[0], Σ p[1], Σ p[2], Σ p[3]]`: each vector's eight lanes summed (exact in i32).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum4_i32(p: [__m256i; 4]) -> __m128i {
    // Lanes: the low halves' sums of p[0..4], then the high halves'.
    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))
}

/// 32 bytes, byte `j` 0xFF where bit `j` of `bits` is set and 0 elsewhere.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn bits_to_bytes(bits: u32) -> __m256i {
    // Byte j takes the byte of `bits` that holds bit j, then keeps that bit alone.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303),
    );
    let pick = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, pick), pick)
}

/// Defines a k-quant tile kernel (see [`ktile`]) compiled for `$features`: the same source
/// for AVX2 and, with AVX-512VL's 32 vector registers (fewer spills), for CPUs that have it.
macro_rules! ktile_kernel {
    ($(#[$doc:meta])* $name:ident, $features:literal) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        #[allow(clippy::needless_range_loop)] // `n` indexes acc, summ and the activation rows alike
        unsafe fn $name<const N: usize, const BLOCKS: bool>(ty: GgmlType, w: &[u8], a: ActPtrs, sums: *const i32, out: &mut [f32]) {
            let nb = a.nb;
            let bb = ty.block().map_or(0, |b| b.1);
            let mut acc = [_mm256_setzero_ps(); N];
            let mut total = _mm_setzero_ps();
            let mut summ = [_mm256_setzero_ps(); N];
            let (m4, m2) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3));
            let mut qx = [_mm256_setzero_si256(); 8];
            let mut kb = KBlock::default();
            let has_mins = matches!(ty, GgmlType::Q2_K | GgmlType::Q4_K | GgmlType::Q5_K);
            for (sb, blk) in w.chunks_exact(bb).enumerate() {
                // SAFETY: (loads) every 32-byte load below is inside `blk`, whose layout the offsets
                // follow (kquant's module docs); unaligned loads throughout.
                let (d, dmin, sc, mn) = unsafe {
                    match ty {
                        GgmlType::Q4_K => {
                            for c in 0..4 {
                                let v = _mm256_loadu_si256(blk[16 + 32 * c..].as_ptr().cast());
                                qx[2 * c] = _mm256_and_si256(v, m4);
                                qx[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                            }
                            let (mut sc, mut mn) = ([0i32; 16], [0i32; 16]);
                            for j in 0..8 {
                                let (s, m) = kquant::scale_min_k4(j, &blk[4..16]);
                                (sc[2 * j], sc[2 * j + 1], mn[2 * j], mn[2 * j + 1]) = (i32::from(s), i32::from(s), i32::from(m), i32::from(m));
                            }
                            (f16_at(blk), f16_at(&blk[2..]), sc, mn)
                        }
                        GgmlType::Q6_K => {
                            let minus32 = _mm256_set1_epi8(32);
                            for h in 0..2 {
                                let ql0 = _mm256_loadu_si256(blk[64 * h..].as_ptr().cast());
                                let ql1 = _mm256_loadu_si256(blk[64 * h + 32..].as_ptr().cast());
                                let qh = _mm256_loadu_si256(blk[128 + 32 * h..].as_ptr().cast());
                                let high = |shift: i32| match shift {
                                    0 => _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4),
                                    2 => _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4),
                                    4 => _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4),
                                    _ => _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4),
                                };
                                qx[4 * h] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(ql0, m4), high(0)), minus32);
                                qx[4 * h + 1] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(ql1, m4), high(2)), minus32);
                                qx[4 * h + 2] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), high(4)), minus32);
                                qx[4 * h + 3] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), high(6)), minus32);
                            }
                            let mut sc = [0i32; 16];
                            for (g, s) in sc.iter_mut().enumerate() {
                                *s = i32::from(blk[192 + g] as i8);
                            }
                            (f16_at(&blk[208..]), 0.0, sc, [0; 16])
                        }
                        _ => {
                            kquant::unpack(ty, blk, &mut kb);
                            for (j, q) in qx.iter_mut().enumerate() {
                                *q = _mm256_loadu_si256(kb.q[32 * j..].as_ptr().cast());
                            }
                            (kb.d, kb.dmin, kb.sc, kb.mn)
                        }
                    }
                };
                // The groups' scales as 16-bit multipliers of maddubs' pair sums (exact: a pair sum
                // is at most 2 * 32 * 127 and a scale at most 127, so madd's i32 sums cannot overflow).
                let sv: [__m256i; 8] = std::array::from_fn(|j| {
                    let (s0, s1) = (sc[2 * j] as i16, sc[2 * j + 1] as i16);
                    _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0))
                });
                let ax: [__m256i; 8] = std::array::from_fn(|j| _mm256_sign_epi8(qx[j], qx[j]));
                // SAFETY: mn has 16 i32.
                let (mn_lo, mn_hi) = unsafe { (_mm256_loadu_si256(mn.as_ptr().cast()), _mm256_loadu_si256(mn.as_ptr().add(8).cast())) };
                // The eight blocks' min terms at once: mn[g] * sum[g] per group, pairs added
                // (hadd leaves blocks 0 1 4 5 2 3 6 7, put back in order).
                let min_terms = |first: usize| {
                    if !has_mins {
                        return _mm256_setzero_si256();
                    }
                    // SAFETY: 2 * (first + 8) <= 2 * N * nb: inside the group sums.
                    let (s_lo, s_hi) = unsafe { (_mm256_loadu_si256(sums.add(2 * first).cast()), _mm256_loadu_si256(sums.add(2 * first + 8).cast())) };
                    let pairs = _mm256_hadd_epi32(_mm256_mullo_epi32(s_lo, mn_lo), _mm256_mullo_epi32(s_hi, mn_hi));
                    _mm256_permutevar8x32_epi32(pairs, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7))
                };
                if BLOCKS {
                    // The scalar kernel's `d_a · (d · isum - dmin · msum)` per block, the N rows
                    // side by side, added in block order, then the superblock's sum.
                    let mut ms = [[0i32; 8]; 4];
                    for (n, m) in ms.iter_mut().enumerate().take(N) {
                        // SAFETY: eight i32.
                        unsafe { _mm256_storeu_si256(m.as_mut_ptr().cast(), min_terms(n * nb + sb * 8)) };
                    }
                    if N == 1 {
                        // One activation row: four consecutive blocks side by side instead.
                        let mut part = 0.0f32;
                        for j0 in [0, 4] {
                            let mut p = [_mm256_setzero_si256(); 4];
                            for (i, pi) in p.iter_mut().enumerate() {
                                let j = j0 + i;
                                // SAFETY: block sb * 8 + j of row 0 is inside `a`.
                                let qy = unsafe { _mm256_loadu_si256(a.qs.add((sb * 8 + j) * QK).cast()) };
                                *pi = _mm256_madd_epi16(_mm256_maddubs_epi16(ax[j], _mm256_sign_epi8(qy, qx[j])), sv[j]);
                            }
                            // SAFETY: four f32 and four i32 inside the row's scales and `ms`.
                            let (da, msum) = unsafe { (_mm_loadu_ps(a.d.add(sb * 8 + j0)), _mm_loadu_si128(ms[0][j0..].as_ptr().cast())) };
                            let isum = _mm_cvtepi32_ps(hsum4_i32(p));
                            let t = _mm_mul_ps(da, _mm_sub_ps(_mm_mul_ps(_mm_set1_ps(d), isum), _mm_mul_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(msum))));
                            let mut ts = [0.0f32; 4];
                            // SAFETY: four f32.
                            unsafe { _mm_storeu_ps(ts.as_mut_ptr(), t) };
                            part = ts.iter().fold(part, |s, &x| s + x);
                        }
                        total = _mm_add_ss(total, _mm_set_ss(part));
                        continue;
                    }
                    let mut part = _mm_setzero_ps();
                    for j in 0..8 {
                        let at = |n: usize| n * nb + sb * 8 + j;
                        let mut p = [_mm256_setzero_si256(); 4];
                        for n in 0..N {
                            // SAFETY: at(n) < N * nb: inside the activation rows the caller guarantees.
                            let qy = unsafe { _mm256_loadu_si256(a.qs.add(at(n) * QK).cast()) };
                            p[n] = _mm256_madd_epi16(_mm256_maddubs_epi16(ax[j], _mm256_sign_epi8(qy, qx[j])), sv[j]);
                        }
                        let mut da = [0.0f32; 4];
                        for n in 0..N {
                            // SAFETY: as above.
                            da[n] = unsafe { *a.d.add(at(n)) };
                        }
                        let da = vec4(da);
                        let isum = _mm_cvtepi32_ps(hsum4_i32(p));
                        let msum = _mm_cvtepi32_ps(_mm_setr_epi32(ms[0][j], ms[1][j], ms[2][j], ms[3][j]));
                        part = _mm_add_ps(part, _mm_mul_ps(da, _mm_sub_ps(_mm_mul_ps(_mm_set1_ps(d), isum), _mm_mul_ps(_mm_set1_ps(dmin), msum))));
                    }
                    total = _mm_add_ps(total, part);
                    continue;
                }
                for n in 0..N {
                    let first = n * nb + sb * 8;
                    for j in 0..8 {
                        let ab = first + j;
                        // SAFETY: ab < N * nb: inside the activation rows the caller guarantees.
                        let (qy, da) = unsafe { (_mm256_loadu_si256(a.qs.add(ab * QK).cast()), *a.d.add(ab)) };
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax[j], _mm256_sign_epi8(qy, qx[j])), sv[j]);
                        acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(d * da), _mm256_cvtepi32_ps(p), acc[n]);
                    }
                    if has_mins {
                        // Times dmin and d_a.
                        // SAFETY: first + 8 <= N * nb: inside the scales.
                        let da = unsafe { _mm256_loadu_ps(a.d.add(first)) };
                        summ[n] = _mm256_fmadd_ps(da, _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(min_terms(first))), summ[n]);
                    }
                }
            }
            let mut totals = [0.0f32; 4];
            // SAFETY: four f32.
            unsafe { _mm_storeu_ps(totals.as_mut_ptr(), total) };
            for n in 0..N {
                out[n] = if BLOCKS { totals[n] } else { hsum(acc[n]) - hsum(summ[n]) };
            }
        }
    };
}

ktile_kernel!(
    /// One k-quant weight row (`nsb` superblocks at `w`) against `N` activation rows. Per
    /// superblock the 256 weights are unpacked to bytes once: Q4_K and Q6_K in registers, the
    /// other k-quants through [`kquant::unpack`]. Then for each activation row and 32-element
    /// block: `maddubs` to pair sums, one `madd` by the two 16-element groups' integer scales
    /// to scaled sums of four products, converted and accumulated with one FMA by `d · d_a`.
    /// The min terms come from the activations' group sums, eight blocks at a time.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are available; `w` holds `nsb` superblocks of `ty`; `a` points to `N`
    /// rows of `a.nb = 8 * nsb` blocks and `sums` to their `2 * a.nb` group sums each.
    ktile,
    "avx2,fma,f16c"
);

ktile_kernel!(
    /// [`ktile`] with AVX-512VL available (same instructions, same results).
    ///
    /// # Safety
    /// As [`ktile`], and the CPU has AVX-512F and AVX-512VL.
    ktile_evex,
    "avx2,fma,f16c,avx512f,avx512vl"
);

/// `out[r * n + i] = dot(row r of w, activation row first + i)` for `rows` weight rows of
/// `row_bytes` each and `n` activation rows; `evex`: the CPU has AVX-512F and AVX-512VL
/// (k-quants then run [`ktile_evex`]).
#[allow(clippy::too_many_arguments)] // mirrors kernels::dot_q_rows, plus the ISA's choice
pub(super) fn dot_q_rows(
    ty: GgmlType,
    sums: Sums,
    w: &[u8],
    row_bytes: usize,
    acts: &Q8Acts,
    first: usize,
    n: usize,
    out: &mut [f32],
    evex: bool,
) {
    let nb = acts.blocks_per_row();
    let kq = kquant::is_kquant(ty);
    assert!(kq || sums == Sums::Lanes, "block sums of {ty} run the packed or the scalar kernels");
    // These bounds are what `tile` and `ktile` rely on.
    let end = (first + n) * nb;
    assert!(
        ty.bytes_for((nb * QK) as u64) == Some(row_bytes as u64) && w.len().is_multiple_of(row_bytes),
        "weight rows of {row_bytes} bytes for {nb} blocks"
    );
    assert!(out.len() == w.len() / row_bytes * n, "output shape");
    assert!(acts.qs.len() >= end * QK && acts.d.len() >= end && acts.s.len() >= end && acts.sums.len() >= 2 * end, "activations too short");
    macro_rules! tiles {
        ($rows:expr, $kernel:ident, $blocks:literal, $args:tt) => {
            match $rows {
                4 => $kernel::<4, $blocks> $args,
                3 => $kernel::<3, $blocks> $args,
                2 => $kernel::<2, $blocks> $args,
                _ => $kernel::<1, $blocks> $args,
            }
        };
    }
    let blocks = sums == Sums::Blocks;
    for (row, o_row) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(n)) {
        let mut i = 0;
        while i < n {
            let rows = (n - i).min(TILE);
            let o = &mut o_row[i..i + rows];
            let base = (first + i) * nb;
            // SAFETY: base + rows * nb <= end, within the asserted lengths.
            let a =
                unsafe { ActPtrs { qs: acts.qs.as_ptr().add(base * QK), d: acts.d.as_ptr().add(base), s: acts.s.as_ptr().add(base), nb } };
            // SAFETY: base * 2 + 2 * k * nb <= 2 * end, within the asserted group sums.
            let sums = unsafe { acts.sums.as_ptr().add(base * 2) };
            // SAFETY: only reached through an Isa at level Avx2 or Avx512Vnni (detection made it: AVX2, FMA,
            // F16C); `row` holds nb blocks (nb / 8 superblocks for a k-quant) and `a` `rows` rows of nb
            // blocks with their group sums, checked above.
            // With `evex`, ktile_evex's AVX-512F/VL too (the caller's Isa is at Avx512Vnni).
            unsafe {
                match (kq, evex, blocks) {
                    (true, true, false) => tiles!(rows, ktile_evex, false, (ty, row, a, sums, o)),
                    (true, true, true) => tiles!(rows, ktile_evex, true, (ty, row, a, sums, o)),
                    (true, false, false) => tiles!(rows, ktile, false, (ty, row, a, sums, o)),
                    (true, false, true) => tiles!(rows, ktile, true, (ty, row, a, sums, o)),
                    (false, _, false) => match rows {
                        4 => tile::<4>(ty, row.as_ptr(), a, o),
                        3 => tile::<3>(ty, row.as_ptr(), a, o),
                        2 => tile::<2>(ty, row.as_ptr(), a, o),
                        _ => tile::<1>(ty, row.as_ptr(), a, o),
                    },
                    (false, _, true) => unreachable!("asserted above"),
                }
            }
            i += rows;
        }
    }
}

/// [`super::scalar::gelu_mul`], eight elements at a time: the input rounded to f16 by F16C
/// (round to nearest even, as `half` rounds), the table entry gathered by its bits, the
/// scalar function's two exact ranges blended in, times `up`. The same bits.
#[target_feature(enable = "avx2,fma,f16c")]
fn gelu_mul_impl(gate: &mut [f32], up: &[f32], table: &[f32]) {
    assert!(table.len() == 1 << 16 && up.len() >= gate.len(), "gelu table and shapes");
    let (lo, hi) = (_mm256_set1_ps(-10.0), _mm256_set1_ps(10.0));
    let len = gate.len();
    let mut chunks = gate.chunks_exact_mut(8);
    for (g, u) in (&mut chunks).zip(up.chunks_exact(8)) {
        // SAFETY: `g` and `u` have 8 readable f32.
        let (x, u) = unsafe { (_mm256_loadu_ps(g.as_ptr()), _mm256_loadu_ps(u.as_ptr())) };
        let bits = _mm256_cvtepu16_epi32(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
        // SAFETY: every index is a u16, inside the table of 2^16 entries.
        let t = unsafe { _mm256_i32gather_ps::<4>(table.as_ptr(), bits) };
        let t = _mm256_blendv_ps(t, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LE_OQ>(x, lo));
        let t = _mm256_blendv_ps(t, x, _mm256_cmp_ps::<_CMP_GE_OQ>(x, hi));
        // SAFETY: `g` has 8 writable f32.
        unsafe { _mm256_storeu_ps(g.as_mut_ptr(), _mm256_mul_ps(t, u)) };
    }
    let done = len - chunks.into_remainder().len();
    super::scalar::gelu_mul(&mut gate[done..], &up[done..]);
}

/// See [`gelu_mul_impl`].
pub(super) fn gelu_mul(gate: &mut [f32], up: &[f32]) {
    // SAFETY: only reached through an Isa at level Avx2 or Avx512Vnni, which only detection of AVX2, FMA and F16C makes.
    unsafe { gelu_mul_impl(gate, up, super::scalar::gelu_table()) }
}

/// Quantise blocks of 32 floats to 8 bits exactly as the scalar path (ggml's reference
/// `quantize_row_q8_1_ref`): `d = amax / 127`, `q = round(x * (1 / d))` with halves away from
/// zero, `d` and `s = d * sum(q)` stored rounded through f16.
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_impl(x: &[f32], d: &mut [f32], s: &mut [f32], qs: &mut [i8]) {
    let sign = _mm256_set1_ps(-0.0);
    for (((xb, qb), db), sb) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).zip(d.iter_mut()).zip(s.iter_mut()) {
        // SAFETY: `xb` has 32 readable f32 and `qb` 32 writable i8.
        unsafe {
            let p = xb.as_ptr();
            let v = [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
            let mut m = _mm256_andnot_ps(sign, v[0]);
            for vv in &v[1..] {
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *vv));
            }
            let m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            let dd = amax / 127.0;
            let id = _mm256_set1_ps(if dd != 0.0 { 1.0 / dd } else { 0.0 });
            let half = _mm256_set1_ps(0.5);
            let one = _mm256_set1_ps(1.0);
            // roundf: truncate, then step away from zero when the exact remainder is >= 0.5.
            let r = |vv: __m256| {
                let x = _mm256_mul_ps(vv, id);
                let t = _mm256_round_ps(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
                let up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(x, t)), half, _CMP_GE_OQ);
                let step = _mm256_and_ps(up, _mm256_or_ps(_mm256_and_ps(sign, x), one));
                _mm256_cvtps_epi32(_mm256_add_ps(t, step))
            };
            let (i0, i1, i2, i3) = (r(v[0]), r(v[1]), r(v[2]), r(v[3]));
            let sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            let s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            let s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
            let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
            let isum = _mm_cvtsi128_si32(s4);
            let packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            let ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(qb.as_mut_ptr().cast(), ordered);
            *db = f16::from_f32(dd).to_f32();
            *sb = f16::from_f32(isum as f32 * dd).to_f32();
        }
    }
}

pub(super) fn quantize(x: &[f32], d: &mut [f32], s: &mut [f32], qs: &mut [i8]) {
    assert!(x.len() == qs.len() && x.len() == d.len() * QK && d.len() == s.len(), "quantize shapes");
    // SAFETY: only reached through an Isa at level Avx2 or Avx512Vnni, which only detection of AVX2, FMA and F16C makes.
    unsafe { quantize_impl(x, d, s, qs) }
}

/// `rounds` rounds of twelve independent `vpmaddubsw` (32 u8 × i8 multiply-adds each, pairs
/// summed in i16), the AVX2 kernels' integer product with nothing around it: the compute
/// wall their prefill figures are held against. Returns the multiply-adds done.
#[target_feature(enable = "avx2")]
fn dot_chains_impl(rounds: u64) -> u64 {
    let a = std::hint::black_box(_mm256_set1_epi8(5));
    let mut acc = [std::hint::black_box(_mm256_set1_epi8(3)); 12];
    for _ in 0..rounds {
        for x in acc.iter_mut() {
            // Each product's bytes feed the next (the values do not matter): twelve chains
            // the compiler cannot hoist, enough to cover the instruction's latency.
            *x = _mm256_maddubs_epi16(*x, a);
        }
    }
    std::hint::black_box(acc);
    rounds * 12 * 32
}

/// See [`dot_chains_impl`].
pub(super) fn dot_chains(rounds: u64) -> u64 {
    // SAFETY: only reached through an Isa at level Avx2 or Avx512Vnni, which only detection of AVX2, FMA and F16C makes.
    unsafe { dot_chains_impl(rounds) }
}

/// Element types attention reads: f16 (pool storage) and f32 (a page converted once).
pub trait Lanes: Copy {
    /// Eight elements at `p`, as f32.
    ///
    /// # Safety
    /// AVX2 and F16C are available and `p` points to eight readable elements.
    unsafe fn load8(p: *const Self) -> __m256;
    /// One element as f32.
    fn scalar(self) -> f32;
}

impl Lanes for f16 {
    #[inline]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: the caller guarantees 8 readable f16 (16 bytes) and F16C; f16 is
        // repr(transparent) over u16.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    fn scalar(self) -> f32 {
        self.to_f32()
    }
}

impl Lanes for f32 {
    #[inline]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: the caller guarantees 8 readable f32 and AVX.
        unsafe { _mm256_loadu_ps(p) }
    }
    fn scalar(self) -> f32 {
        self
    }
}

/// `sum(k[i] * q[i])`: one 8-lane FMA accumulator in order, then a horizontal sum. The
/// element type does not change the arithmetic (f16 converts exactly to f32).
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_impl<T: Lanes>(k: &[T], q: &[f32]) -> f32 {
    let n8 = k.len() / 8 * 8;
    let mut acc = _mm256_setzero_ps();
    for i in (0..n8).step_by(8) {
        let (kk, qq) = (&k[i..i + 8], &q[i..i + 8]);
        // SAFETY: `kk` has 8 readable elements and `qq` 8 readable f32.
        let (kv, qv) = unsafe { (T::load8(kk.as_ptr()), _mm256_loadu_ps(qq.as_ptr())) };
        acc = _mm256_fmadd_ps(kv, qv, acc);
    }
    let mut s = hsum(acc);
    for i in n8..k.len() {
        s += k[i].scalar() * q[i];
    }
    s
}

#[target_feature(enable = "avx2,fma,f16c")]
fn axpy_impl<T: Lanes>(acc: &mut [f32], a: f32, v: &[T]) {
    let n8 = v.len() / 8 * 8;
    let av = _mm256_set1_ps(a);
    for i in (0..n8).step_by(8) {
        let (vv, oo) = (&v[i..i + 8], &mut acc[i..i + 8]);
        // SAFETY: `vv` has 8 readable elements, `oo` 8 readable and writable f32.
        unsafe {
            let x = T::load8(vv.as_ptr());
            _mm256_storeu_ps(oo.as_mut_ptr(), _mm256_fmadd_ps(av, x, _mm256_loadu_ps(oo.as_ptr())));
        }
    }
    for i in n8..v.len() {
        acc[i] += a * v[i].scalar();
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_rows_impl<T: Lanes>(k: &[T], q: &[f32], out: &mut [f32]) {
    if q.len() != 64 {
        let d = q.len();
        let mut outs = out.chunks_exact_mut(8);
        if d.is_multiple_of(8) {
            // Eight rows at a time (Gemma's 256-wide heads, ...): per row `dot_impl`'s one
            // accumulator and its FMAs in order, so the same results, but eight independent
            // chains instead of one serial chain of FMAs per row.
            for (rows, o) in k.chunks_exact(8 * d).zip(&mut outs) {
                let mut acc = [_mm256_setzero_ps(); 8];
                for i in (0..d).step_by(8) {
                    // SAFETY: `q` has d readable f32 and `rows` 8 rows of d readable elements.
                    let qi = unsafe { _mm256_loadu_ps(q.as_ptr().add(i)) };
                    for (j, a) in acc.iter_mut().enumerate() {
                        // SAFETY: as above.
                        *a = _mm256_fmadd_ps(unsafe { T::load8(rows.as_ptr().add(j * d + i)) }, qi, *a);
                    }
                }
                // SAFETY: `o` has 8 writable f32.
                unsafe { _mm256_storeu_ps(o.as_mut_ptr(), hsum8(&acc)) };
            }
        }
        let done = if d.is_multiple_of(8) { out.len() / 8 * 8 } else { 0 };
        for (row, o) in k.chunks_exact(d).zip(out.iter_mut()).skip(done) {
            *o = dot_impl(row, q);
        }
        return;
    }
    // A 64-wide head (the default model's): `q` stays in eight registers across the rows
    // instead of being loaded again for each. Per row the same FMA sequence and sum as
    // `dot_impl`, so the results are identical.
    let mut qv = [_mm256_setzero_ps(); 8];
    for (i, v) in qv.iter_mut().enumerate() {
        // SAFETY: `q` has 64 readable f32.
        *v = unsafe { _mm256_loadu_ps(q.as_ptr().add(i * 8)) };
    }
    // Eight rows at a time: eight independent accumulators, summed by one transposed
    // reduction that performs each row's `hsum` additions exactly.
    let mut blocks = k.chunks_exact(8 * 64);
    let mut outs = out.chunks_exact_mut(8);
    for (rows, o) in (&mut blocks).zip(&mut outs) {
        let mut acc = [_mm256_setzero_ps(); 8];
        for i in 0..8 {
            // Loaded again per block of rows: with eight accumulators, `qv` would not also
            // fit in AVX2's sixteen registers.
            // SAFETY: `q` has 64 readable f32, `rows` 8 rows of 64 readable elements.
            let qi = unsafe { _mm256_loadu_ps(q.as_ptr().add(i * 8)) };
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: as above.
                *a = _mm256_fmadd_ps(unsafe { T::load8(rows.as_ptr().add(j * 64 + i * 8)) }, qi, *a);
            }
        }
        // SAFETY: `o` has 8 writable f32.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), hsum8(&acc)) };
    }
    for (row, o) in blocks.remainder().chunks_exact(64).zip(outs.into_remainder()) {
        let mut acc = _mm256_setzero_ps();
        for (i, qi) in qv.iter().enumerate() {
            // SAFETY: `row` has 64 readable elements.
            acc = _mm256_fmadd_ps(unsafe { T::load8(row.as_ptr().add(i * 8)) }, *qi, acc);
        }
        *o = hsum(acc);
    }
}

/// `[hsum(a[0]), ..., hsum(a[7])]`, each lane by the same three additions as [`hsum`]:
/// `s_i = l_i + l_(i+4)`, then `t_0 = s_0 + s_2`, `t_1 = s_1 + s_3`, then `t_0 + t_1`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum8(a: &[__m256; 8]) -> __m256 {
    // s[j] = [s of a[j] | s of a[j + 4]].
    let mut s = [_mm256_setzero_ps(); 4];
    for (j, sj) in s.iter_mut().enumerate() {
        *sj = _mm256_add_ps(_mm256_permute2f128_ps(a[j], a[j + 4], 0x20), _mm256_permute2f128_ps(a[j], a[j + 4], 0x31));
    }
    // [t_0, t_1 of a[j]; t_0, t_1 of a[j + 1] | the same of a[j + 4], a[j + 5]], j = 0, 2.
    let mut t = [_mm256_setzero_ps(); 2];
    for (h, th) in t.iter_mut().enumerate() {
        let (x, y) = (_mm256_castps_pd(s[2 * h]), _mm256_castps_pd(s[2 * h + 1]));
        *th = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    let even = _mm256_shuffle_ps(t[0], t[1], 0b10_00_10_00);
    let odd = _mm256_shuffle_ps(t[0], t[1], 0b11_01_11_01);
    _mm256_add_ps(even, odd)
}

/// `out += Σ_j w[j] · v[j]`, keeping up to 64 columns of `out` in registers across rows; per
/// element the same FMA sequence as repeated `axpy`, so results are identical.
#[target_feature(enable = "avx2,fma,f16c")]
fn weighted_sum_impl<T: Lanes>(out: &mut [f32], w: &[f32], v: &[T]) {
    let cols = out.len();
    if !cols.is_multiple_of(8) {
        for (row, &wj) in v.chunks_exact(cols).zip(w) {
            axpy_impl(out, wj, row);
        }
        return;
    }
    for c0 in (0..cols).step_by(64) {
        let width = (cols - c0).min(64) / 8;
        let mut acc = [_mm256_setzero_ps(); 8];
        for (r, a) in acc.iter_mut().enumerate().take(width) {
            let o = &out[c0 + r * 8..c0 + r * 8 + 8];
            // SAFETY: `o` has 8 readable f32.
            *a = unsafe { _mm256_loadu_ps(o.as_ptr()) };
        }
        for (row, &wj) in v.chunks_exact(cols).zip(w) {
            let wv = _mm256_set1_ps(wj);
            for (r, a) in acc.iter_mut().enumerate().take(width) {
                let x = &row[c0 + r * 8..c0 + r * 8 + 8];
                // SAFETY: `x` has 8 readable elements.
                *a = _mm256_fmadd_ps(wv, unsafe { T::load8(x.as_ptr()) }, *a);
            }
        }
        for (r, a) in acc.iter().enumerate().take(width) {
            let o = &mut out[c0 + r * 8..c0 + r * 8 + 8];
            // SAFETY: `o` has 8 writable f32.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), *a) };
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn widen_impl(src: &[f16], dst: &mut [f32]) {
    let n8 = src.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        let (s, d) = (&src[i..i + 8], &mut dst[i..i + 8]);
        // SAFETY: `s` has 8 readable f16, `d` 8 writable f32.
        unsafe { _mm256_storeu_ps(d.as_mut_ptr(), <f16 as Lanes>::load8(s.as_ptr())) };
    }
    for i in n8..src.len() {
        dst[i] = src[i].to_f32();
    }
}

pub(super) fn widen(src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    // SAFETY: only reached through an Isa at level Avx2 or Avx512Vnni, which only detection of AVX2, FMA and F16C makes.
    unsafe { widen_impl(src, dst) }
}

pub(super) fn dot<T: Lanes>(k: &[T], q: &[f32]) -> f32 {
    // SAFETY: only reached through an Isa at level Avx2 or Avx512Vnni, which only detection of AVX2, FMA and F16C makes.
    unsafe { dot_impl(k, q) }
}

pub(super) fn axpy<T: Lanes>(acc: &mut [f32], a: f32, v: &[T]) {
    // SAFETY: only reached through an Isa at level Avx2 or Avx512Vnni, which only detection of AVX2, FMA and F16C makes.
    unsafe { axpy_impl(acc, a, v) }
}

pub(super) fn dot_rows<T: Lanes>(k: &[T], q: &[f32], out: &mut [f32]) {
    // SAFETY: only reached through an Isa at level Avx2 or Avx512Vnni, which only detection of AVX2, FMA and F16C makes.
    unsafe { dot_rows_impl(k, q, out) }
}

pub(super) fn weighted_sum<T: Lanes>(out: &mut [f32], w: &[f32], v: &[T]) {
    // SAFETY: only reached through an Isa at level Avx2 or Avx512Vnni, which only detection of AVX2, FMA and F16C makes.
    unsafe { weighted_sum_impl(out, w, v) }
}

pub(super) fn dot_f16_bytes(w: &[u8], x: &[f32]) -> f32 {
    let row: Vec<f16> = w.chunks_exact(2).map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect();
    dot(&row, x)
}

/// [`super::scalar::exp_shifted`] compiled with FMA, so its fused multiply-adds are single
/// instructions rather than calls.
#[target_feature(enable = "avx2,fma,f16c")]
fn exp_shifted_impl(v: &mut [f32], max: f32) {
    super::scalar::exp_shifted(v, max);
}

pub(super) fn exp_shifted(v: &mut [f32], max: f32) {
    // SAFETY: only reached through an Isa at level Avx2 or Avx512Vnni, which only detection of AVX2, FMA and F16C makes.
    unsafe { exp_shifted_impl(v, max) }
}
