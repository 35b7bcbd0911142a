//! AVX2 kernel over packed weights ([`super::packed`], the VNNI kernel's layout), block sums
//! only ([`super::Sums::Blocks`]): half a packed group (eight weight rows, the 32-byte half of
//! each 64-byte vector) against up to [`TILE`] activation rows per call. Every kernel here is
//! `#[target_feature]`; `kernels/mod.rs` reaches them only through an `Isa` at level `Avx2`
//! with block sums, which only detection of AVX2, FMA and F16C makes.
//!
//! Without `vpdpbusd`, four bytes of eight rows against four broadcast activation bytes are
//! one `vpmaddubsw` (unsigned weights × signed activations → pairs of products, i16) and the
//! pairs are summed in i16 across the block's weight vectors where that cannot overflow (4-bit
//! weights: eight vectors, |8 · 2 · 15 · 128| < 2^15; 5- and 6-bit: four and two), then
//! widened by one `vpmaddwd`, which multiplies in the k-quants' sub-block scales on the way.
//! The integers are exact, so each block's integer sum is the scalar kernel's, and the float
//! steps after it are the scalar kernel's, blocks in order: the same bits as every other
//! ISA's block sums. Q8_0's signed weights take ggml's sign trick instead (|w| × sign(a, w),
//! widened per vector). Against the row kernel this does about half the multiplies per
//! product, and decodes each weight vector once per tile of activation rows.

use std::arch::x86_64::*;

use bulkhead_gguf::GgmlType;

use super::format::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, code as format_code, ty as format_type};
use super::packed::{self, GROUP, Res, block_offset};
use crate::quant::{Q8Acts, QK};

/// Activation rows a call handles (its sixteen accumulators of at most four rows fit the
/// sixteen AVX2 registers with the weights; a partial tile runs a smaller instance).
pub const TILE: usize = 4;

/// Rows of a packed group one call computes.
pub const HALF: usize = GROUP / 2;

/// Eight weights (row `r` in lane `r`) from sixteen packed f16 at `p`, half `h`.
///
/// # Safety
/// F16C is available and `p` points to 32 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn half_f16(p: *const u8, h: usize) -> __m256 {
    // SAFETY: the caller guarantees 32 bytes at `p`; half h's 16 of them.
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.add(16 * h).cast())) }
}

/// Half `h` (32 bytes: rows `8h..8h + 8`, four bytes each) of the packed 64-byte vector at `p`.
///
/// # Safety
/// AVX2 is available and `p` points to 64 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn half_vec(p: *const u8, h: usize) -> __m256i {
    // SAFETY: the caller guarantees 64 bytes at `p`.
    unsafe { _mm256_loadu_si256(p.add(32 * h).cast()) }
}

/// Eight rows' unsigned byte scales at `p` (half `h` of sixteen) as i16, each twice
/// (`vpmaddwd` multiplies a row's two pair sums by it).
///
/// # Safety
/// AVX2 is available and `p` points to 16 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn scale_pairs(p: *const u8, h: usize) -> __m256i {
    // SAFETY: the caller guarantees 16 bytes at `p`; half h's 8 of them.
    let x = unsafe { _mm_loadl_epi64(p.add(8 * h).cast()) };
    _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(x, x))
}

/// Four activation bytes (elements `4k..4k + 4` of a block at `q`) in every lane.
///
/// # Safety
/// `q` points to 32 readable bytes and `k < 8`.
#[inline(always)]
unsafe fn act4(q: *const i8, k: usize) -> __m256i {
    // SAFETY: as the caller guarantees.
    unsafe { _mm256_set1_epi32(std::ptr::read_unaligned(q.add(4 * k).cast::<i32>())) }
}

/// Nibbles `w` with their fifth bits set from bit `bit` of each byte of `qh` (moved to bit 4
/// by 16-bit shifts, whose bits from the neighbouring byte never reach bit 4).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn with_fifth_bit(w: __m256i, qh: __m256i, bit: usize) -> __m256i {
    let at4 = if bit <= 4 {
        _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - bit as i32))
    } else {
        _mm256_srl_epi16(qh, _mm_cvtsi32_si128(bit as i32 - 4))
    };
    _mm256_or_si256(w, _mm256_and_si256(at4, _mm256_set1_epi8(0x10)))
}

