//! AVX-512 VNNI kernel over packed weights ([`super::packed`]): sixteen weight rows against
//! up to [`PACKED_TILE`] activation rows per call, one 512-bit `vpdpbusd` per four bytes of
//! sixteen rows. Every kernel here is `#[target_feature]`;
//! `kernels/mod.rs` reaches them only through an `Isa` at level `Avx512Vnni`, which only
//! detection makes.
//!
//! Each kernel instance is compiled for one weight format (a const parameter: no branch on
//! the format inside the block loop) and walks a block one weight vector at a time, so only
//! the accumulators stay live across a block (the earlier form decoded all eight vectors
//! first and spilled accumulators to the stack on every block).
//!
//! Each kernel computes either arithmetic of [`Sums`], bit for bit as the other ISAs do.
//! Lanes: the AVX2 row kernel's (and ggml's): lane `k` of a block's integer dot product is
//! the sum over its bytes `4k..4k+4` (exact in i32), each lane keeps its own f32 accumulator
//! (`fma(d_w * d_a, lane, acc)`, blocks in order), the eight lanes are summed in `hsum`'s
//! order at the end, and Q4_1's and Q5_1's `m_w * s_a` terms are summed apart and added
//! last. Blocks: the scalar kernel's: one exact integer sum per block (eight `vpdpbusd`
//! into one accumulator), then that block's few float operations, blocks in order; an eighth
//! of the conversions and float operations, and four activation rows a tile instead of two.
//! Either way results do not depend on which kernel the CPU gets, nor on what else shares
//! the call.

use std::arch::x86_64::*;

use bulkhead_gguf::GgmlType;
use half::f16;

use super::Sums;
use super::format::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, code as format_code, ty as format_type};
use super::packed::{self, GROUP, Res, block_offset};
use crate::quant::{Q8Acts, QK};

/// Activation rows handled together against one packed group with lane sums (eight lane
/// accumulators each; two rows keep everything in the 32 vector registers, three spill). A
/// partial tile is one row.
pub const PACKED_TILE: usize = 2;

/// The same with block sums (one float and one or two integer accumulators a row; the
/// remainder runs tiles of two and one).
const BLOCKS_TILE: usize = 4;

const _: () = assert!(BLOCKS_TILE <= packed::MAX_TILE && PACKED_TILE <= packed::MAX_TILE);