/// Half `h` of a packed group of format `F` (`nb` blocks at `g`) against `N` activation rows
/// from `first`; `res[n][..8]` receives rows `8h..8h + 8`'s results for activation row
/// `first + n`. Per block: the exact integer sum (Q4_0's and Q5_0's offset taken out as
/// `-bias · Σ a`), then `(d_w · d_a) · isum (+ m_w · s_a)` added to the row's sum.
///
/// # Safety
/// AVX2, FMA and F16C are available; `g` points to a group of `nb` packed blocks of format
/// `F`; `acts` holds rows `first..first + N` of `nb` blocks (and their group sums); `h < 2`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // `n` indexes the accumulators and activation rows alike
unsafe fn half<const F: u8, const N: usize>(g: *const u8, nb: usize, h: usize, acts: &Q8Acts, first: usize, res: &mut Res) {
    let with_min = F == Q4_1 || F == Q5_1;
    let five = F == Q5_0 || F == Q5_1;
    let bias: i32 = match F {
        Q4_0 => 8,
        Q5_0 => 16,
        _ => 0,
    };
    let (mask, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
    let gb = block_offset(format_type(F), nb, 0, 1);
    let mut total = [_mm256_setzero_ps(); N];
    // SAFETY: (whole body) offsets stay within nb packed blocks of the group and rows
    // first..first + N of nb activation blocks (2 nb group sums), as the caller guarantees.
    unsafe {
        let at = |n: usize, b: usize| (first + n) * nb + b;
        for b in 0..nb {
            let blk = g.add(b * gb);
            let dw = half_f16(blk, h);
            let mut quants = blk.add(2 * GROUP);
            let mut mw = _mm256_setzero_ps();
            if with_min {
                mw = half_f16(quants, h);
                quants = quants.add(2 * GROUP);
            }
            let mut qh = _mm256_setzero_si256();
            if five {
                qh = half_vec(quants, h);
                quants = quants.add(4 * GROUP);
            }
            let qs = |n: usize| acts.qs.as_ptr().add(at(n, b) * QK);
            let mut isum = [_mm256_setzero_si256(); N];
            if F == Q8_0 {
                for k in 0..8 {
                    let w = half_vec(quants.add(4 * GROUP * k), h);
                    let aw = _mm256_sign_epi8(w, w);
                    for n in 0..N {
                        let pairs = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(act4(qs(n), k), w));
                        isum[n] = _mm256_add_epi32(isum[n], _mm256_madd_epi16(pairs, ones));
                    }
                }
            } else {
                // Vector j's low nibbles are lane j, its high nibbles lane j + 4. Pair sums in
                // i16: all eight lanes in `lo` for 4-bit weights, lanes 4..8 in `hi` for 5-bit.
                let (mut lo, mut hi) = ([_mm256_setzero_si256(); N], [_mm256_setzero_si256(); N]);
                for j in 0..4 {
                    let p = half_vec(quants.add(4 * GROUP * j), h);
                    let (mut w0, mut w1) = (_mm256_and_si256(p, mask), _mm256_and_si256(_mm256_srli_epi16(p, 4), mask));
                    if five {
                        (w0, w1) = (with_fifth_bit(w0, qh, j), with_fifth_bit(w1, qh, j + 4));
                    }
                    for n in 0..N {
                        lo[n] = _mm256_add_epi16(lo[n], _mm256_maddubs_epi16(w0, act4(qs(n), j)));
                        let p1 = _mm256_maddubs_epi16(w1, act4(qs(n), j + 4));
                        if five {
                            hi[n] = _mm256_add_epi16(hi[n], p1);
                        } else {
                            lo[n] = _mm256_add_epi16(lo[n], p1);
                        }
                    }
                }
                for n in 0..N {
                    isum[n] = _mm256_madd_epi16(lo[n], ones);
                    if five {
                        isum[n] = _mm256_add_epi32(isum[n], _mm256_madd_epi16(hi[n], ones));
                    }
                    if bias != 0 {
                        let s = *acts.sums.get_unchecked(2 * at(n, b)) + *acts.sums.get_unchecked(2 * at(n, b) + 1);
                        isum[n] = _mm256_add_epi32(isum[n], _mm256_set1_epi32(-bias * s));
                    }
                }
            }
            // The scalar kernel's `(d_w * d_a) * isum (+ m_w * s_a)`, then `sum += t`.
            for n in 0..N {
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*acts.d.get_unchecked(at(n, b))));
                let mut t = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(isum[n]));
                if with_min {
                    t = _mm256_add_ps(t, _mm256_mul_ps(mw, _mm256_set1_ps(*acts.s.get_unchecked(at(n, b)))));
                }
                total[n] = _mm256_add_ps(total[n], t);
            }
        }
        for n in 0..N {
            _mm256_storeu_ps(res[n].as_mut_ptr(), total[n]);
        }
    }
}