/// Sixteen weight rows (one packed group) against `N` activation rows starting at `first`;
/// `res[n][r]` receives row `r`'s dot product with activation row `first + n`. `BLOCKS`
/// picks the arithmetic ([`super::Sums`]): eight lane accumulators per row, or one integer
/// sum per block and the scalar kernel's float steps.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C, AVX-512F/VL/BW/VNNI; `g` points to `nb` packed blocks of
/// format `F`; `acts` holds rows `first..first + N` of `nb` blocks (and their group sums).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn group<const F: u8, const N: usize, const BLOCKS: bool>(g: *const u8, nb: usize, acts: &Q8Acts, first: usize, res: &mut Res) {
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); 8]; N];
    let mut summ = [_mm512_setzero_ps(); N];
    // Blocks: the rows' sums so far (`sum += t` per block, as the scalar kernel).
    let mut total = [_mm512_setzero_ps(); N];
    let mask = _mm512_set1_epi8(0x0F);
    let gb = block_offset(format_type(F), nb, 0, 1);
    // Q4_0, Q5_0 and Q8_0 weights are signed: they enter vpdpbusd unsigned, as stored (Q8_0's
    // with its sign bit flipped, +128), and the offset comes out of the integer sum through
    // the accumulator: Σ (u - o) a = vpdpbusd(-o Σ a, u, a), exact, the AVX2 kernel's integer.
    // Q4_1's and Q5_1's are unsigned, with a min.
    let with_min = F == Q4_1 || F == Q5_1;
    let bias: i32 = match F {
        Q4_0 => 8,
        Q5_0 => 16,
        Q8_0 => 128,
        _ => 0,
    };
    let ones = _mm256_set1_epi8(1);
    let five = F == Q5_0 || F == Q5_1;
    // SAFETY: (whole body) offsets stay within nb blocks of the group and N rows of nb
    // activation blocks (2 nb group sums), as the caller guarantees; loads are unaligned.
    unsafe {
        let act = |n: usize, b: usize| (first + n) * nb + b;
        for b in 0..nb {
            let blk = g.add(b * gb);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.cast()));
            let mut scale = [_mm512_setzero_ps(); N];
            for n in 0..N {
                scale[n] = _mm512_mul_ps(dw, _mm512_set1_ps(*acts.d.get_unchecked(act(n, b))));
            }
            let mut quants = blk.add(2 * GROUP);
            let mut mw = _mm512_setzero_ps();
            if with_min {
                mw = _mm512_cvtph_ps(_mm256_loadu_si256(quants.cast()));
                quants = quants.add(2 * GROUP);
                for n in 0..N {
                    if !BLOCKS {
                        summ[n] = _mm512_add_ps(summ[n], _mm512_mul_ps(mw, _mm512_set1_ps(*acts.s.get_unchecked(act(n, b)))));
                    }
                }
            }
            // Lanes: per activation row and lane, -bias times the sum of the lane's four
            // activations. Blocks: the row's integer sum starts at -bias times the block's.
            let mut offs = [[0i32; 8]; N];
            let mut isum = [zero; N];
            if bias != 0 {
                for (n, o) in offs.iter_mut().enumerate() {
                    if BLOCKS {
                        let (s0, s1) = (*acts.sums.get_unchecked(2 * act(n, b)), *acts.sums.get_unchecked(2 * act(n, b) + 1));
                        isum[n] = _mm512_set1_epi32(-bias * (s0 + s1));
                    } else {
                        let q = acts.qs.as_ptr().add(act(n, b) * QK);
                        let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, _mm256_loadu_si256(q.cast()));
                        _mm256_storeu_si256(o.as_mut_ptr().cast(), _mm256_mullo_epi32(sums, _mm256_set1_epi32(-bias)));
                    }
                }
            }
            let qh = if five {
                let v = _mm512_loadu_si512(quants.cast());
                quants = quants.add(4 * GROUP);
                v
            } else {
                zero
            };
            // One weight vector (lane k: bytes 4k..4k+4 of each row) against every
            // activation row: lanes, fma(d_w * d_a, lane, acc) per lane, blocks in order;
            // blocks, into the row's integer sum.
            let mut step = |k: usize, mut w: __m512i| {
                if five {
                    // Lane k covers elements 4k..4k+4 of its row; byte e of the row's packed
                    // qh holds element 4k+e's fifth bit at bit k.
                    w = with_fifth_bit(w, qh, k);
                }
                if F == Q8_0 {
                    w = _mm512_xor_si512(w, _mm512_set1_epi8(-128));
                }
                for n in 0..N {
                    let q = acts.qs.as_ptr().add(act(n, b) * QK);
                    let a = _mm512_set1_epi32(std::ptr::read_unaligned(q.add(4 * k).cast::<i32>()));
                    if BLOCKS {
                        isum[n] = _mm512_dpbusd_epi32(isum[n], w, a);
                    } else {
                        let start = if bias != 0 { _mm512_set1_epi32(offs[n][k]) } else { zero };
                        let lane = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, w, a));
                        acc[n][k] = _mm512_fmadd_ps(scale[n], lane, acc[n][k]);
                    }
                }
            };
            if F == Q8_0 {
                for k in 0..8 {
                    step(k, _mm512_loadu_si512(quants.add(4 * GROUP * k).cast()));
                }
            } else {
                // Vector j's low nibbles are lane j, its high nibbles lane j + 4.
                for j in 0..4 {
                    let p = _mm512_loadu_si512(quants.add(4 * GROUP * j).cast());
                    step(j, _mm512_and_si512(p, mask));
                    step(j + 4, _mm512_and_si512(_mm512_srli_epi16(p, 4), mask));
                }
            }
            if BLOCKS {
                // The scalar kernel's `(d_w * d_a) * isum (+ m_w * s_a)`, then `sum += t`.
                for n in 0..N {
                    let mut t = _mm512_mul_ps(scale[n], _mm512_cvtepi32_ps(isum[n]));
                    if with_min {
                        t = _mm512_add_ps(t, _mm512_mul_ps(mw, _mm512_set1_ps(*acts.s.get_unchecked(act(n, b)))));
                    }
                    total[n] = _mm512_add_ps(total[n], t);
                }
            }
        }
        for n in 0..N {
            let r = if BLOCKS { total[n] } else { _mm512_add_ps(hsum_order(&acc[n]), summ[n]) };
            _mm512_storeu_ps(res[n].as_mut_ptr(), r);
        }
    }
}