/// Half `h` of sixteen rows' packed Q4_K superblocks (Q5_K with `FIVE`; `nsb` of them at
/// `g`) against `N` activation rows from `first`. Per block `j`: pair sums in i16 (all eight
/// vectors for 4-bit weights, four at a time for 5-bit), widened times the block's scale
/// (`sc_j · I_j`, exact), the min term `m_j · (s_2j + s_2j+1)`, then the scalar kernel's
/// `d_a · (d · isum - dmin · msum)` added to the superblock's sum, and the superblocks' sums
/// summed.
///
/// # Safety
/// AVX2, FMA and F16C are available; `g` points to `nsb` packed Q4_K (Q5_K) superblocks;
/// `acts` holds rows `first..first + N` of `8 * nsb` blocks (and group sums); `h < 2`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)]
unsafe fn half_q4k<const FIVE: bool, const N: usize>(g: *const u8, nsb: usize, h: usize, acts: &Q8Acts, first: usize, res: &mut Res) {
    use packed::{KSB_Q4K, KSB_Q5K, Q4K_DMIN, Q4K_MN, Q4K_QS, Q4K_SC, Q5K_QH};
    let ksb = if FIVE { KSB_Q5K } else { KSB_Q4K };
    let mask = _mm256_set1_epi8(0x0F);
    let nb = 8 * nsb;
    let mut total = [_mm256_setzero_ps(); N];
    // SAFETY: (whole body) offsets stay within nsb packed superblocks and rows first..first+N
    // of nb activation blocks and 2 nb group sums, as the caller guarantees.
    unsafe {
        for sb in 0..nsb {
            let p = g.add(sb * ksb);
            let (d, dmin) = (half_f16(p, h), half_f16(p.add(Q4K_DMIN), h));
            let mut part = [_mm256_setzero_ps(); N];
            for j in 0..8 {
                let blk = |n: usize| (first + n) * nb + sb * 8 + j;
                let qs = |n: usize| acts.qs.as_ptr().add(blk(n) * QK);
                let (mut lo, mut hi) = ([_mm256_setzero_si256(); N], [_mm256_setzero_si256(); N]);
                for k in 0..8 {
                    let v = half_vec(p.add(Q4K_QS + (8 * (j / 2) + k) * 4 * GROUP), h);
                    let mut w = if j % 2 == 0 { _mm256_and_si256(v, mask) } else { _mm256_and_si256(_mm256_srli_epi16(v, 4), mask) };
                    if FIVE {
                        // Bit j of each qh byte is its element's fifth bit in block j.
                        w = with_fifth_bit(w, half_vec(p.add(Q5K_QH + k * 4 * GROUP), h), j);
                    }
                    for n in 0..N {
                        let pairs = _mm256_maddubs_epi16(w, act4(qs(n), k));
                        if FIVE && k >= 4 {
                            hi[n] = _mm256_add_epi16(hi[n], pairs);
                        } else {
                            lo[n] = _mm256_add_epi16(lo[n], pairs);
                        }
                    }
                }
                let sc = scale_pairs(p.add(Q4K_SC + GROUP * j), h);
                // `dmin · mn` is exact in f32 (an f16 times a 6-bit integer), and so is
                // `mn · a` (below 2^24): `(dmin · mn) · a` rounds the scalar kernel's
                // `dmin · (mn · a)` once, bit for bit, without an integer multiply a row.
                let dm = _mm256_mul_ps(
                    dmin,
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(Q4K_MN + GROUP * j + HALF * h).cast()))),
                );
                for n in 0..N {
                    let mut is = _mm256_madd_epi16(lo[n], sc);
                    if FIVE {
                        is = _mm256_add_epi32(is, _mm256_madd_epi16(hi[n], sc));
                    }
                    let a = (*acts.sums.get_unchecked(2 * blk(n)) + *acts.sums.get_unchecked(2 * blk(n) + 1)) as f32;
                    let t = _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(is)), _mm256_mul_ps(dm, _mm256_set1_ps(a)));
                    part[n] = _mm256_add_ps(part[n], _mm256_mul_ps(_mm256_set1_ps(*acts.d.get_unchecked(blk(n))), t));
                }
            }
            for n in 0..N {
                total[n] = _mm256_add_ps(total[n], part[n]);
            }
        }
        for n in 0..N {
            _mm256_storeu_ps(res[n].as_mut_ptr(), total[n]);
        }
    }
}