/// Sixteen rows' packed Q4_K superblocks (Q5_K with `FIVE`; `nsb` of them at `g`) against
/// `N` activation rows from `first`; `res[n]` receives row `first + n`'s sixteen results.
///
/// Lanes (`!BLOCKS`): per row the AVX2 row kernel's operations, lane for lane: block `j`'s
/// lane `k` is the exact integer dot product of elements `4k..4k + 4` (one `vpdpbusd`:
/// nibbles are unsigned), times the block's integer scale (exact in f32: the product is
/// below 2^24), accumulated with `fma(d · d_a, lane, acc[k])`; the min terms `m_j · (s_2j +
/// s_2j+1)` (exact in f32 too) go into one accumulator per block of the superblock,
/// `fma(d_a, dmin · term, summ[j])`, in a second pass (the two sums meet only at the end);
/// then `hsum(acc) - hsum(summ)` in hsum's order. Same bits as `ktile`.
///
/// Blocks: the scalar kernel's steps: per block the integers `sc_j · I_j` and `m_j · (s_2j +
/// s_2j+1)`, then `d_a · (d · isum - dmin · msum)` summed over the superblock, and the
/// superblocks' sums summed.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C, AVX-512F/VL/BW/VNNI; `g` points to `nsb` packed Q4_K
/// superblocks; `acts` holds rows `first..first + N` of `8 * nsb` blocks (and group sums).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn group_q4k<const FIVE: bool, const N: usize, const BLOCKS: bool>(
    g: *const u8,
    nsb: usize,
    acts: &Q8Acts,
    first: usize,
    res: &mut Res,
) {
    use packed::{KSB_Q4K, KSB_Q5K, Q4K_DMIN, Q4K_MN, Q4K_QS, Q4K_SC, Q5K_QH};
    let zero = _mm512_setzero_si512();
    let ksb = if FIVE { KSB_Q5K } else { KSB_Q4K };
    let mut acc = [[_mm512_setzero_ps(); 8]; N];
    let mut total = [_mm512_setzero_ps(); N];
    let mask = _mm512_set1_epi8(0x0F);
    let nb = 8 * nsb;
    // SAFETY: (whole body) offsets stay within nsb packed superblocks and rows first..first+N
    // of nb activation blocks and 2 * nb group sums, as the caller guarantees; loads are
    // unaligned.
    unsafe {
        for sb in 0..nsb {
            let p = g.add(sb * ksb);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()));
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(Q4K_DMIN).cast()));
            let mut part = [_mm512_setzero_ps(); N];
            for j in 0..8 {
                let blk = |n: usize| (first + n) * nb + sb * 8 + j;
                let dd: [__m512; N] = std::array::from_fn(|n| _mm512_mul_ps(d, _mm512_set1_ps(*acts.d.get_unchecked(blk(n)))));
                let sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(Q4K_SC + GROUP * j).cast())));
                let mut isum = [zero; N];
                for k in 0..8 {
                    let v = _mm512_loadu_si512(p.add(Q4K_QS + (8 * (j / 2) + k) * 4 * GROUP).cast());
                    let mut w = if j % 2 == 0 { _mm512_and_si512(v, mask) } else { _mm512_and_si512(_mm512_srli_epi16(v, 4), mask) };
                    if FIVE {
                        // Bit j of each qh byte is its element's fifth bit in block j.
                        w = with_fifth_bit(w, _mm512_loadu_si512(p.add(Q5K_QH + k * 4 * GROUP).cast()), j);
                    }
                    for n in 0..N {
                        let q = acts.qs.as_ptr().add(blk(n) * QK + 4 * k);
                        let a = _mm512_set1_epi32(std::ptr::read_unaligned(q.cast::<i32>()));
                        if BLOCKS {
                            isum[n] = _mm512_dpbusd_epi32(isum[n], w, a);
                        } else {
                            let lane = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, w, a)), sc);
                            acc[n][k] = _mm512_fmadd_ps(dd[n], lane, acc[n][k]);
                        }
                    }
                }
                if BLOCKS {
                    // The scalar kernel's `d · (I · sc) - dmin · (mn · a)` with the scales
                    // applied first: an f16 times a 6-bit integer is exact in f32, and so are
                    // `I · sc` and `mn · a` (below 2^24), so `(d · sc) · I` rounds the same real
                    // number once, bit for bit, and two integer multiplies a row leave the loop.
                    let ds = _mm512_mul_ps(d, sc);
                    let dm =
                        _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(Q4K_MN + GROUP * j).cast()))));
                    for n in 0..N {
                        let a = (*acts.sums.get_unchecked(2 * blk(n)) + *acts.sums.get_unchecked(2 * blk(n) + 1)) as f32;
                        let t = _mm512_sub_ps(_mm512_mul_ps(ds, _mm512_cvtepi32_ps(isum[n])), _mm512_mul_ps(dm, _mm512_set1_ps(a)));
                        part[n] = _mm512_add_ps(part[n], _mm512_mul_ps(_mm512_set1_ps(*acts.d.get_unchecked(blk(n))), t));
                    }
                }
            }
            for n in 0..N {
                total[n] = _mm512_add_ps(total[n], part[n]);
            }
        }
        for n in 0..N {
            if BLOCKS {
                _mm512_storeu_ps(res[n].as_mut_ptr(), total[n]);
                continue;
            }
            let mut summ = [_mm512_setzero_ps(); 8];
            for sb in 0..nsb {
                let p = g.add(sb * ksb);
                let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(Q4K_DMIN).cast()));
                for (j, s) in summ.iter_mut().enumerate() {
                    let blk = (first + n) * nb + sb * 8 + j;
                    let mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(Q4K_MN + GROUP * j).cast())));
                    let (s0, s1) = (*acts.sums.get_unchecked(2 * blk) as f32, *acts.sums.get_unchecked(2 * blk + 1) as f32);
                    let term = _mm512_add_ps(_mm512_mul_ps(mn, _mm512_set1_ps(s0)), _mm512_mul_ps(mn, _mm512_set1_ps(s1)));
                    *s = _mm512_fmadd_ps(_mm512_set1_ps(*acts.d.get_unchecked(blk)), _mm512_mul_ps(dmin, term), *s);
                }
            }
            _mm512_storeu_ps(res[n].as_mut_ptr(), _mm512_sub_ps(hsum_order(&acc[n]), hsum_order(&summ)));
        }
    }
}

/// Sixteen rows' packed Q6_K superblocks against `N` activation rows from `first`: as
/// [`group_q4k`] without the mins, and with the weights' offset of 32 taken out of the
/// integer sums (`Σ (q - 32) a = vpdpbusd(-32 Σ a, q, a)`, exact): per lane (`ktile`'s
/// integer), or per 16-element group (blocks: `sc_0 · I_0 + sc_1 · I_1` a block).
///
/// # Safety
/// As [`group_q4k`], for packed Q6_K superblocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn group_q6k<const N: usize, const BLOCKS: bool>(g: *const u8, nsb: usize, acts: &Q8Acts, first: usize, res: &mut Res) {
    use packed::{KSB_Q6K, Q6K_SC, q6k_qh, q6k_ql};
    let mut acc = [[_mm512_setzero_ps(); 8]; N];
    let mut total = [_mm512_setzero_ps(); N];
    let (mask, high) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
    let ones = _mm256_set1_epi8(1);
    let nb = 8 * nsb;
    // SAFETY: (whole body) offsets stay within nsb packed superblocks and rows first..first+N
    // of nb activation blocks (2 nb group sums), as the caller guarantees; loads are unaligned.
    unsafe {
        for sb in 0..nsb {
            let p = g.add(sb * KSB_Q6K);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()));
            if N == 1 && BLOCKS {
                // One activation row (a decode step's output head): bound by reading the
                // weights, so each quant vector is loaded once for the four blocks that share
                // it. The integer sums are exact in any order, and the float steps below run
                // in block order as in the loop after, so the bits are the same.
                let blk = |b: usize| first * nb + sb * 8 + b;
                let mut isum = [[_mm512_setzero_si512(); 2]; 8];
                for (b, s) in isum.iter_mut().enumerate() {
                    for (gi, v) in s.iter_mut().enumerate() {
                        *v = _mm512_set1_epi32(-32 * *acts.sums.get_unchecked(2 * blk(b) + gi));
                    }
                }
                for h in 0..2 {
                    for k in 0..8 {
                        let qh = _mm512_loadu_si512(p.add(q6k_qh(8 * h + k)).cast());
                        let ql = [2 * h, 2 * h + 1].map(|chunk| _mm512_loadu_si512(p.add(q6k_ql(8 * chunk + k)).cast()));
                        for u in 0..4 {
                            let v = ql[u % 2];
                            let low = if u < 2 { _mm512_and_si512(v, mask) } else { _mm512_and_si512(_mm512_srli_epi16(v, 4), mask) };
                            let hb = match u {
                                0 => _mm512_slli_epi16(qh, 4),
                                1 => _mm512_slli_epi16(qh, 2),
                                2 => qh,
                                _ => _mm512_srli_epi16(qh, 2),
                            };
                            // low | (hb & high) in one instruction.
                            let w = _mm512_ternarylogic_epi32::<0xF8>(low, hb, high);
                            let b = 4 * h + u;
                            let q = acts.qs.as_ptr().add(blk(b) * QK + 4 * k);
                            let a = _mm512_set1_epi32(std::ptr::read_unaligned(q.cast::<i32>()));
                            isum[b][k / 4] = _mm512_dpbusd_epi32(isum[b][k / 4], w, a);
                        }
                    }
                }
                let mut part = _mm512_setzero_ps();
                for (b, is) in isum.iter().enumerate() {
                    let sc: [__m512i; 2] =
                        std::array::from_fn(|g| _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(Q6K_SC + GROUP * (2 * b + g)).cast())));
                    let is = _mm512_add_epi32(_mm512_mullo_epi32(is[0], sc[0]), _mm512_mullo_epi32(is[1], sc[1]));
                    let t = _mm512_mul_ps(d, _mm512_cvtepi32_ps(is));
                    part = _mm512_add_ps(part, _mm512_mul_ps(_mm512_set1_ps(*acts.d.get_unchecked(blk(b))), t));
                }
                total[0] = _mm512_add_ps(total[0], part);
                continue;
            }
            let mut part = [_mm512_setzero_ps(); N];
            for b in 0..8 {
                let (h, u) = (b / 4, b % 4);
                let blk = |n: usize| (first + n) * nb + sb * 8 + b;
                let dd: [__m512; N] = std::array::from_fn(|n| _mm512_mul_ps(d, _mm512_set1_ps(*acts.d.get_unchecked(blk(n)))));
                // Lanes: per activation row, -32 times each lane's four activations. Blocks:
                // each group's integer sum starts at -32 times its sixteen activations.
                let mut offs = [[0i32; 8]; N];
                let mut isum = [[_mm512_setzero_si512(); 2]; N];
                for (n, o) in offs.iter_mut().enumerate() {
                    if BLOCKS {
                        for (gi, s) in isum[n].iter_mut().enumerate() {
                            *s = _mm512_set1_epi32(-32 * *acts.sums.get_unchecked(2 * blk(n) + gi));
                        }
                    } else {
                        let q = acts.qs.as_ptr().add(blk(n) * QK);
                        let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, _mm256_loadu_si256(q.cast()));
                        _mm256_storeu_si256(o.as_mut_ptr().cast(), _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, 5)));
                    }
                }
                let chunk = 2 * h + u % 2;
                // The block's two 16-element groups' scales: lanes 0..4 and 4..8.
                let sc_int: [__m512i; 2] =
                    std::array::from_fn(|g| _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(Q6K_SC + GROUP * (2 * b + g)).cast())));
                let scales = sc_int.map(|v| _mm512_cvtepi32_ps(v));
                for k in 0..8 {
                    let v = _mm512_loadu_si512(p.add(q6k_ql(8 * chunk + k)).cast());
                    let low = if u < 2 { _mm512_and_si512(v, mask) } else { _mm512_and_si512(_mm512_srli_epi16(v, 4), mask) };
                    let qh = _mm512_loadu_si512(p.add(q6k_qh(8 * h + k)).cast());
                    // Bits 2u, 2u + 1 of each byte to bits 4, 5.
                    let hb = match u {
                        0 => _mm512_slli_epi16(qh, 4),
                        1 => _mm512_slli_epi16(qh, 2),
                        2 => qh,
                        _ => _mm512_srli_epi16(qh, 2),
                    };
                    let w = _mm512_or_si512(low, _mm512_and_si512(hb, high));
                    for n in 0..N {
                        let q = acts.qs.as_ptr().add(blk(n) * QK + 4 * k);
                        let a = _mm512_set1_epi32(std::ptr::read_unaligned(q.cast::<i32>()));
                        if BLOCKS {
                            isum[n][k / 4] = _mm512_dpbusd_epi32(isum[n][k / 4], w, a);
                        } else {
                            let dot = _mm512_dpbusd_epi32(_mm512_set1_epi32(offs[n][k]), w, a);
                            acc[n][k] = _mm512_fmadd_ps(dd[n], _mm512_mul_ps(_mm512_cvtepi32_ps(dot), scales[k / 4]), acc[n][k]);
                        }
                    }
                }
                if BLOCKS {
                    // No mins: the scalar kernel's `d · isum - 0 · 0` is `d · isum`, bit for bit.
                    for n in 0..N {
                        let is = _mm512_add_epi32(_mm512_mullo_epi32(isum[n][0], sc_int[0]), _mm512_mullo_epi32(isum[n][1], sc_int[1]));
                        let t = _mm512_mul_ps(d, _mm512_cvtepi32_ps(is));
                        part[n] = _mm512_add_ps(part[n], _mm512_mul_ps(_mm512_set1_ps(*acts.d.get_unchecked(blk(n))), t));
                    }
                }
            }
            for n in 0..N {
                total[n] = _mm512_add_ps(total[n], part[n]);
            }
        }
        for n in 0..N {
            let r = if BLOCKS { total[n] } else { hsum_order(&acc[n]) };
            _mm512_storeu_ps(res[n].as_mut_ptr(), r);
        }
    }
}