/// Half `h` of sixteen rows' packed Q6_K superblocks against `N` activation rows from
/// `first`: as [`half_q4k`] without mins, two 16-element groups a block with their own
/// (signed) scales, pair sums in i16 two vectors at a time, and the weights' offset of 32
/// taken out as `32 · (sc_0 · Σ a_0 + sc_1 · Σ a_1)`: the scalar kernel's integer
/// `sc_0 · I_0 + sc_1 · I_1`.
///
/// # Safety
/// As [`half_q4k`], for packed Q6_K superblocks.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)]
unsafe fn half_q6k<const N: usize>(g: *const u8, nsb: usize, h: usize, acts: &Q8Acts, first: usize, res: &mut Res) {
    use packed::{KSB_Q6K, Q6K_SC, q6k_qh, q6k_ql};
    let (mask, high) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let nb = 8 * nsb;
    let mut total = [_mm256_setzero_ps(); N];
    // SAFETY: (whole body) offsets stay within nsb packed superblocks and rows first..first+N
    // of nb activation blocks (2 nb group sums), as the caller guarantees.
    unsafe {
        for sb in 0..nsb {
            let p = g.add(sb * KSB_Q6K);
            let d = half_f16(p, h);
            // Block `b`'s scaled result from its integer sum `is` (activation row `n`): the
            // offset of 32 out, then the scalar kernel's float steps.
            let value = |n: usize, b: usize, is: __m256i| {
                let blk = (first + n) * nb + sb * 8 + b;
                let [s0, s1] = [0, 1].map(|gi| _mm_loadl_epi64(p.add(Q6K_SC + GROUP * (2 * b + gi) + HALF * h).cast()));
                let sc_side = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s0, s1));
                let (a0, a1) = (*acts.sums.get_unchecked(2 * blk), *acts.sums.get_unchecked(2 * blk + 1));
                let sums = _mm256_set1_epi32((a1 << 16) | (a0 & 0xFFFF));
                let off = _mm256_slli_epi32(_mm256_madd_epi16(sc_side, sums), 5);
                let t = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(is, off)));
                _mm256_mul_ps(_mm256_set1_ps(*acts.d.get_unchecked(blk)), t)
            };
            // The sixteen-element group `gi` scales of block `b`, each twice for `vpmaddwd`.
            let scale = |b: usize, gi: usize| {
                let x = _mm_loadl_epi64(p.add(Q6K_SC + GROUP * (2 * b + gi) + HALF * h).cast());
                _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x, x))
            };
            // Bits 2u, 2u + 1 of each byte of `qh` to bits 4, 5, over the nibbles of `v`.
            let weights = |v: __m256i, qh: __m256i, u: usize| {
                let low = if u < 2 { _mm256_and_si256(v, mask) } else { _mm256_and_si256(_mm256_srli_epi16(v, 4), mask) };
                let hbits = match u {
                    0 => _mm256_slli_epi16(qh, 4),
                    1 => _mm256_slli_epi16(qh, 2),
                    2 => qh,
                    _ => _mm256_srli_epi16(qh, 2),
                };
                _mm256_or_si256(low, _mm256_and_si256(hbits, high))
            };
            let mut part = [_mm256_setzero_ps(); N];
            if N == 1 {
                // One activation row (a decode step's output head): bound by reading the
                // weights, so each quant vector is loaded once for the four blocks that
                // share it, in the layout's order. The integer sums are exact in any order
                // (pair sums still of two vectors), and the float steps run in block order as
                // in the loop after, so the bits are the same.
                let qs = |b: usize| acts.qs.as_ptr().add((first * nb + sb * 8 + b) * QK);
                for hb in 0..2 {
                    let mut is = [_mm256_setzero_si256(); 4];
                    for k2 in 0..4 {
                        let mut pairs = [_mm256_setzero_si256(); 4];
                        for k in [2 * k2, 2 * k2 + 1] {
                            let qh = half_vec(p.add(q6k_qh(8 * hb + k)), h);
                            let ql = [2 * hb, 2 * hb + 1].map(|c| half_vec(p.add(q6k_ql(8 * c + k)), h));
                            for (u, pr) in pairs.iter_mut().enumerate() {
                                let w = weights(ql[u % 2], qh, u);
                                *pr = _mm256_add_epi16(*pr, _mm256_maddubs_epi16(w, act4(qs(4 * hb + u), k)));
                            }
                        }
                        for (u, (i, pr)) in is.iter_mut().zip(pairs).enumerate() {
                            *i = _mm256_add_epi32(*i, _mm256_madd_epi16(pr, scale(4 * hb + u, k2 / 2)));
                        }
                    }
                    for (u, i) in is.into_iter().enumerate() {
                        part[0] = _mm256_add_ps(part[0], value(0, 4 * hb + u, i));
                    }
                }
            } else {
                for b in 0..8 {
                    let (hb, u) = (b / 4, b % 4);
                    let qs = |n: usize| acts.qs.as_ptr().add(((first + n) * nb + sb * 8 + b) * QK);
                    let chunk = 2 * hb + u % 2;
                    let sc = [0, 1].map(|gi| scale(b, gi));
                    let mut is = [_mm256_setzero_si256(); N];
                    for k2 in 0..4 {
                        let mut pairs = [_mm256_setzero_si256(); N];
                        for k in [2 * k2, 2 * k2 + 1] {
                            let w = weights(half_vec(p.add(q6k_ql(8 * chunk + k)), h), half_vec(p.add(q6k_qh(8 * hb + k)), h), u);
                            for n in 0..N {
                                pairs[n] = _mm256_add_epi16(pairs[n], _mm256_maddubs_epi16(w, act4(qs(n), k)));
                            }
                        }
                        for n in 0..N {
                            is[n] = _mm256_add_epi32(is[n], _mm256_madd_epi16(pairs[n], sc[k2 / 2]));
                        }
                    }
                    for n in 0..N {
                        part[n] = _mm256_add_ps(part[n], value(n, b, is[n]));
                    }
                }
            }
            for n in 0..N {
                total[n] = _mm256_add_ps(total[n], part[n]);
            }
        }
        for n in 0..N {
            _mm256_storeu_ps(res[n].as_mut_ptr(), total[n]);
        }
    }
}