/// Nibbles `w` with their fifth bits set from bit `bit` (0..8) of each byte of `qh`: moved to
/// bit 4 by 16-bit shifts, whose bits from the neighbouring byte never reach bit 4.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn with_fifth_bit(w: __m512i, qh: __m512i, bit: usize) -> __m512i {
    let at4 = if bit <= 4 {
        _mm512_sll_epi16(qh, _mm_cvtsi32_si128(4 - bit as i32))
    } else {
        _mm512_srl_epi16(qh, _mm_cvtsi32_si128(bit as i32 - 4))
    };
    _mm512_or_si512(w, _mm512_and_si512(at4, _mm512_set1_epi8(0x10)))
}

/// The eight lane accumulators summed in the AVX2 `hsum`'s order:
/// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`, sixteen rows at once.
#[target_feature(enable = "avx512f")]
fn hsum_order(a: &[__m512; 8]) -> __m512 {
    let (s0, s1, s2, s3) = (_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[2], a[6]), _mm512_add_ps(a[3], a[7]));
    _mm512_add_ps(_mm512_add_ps(s0, s2), _mm512_add_ps(s1, s3))
}

/// One instance of a group kernel: a format, an arithmetic and a tile of activation rows.
type GroupFn = unsafe fn(*const u8, usize, &Q8Acts, usize, &mut Res);

/// The group kernel for `ty` and `sums` over the largest tile it has (1, 2 or, with block
/// sums, 4 activation rows) of at most `rows` rows, with that tile's size.
fn pick_kernel(ty: GgmlType, sums: Sums, rows: usize) -> (GroupFn, usize) {
    let tile = match sums {
        Sums::Lanes => rows.min(PACKED_TILE),
        Sums::Blocks => rows.min(BLOCKS_TILE),
    };
    macro_rules! tiles {
        ($kernel:ident $(, $f:expr)?) => {
            match (sums, tile) {
                (Sums::Lanes, 1) => $kernel::<$($f,)? 1, false> as GroupFn,
                (Sums::Lanes, _) => $kernel::<$($f,)? PACKED_TILE, false> as GroupFn,
                (Sums::Blocks, 1) => $kernel::<$($f,)? 1, true> as GroupFn,
                (Sums::Blocks, 2 | 3) => $kernel::<$($f,)? 2, true> as GroupFn,
                (Sums::Blocks, _) => $kernel::<$($f,)? BLOCKS_TILE, true> as GroupFn,
            }
        };
    }
    let kernel = match ty {
        GgmlType::Q4_K => tiles!(group_q4k, false),
        GgmlType::Q5_K => tiles!(group_q4k, true),
        GgmlType::Q6_K => tiles!(group_q6k),
        _ => match format_code(ty) {
            Q4_0 => tiles!(group, Q4_0),
            Q4_1 => tiles!(group, Q4_1),
            Q5_0 => tiles!(group, Q5_0),
            Q5_1 => tiles!(group, Q5_1),
            _ => tiles!(group, Q8_0),
        },
    };
    (kernel, if tile == 3 { 2 } else { tile })
}

/// `out[i * rows + r] = dot(row r, activation row first + i)` for the `rows` rows held by
/// the packed groups in `p` (`rows` may end inside the last group): activation-major, so each
/// group's sixteen results are contiguous.
#[allow(clippy::too_many_arguments)] // mirrors kernels::dot_q_packed, plus the arithmetic
pub(super) fn dot_packed(ty: GgmlType, sums: Sums, p: &[u8], rows: usize, acts: &Q8Acts, first: usize, n: usize, out: &mut [f32]) {
    packed::for_each_tile(ty, p, rows, acts, first, n, out, GROUP, |g, len, _, at, left, res| {
        let (kernel, k) = pick_kernel(ty, sums, left);
        // SAFETY: only reached through an Isa at level Avx512Vnni (only detection makes one);
        // `for_each_tile` checked that `g` holds `len` packed blocks (superblocks for
        // k-quants) and that rows at..at + left are within the activations.
        unsafe { kernel(g.as_ptr(), len, acts, at, res) };
        k
    });
}

/// KV elements sixteen at a time, as f32.
pub trait Lanes16: Copy {
    /// Sixteen elements at `p`, as f32.
    ///
    /// # Safety
    /// AVX-512F is available and `p` points to sixteen readable elements.
    unsafe fn load16(p: *const Self) -> __m512;
}

impl Lanes16 for f16 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: the caller guarantees 16 readable f16 (32 bytes) and AVX-512F; f16 is
        // repr(transparent) over u16.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
}

impl Lanes16 for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: the caller guarantees 16 readable f32 and AVX-512F.
        unsafe { _mm512_loadu_ps(p) }
    }
}

/// `out += Σ_j w[j] · v[j]` for `out` of a multiple of 16 columns, up to 64 of them held in
/// four 512-bit registers across the rows of `v`. Per element the same FMA sequence as the
/// AVX2 kernel and repeated `axpy` (one `fma(w[j], v[j][c], out[c])` per row, in order), so
/// results are identical; half the instructions.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn weighted_sum_impl<T: Lanes16>(out: &mut [f32], w: &[f32], v: &[T]) {
    let cols = out.len();
    for c0 in (0..cols).step_by(64) {
        let width = (cols - c0).min(64) / 16;
        let mut acc = [_mm512_setzero_ps(); 4];
        for (r, a) in acc.iter_mut().enumerate().take(width) {
            let o = &out[c0 + r * 16..c0 + r * 16 + 16];
            // SAFETY: `o` has 16 readable f32.
            *a = unsafe { _mm512_loadu_ps(o.as_ptr()) };
        }
        for (row, &wj) in v.chunks_exact(cols).zip(w) {
            let wv = _mm512_set1_ps(wj);
            for (r, a) in acc.iter_mut().enumerate().take(width) {
                let x = &row[c0 + r * 16..c0 + r * 16 + 16];
                // SAFETY: `x` has 16 readable elements.
                *a = _mm512_fmadd_ps(wv, unsafe { T::load16(x.as_ptr()) }, *a);
            }
        }
        for (r, a) in acc.iter().enumerate().take(width) {
            let o = &mut out[c0 + r * 16..c0 + r * 16 + 16];
            // SAFETY: `o` has 16 writable f32.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *a) };
        }
    }
}

/// [`weighted_sum_impl`] for two output rows at once (`out` holds both, `cols` apart, and
/// `w[r]` row `r`'s weights): per element the same FMA sequence, so the same bits; each
/// `v` vector is loaded once for both rows, and eight FMA chains run side by side instead of
/// four (too few to hide the FMA's latency).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn weighted_sum2_impl<T: Lanes16>(out: &mut [f32], w: [&[f32]; 2], v: &[T]) {
    let cols = out.len() / 2;
    for c0 in (0..cols).step_by(64) {
        // A register count fixed at compile time keeps the loop over keys free of branches.
        match (cols - c0).min(64) / 16 {
            4 => weighted_sum2_cols::<T, 4>(out, w, v, c0),
            3 => weighted_sum2_cols::<T, 3>(out, w, v, c0),
            2 => weighted_sum2_cols::<T, 2>(out, w, v, c0),
            _ => weighted_sum2_cols::<T, 1>(out, w, v, c0),
        }
    }
}