/// The half-group kernel for `ty` over the largest tile it has of at most `rows` activation
/// rows, with that tile's size.
fn pick_kernel(ty: GgmlType, rows: usize) -> (packed::HalfFn, usize) {
    let tile = rows.min(TILE);
    macro_rules! tiles {
        ($kernel:ident $(, $f:expr)?) => {
            match tile {
                1 => $kernel::<$($f,)? 1> as packed::HalfFn,
                2 => $kernel::<$($f,)? 2> as packed::HalfFn,
                3 => $kernel::<$($f,)? 3> as packed::HalfFn,
                _ => $kernel::<$($f,)? TILE> as packed::HalfFn,
            }
        };
    }
    let kernel = match ty {
        GgmlType::Q4_K => tiles!(half_q4k, false),
        GgmlType::Q5_K => tiles!(half_q4k, true),
        GgmlType::Q6_K => tiles!(half_q6k),
        _ => match format_code(ty) {
            Q4_0 => tiles!(half, Q4_0),
            Q4_1 => tiles!(half, Q4_1),
            Q5_0 => tiles!(half, Q5_0),
            Q5_1 => tiles!(half, Q5_1),
            _ => tiles!(half, Q8_0),
        },
    };
    (kernel, tile)
}

/// As [`super::vnni::dot_packed`] with block sums, on AVX2.
pub(super) fn dot_packed(ty: GgmlType, p: &[u8], rows: usize, acts: &Q8Acts, first: usize, n: usize, out: &mut [f32]) {
    packed::for_each_tile(ty, p, rows, acts, first, n, out, HALF, |g, len, part, at, left, res| {
        let (kernel, k) = pick_kernel(ty, left);
        // SAFETY: only reached through an Isa at level Avx2 with block sums (detection made it:
        // AVX2, FMA, F16C); `for_each_tile` checked that `g` holds `len` packed blocks
        // (superblocks for k-quants), that rows at..at + left are within the activations,
        // and `part` < 2.
        unsafe { kernel(g.as_ptr(), len, part, acts, at, res) };
        k
    });
}