/// [`weighted_sum2_impl`]'s columns `c0..c0 + 16 W` of both rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
#[inline]
fn weighted_sum2_cols<T: Lanes16, const W: usize>(out: &mut [f32], w: [&[f32]; 2], v: &[T], c0: usize) {
    let cols = out.len() / 2;
    let mut acc = [[_mm512_setzero_ps(); W]; 2];
    for (r, row) in acc.iter_mut().enumerate() {
        for (c, a) in row.iter_mut().enumerate() {
            let o = &out[r * cols + c0 + c * 16..][..16];
            // SAFETY: `o` has 16 readable f32.
            *a = unsafe { _mm512_loadu_ps(o.as_ptr()) };
        }
    }
    for ((x, &w0), &w1) in v.chunks_exact(cols).zip(w[0]).zip(w[1]) {
        let wv = [_mm512_set1_ps(w0), _mm512_set1_ps(w1)];
        let x = &x[c0..c0 + 16 * W];
        for c in 0..W {
            // SAFETY: `x` has 16 W readable elements.
            let xv = unsafe { T::load16(x.as_ptr().add(c * 16)) };
            for (row, wr) in acc.iter_mut().zip(wv) {
                row[c] = _mm512_fmadd_ps(wr, xv, row[c]);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (c, a) in row.iter().enumerate() {
            let o = &mut out[r * cols + c0 + c * 16..][..16];
            // SAFETY: `o` has 16 writable f32.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *a) };
        }
    }
}

/// See [`weighted_sum2_impl`]; each row's width must be a multiple of 16.
pub(super) fn weighted_sum2<T: Lanes16>(out: &mut [f32], w: [&[f32]; 2], v: &[T]) {
    let cols = out.len() / 2;
    assert!(
        cols.is_multiple_of(16) && out.len() == 2 * cols && w[0].len() == w[1].len() && v.len() == cols * w[0].len(),
        "weighted_sum2 shape"
    );
    // SAFETY: only reached through an Isa at level Avx512Vnni, which only detection of AVX2, FMA, F16C and AVX-512F/VL/BW/VNNI makes.
    unsafe { weighted_sum2_impl(out, w, v) }
}

/// Two query rows' scores against the same keys: `out[r * stride + j] = dot(k row j, q row
/// r)` for `r` in 0..2, rows `d = q.len() / 2` wide (a multiple of 8). Per (row, key) the
/// AVX2 kernel's arithmetic for such widths (one accumulator, FMAs in order, [`hsum8`] for
/// whole blocks of eight keys, `dot` for the rest), so the same bits; each key vector is
/// loaded once for both rows, and sixteen FMA chains run side by side (eight could not hide
/// the FMA's latency), which AVX-512's 32 registers hold.
///
/// [`hsum8`]: super::avx2::hsum8
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn dot_rows2_impl<T: super::avx2::Lanes>(k: &[T], q: &[f32], out: &mut [f32], stride: usize) {
    let d = q.len() / 2;
    let n = k.len() / d;
    let full = n / 8 * 8;
    for b in (0..full).step_by(8) {
        let mut acc = [[_mm256_setzero_ps(); 8]; 2];
        for i in (0..d).step_by(8) {
            // SAFETY: `q` has 2 d readable f32, `k` n rows of d readable elements, b + 8 <= n.
            let qv = unsafe { [_mm256_loadu_ps(q.as_ptr().add(i)), _mm256_loadu_ps(q.as_ptr().add(d + i))] };
            for j in 0..8 {
                // SAFETY: as above.
                let kv = unsafe { T::load8(k.as_ptr().add((b + j) * d + i)) };
                for (a, qr) in acc.iter_mut().zip(qv) {
                    a[j] = _mm256_fmadd_ps(kv, qr, a[j]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            let o = &mut out[r * stride + b..r * stride + b + 8];
            // SAFETY: `o` has 8 writable f32.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), super::avx2::hsum8(a)) };
        }
    }
    for j in full..n {
        for r in 0..2 {
            out[r * stride + j] = super::avx2::dot(&k[j * d..(j + 1) * d], &q[r * d..(r + 1) * d]);
        }
    }
}

/// See [`dot_rows2_impl`]; `q` holds two rows of a multiple of 8 values.
pub(super) fn dot_rows2<T: super::avx2::Lanes>(k: &[T], q: &[f32], out: &mut [f32], stride: usize) {
    let d = q.len() / 2;
    let n = k.len().checked_div(d).unwrap_or(0);
    assert!(
        d > 0 && d.is_multiple_of(8) && q.len() == 2 * d && k.len() == n * d && out.len() >= stride + n && stride >= n,
        "dot_rows2 shape"
    );
    // SAFETY: only reached through an Isa at level Avx512Vnni, which only detection of AVX2, FMA, F16C and AVX-512F/VL/BW/VNNI makes.
    unsafe { dot_rows2_impl(k, q, out, stride) }
}

/// See [`weighted_sum_impl`]; `out.len()` must be a multiple of 16.
pub(super) fn weighted_sum<T: Lanes16>(out: &mut [f32], w: &[f32], v: &[T]) {
    assert!(out.len().is_multiple_of(16) && v.len() == out.len() * w.len(), "weighted_sum shape");
    // SAFETY: only reached through an Isa at level Avx512Vnni, which only detection of AVX2, FMA, F16C and AVX-512F/VL/BW/VNNI makes.
    unsafe { weighted_sum_impl(out, w, v) }
}

/// `v[i] = e^(v[i] - max)`, eight lanes at a time in f64: [`super::scalar::expf`]'s
/// operations lane by lane (the same fused multiply-adds, the same table), so the same bits.
/// Lanes with `|x| >= 88` or NaN take the scalar function, which handles those ranges.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn exp_shifted_impl(v: &mut [f32], max: f32) {
    use super::scalar::{EXP_C, EXP_INV_LN2_N, EXP_SHIFT, EXP_TABLE, expf};
    let m = _mm256_set1_ps(max);
    let (inv, shift) = (_mm512_set1_pd(EXP_INV_LN2_N), _mm512_set1_pd(EXP_SHIFT));
    let (c0, c1, c2, one) = (_mm512_set1_pd(EXP_C[0]), _mm512_set1_pd(EXP_C[1]), _mm512_set1_pd(EXP_C[2]), _mm512_set1_pd(1.0));
    // SAFETY: EXP_TABLE has 32 u64, four loads of eight.
    let tab = unsafe { [0, 8, 16, 24].map(|i| _mm512_loadu_si512(EXP_TABLE.as_ptr().add(i).cast())) };
    let (top_mask, big) = (_mm256_set1_epi32(0x7ff), _mm256_set1_epi32(0x42b));
    let mut chunks = v.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: `c` has 8 readable and writable f32.
        let x = _mm256_sub_ps(unsafe { _mm256_loadu_ps(c.as_ptr()) }, m);
        let xd = _mm512_cvtps_pd(x);
        let kd = _mm512_fmadd_pd(inv, xd, shift);
        let ki = _mm512_castpd_si512(kd);
        let kd = _mm512_sub_pd(kd, shift);
        let r = _mm512_fmsub_pd(inv, xd, kd);
        // Entry ki % 32: bits 0..3 pick among sixteen, bit 4 which sixteen.
        let lo = _mm512_permutex2var_epi64(tab[0], ki, tab[1]);
        let hi = _mm512_permutex2var_epi64(tab[2], ki, tab[3]);
        let t = _mm512_mask_blend_epi64(_mm512_test_epi64_mask(ki, _mm512_set1_epi64(16)), lo, hi);
        let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64(ki, 47)));
        let z = _mm512_fmadd_pd(c0, r, c1);
        let y = _mm512_fmadd_pd(c2, r, one);
        let y = _mm512_fmadd_pd(z, _mm512_mul_pd(r, r), y);
        let out = _mm512_cvtpd_ps(_mm512_mul_pd(y, s));
        let abstop = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 20), top_mask);
        let slow = _mm256_cmpge_epu32_mask(abstop, big);
        // SAFETY: `c` has 8 writable f32.
        unsafe { _mm256_storeu_ps(c.as_mut_ptr(), out) };
        if slow != 0 {
            let mut xs = [0.0f32; 8];
            // SAFETY: `xs` has 8 writable f32.
            unsafe { _mm256_storeu_ps(xs.as_mut_ptr(), x) };
            for (lane, o) in c.iter_mut().enumerate().filter(|(l, _)| slow & (1 << l) != 0) {
                *o = expf(xs[lane]);
            }
        }
    }
    for x in chunks.into_remainder() {
        *x = expf(*x - max);
    }
}

/// See [`exp_shifted_impl`].
pub(super) fn exp_shifted(v: &mut [f32], max: f32) {
    // SAFETY: only reached through an Isa at level Avx512Vnni, which only detection of AVX2, FMA, F16C and AVX-512F/VL/BW/VNNI makes.
    unsafe { exp_shifted_impl(v, max) }
}

/// `rounds` rounds of twelve independent `vpdpbusd` chains (64 u8 × i8 multiply-adds each),
/// the packed kernels' one arithmetic instruction with nothing around it: the compute wall
/// their prefill figures are held against. Returns the multiply-adds done.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn dot_chains_impl(rounds: u64) -> u64 {
    let (w, a) = (std::hint::black_box(_mm512_set1_epi8(3)), std::hint::black_box(_mm512_set1_epi8(5)));
    let mut acc = [_mm512_setzero_si512(); 12];
    for _ in 0..rounds {
        for x in acc.iter_mut() {
            *x = _mm512_dpbusd_epi32(*x, w, a);
        }
    }
    std::hint::black_box(acc);
    rounds * 12 * 64
}

/// See [`dot_chains_impl`].
pub(super) fn dot_chains(rounds: u64) -> u64 {
    // SAFETY: only reached through an Isa at level Avx512Vnni, which only detection of AVX2, FMA, F16C and AVX-512F/VL/BW/VNNI makes.
    unsafe { dot_chains_impl(rounds) }
}
