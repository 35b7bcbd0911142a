//! AVX-512 VNNI kernel over packed weights ([`super::packed`]): eight weight rows against up
//! to four activation rows per call, one `vpdpbusd` (256-bit, AVX-512VL encoding) per four
//! bytes of eight rows. Every function here is `#[target_feature]`; `kernels/mod.rs` reaches
//! them only after `Isa::detect` confirmed the features.
//!
//! Integer sums are exact (u8 × i8 products summed in i32 cannot overflow for 32-element
//! blocks). Per (weight row, activation row) pair the float operations are the same whatever
//! else shares the call: per block `acc = fma(d_w * d_a, sum, acc)`, then for Q4_1
//! `acc = fma(m_w, s_a, acc)`, blocks in order.

use std::arch::x86_64::*;

use bulkhead_gguf::GgmlType;

use super::packed::{block_offset, GROUP};
use super::TILE;
use crate::quant::{Q8Acts, QK};

/// Eight weight rows (one packed group) against `N` activation rows starting at `first`.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C, AVX-512F/VL/VNNI; `g` points to `nb` packed blocks of `ty`;
/// `acts` holds rows `first..first + N` of `nb` blocks (`qs`, `d`, `s`, `qsum`).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn group<const N: usize>(ty: GgmlType, g: *const u8, nb: usize, acts: &Q8Acts, first: usize, res: &mut [[f32; GROUP]; TILE]) {
    let mut acc = [_mm256_setzero_ps(); N];
    let mask = _mm256_set1_epi8(0x0F);
    let zero = _mm256_setzero_si256();
    let gb = block_offset(ty, nb, 0, 1);
    // Activation bias of the weights' zero point: Q4_0 stores q = w + 8, Q8_0 w + 128.
    let bias = match ty {
        GgmlType::Q4_0 => 8,
        GgmlType::Q8_0 => 128,
        _ => 0,
    };
    // SAFETY (whole body): offsets stay within nb blocks of the group and N rows of nb
    // activation blocks, as the caller guarantees; loads are unaligned.
    unsafe {
        for b in 0..nb {
            let blk = g.add(b * gb);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.cast()));
            let (mw, quants) = match ty {
                GgmlType::Q4_1 => (_mm256_cvtph_ps(_mm_loadu_si128(blk.add(16).cast())), blk.add(32)),
                _ => (_mm256_setzero_ps(), blk.add(16)),
            };
            let mut v = [zero; 8];
            if ty == GgmlType::Q8_0 {
                for (k, vk) in v.iter_mut().enumerate() {
                    *vk = _mm256_loadu_si256(quants.add(32 * k).cast());
                }
            } else {
                for k in 0..4 {
                    let p = _mm256_loadu_si256(quants.add(32 * k).cast());
                    v[k] = _mm256_and_si256(p, mask);
                    v[k + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), mask);
                }
            }
            for (n, a) in acc.iter_mut().enumerate() {
                let ab = (first + n) * nb + b;
                let q = acts.qs.as_ptr().add(ab * QK);
                let bc = |o: usize| _mm256_set1_epi32(std::ptr::read_unaligned(q.add(o).cast::<i32>()));
                // Two chains halve the dependency depth; integer adds are exact.
                let mut i0 = _mm256_dpbusd_epi32(zero, v[0], bc(0));
                let mut i1 = _mm256_dpbusd_epi32(zero, v[1], bc(4));
                i0 = _mm256_dpbusd_epi32(i0, v[2], bc(8));
                i1 = _mm256_dpbusd_epi32(i1, v[3], bc(12));
                i0 = _mm256_dpbusd_epi32(i0, v[4], bc(16));
                i1 = _mm256_dpbusd_epi32(i1, v[5], bc(20));
                i0 = _mm256_dpbusd_epi32(i0, v[6], bc(24));
                i1 = _mm256_dpbusd_epi32(i1, v[7], bc(28));
                let mut sum = _mm256_add_epi32(i0, i1);
                if bias != 0 {
                    sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(bias * *acts.qsum.get_unchecked(ab)));
                }
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*acts.d.get_unchecked(ab)));
                *a = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sum), *a);
                if ty == GgmlType::Q4_1 {
                    *a = _mm256_fmadd_ps(mw, _mm256_set1_ps(*acts.s.get_unchecked(ab)), *a);
                }
            }
        }
        for (r, a) in res.iter_mut().zip(&acc) {
            _mm256_storeu_ps(r.as_mut_ptr(), *a);
        }
    }
}

/// `out[i * rows + r] = dot(row r, activation row first + i)` for the `rows` rows held by
/// the packed groups in `p` (`rows` may end inside the last group): activation-major, so each
/// group's eight results are contiguous.
pub(super) fn dot_packed(ty: GgmlType, p: &[u8], rows: usize, acts: &Q8Acts, first: usize, n: usize, out: &mut [f32]) {
    let nb = acts.blocks_per_row();
    let group_bytes = block_offset(ty, nb, 1, 0);
    let end = (first + n) * nb;
    // These bounds are what `group` relies on.
    assert!(p.len() == rows.div_ceil(GROUP) * group_bytes, "packed groups for {rows} rows");
    assert!(out.len() == rows * n, "output shape");
    assert!(acts.qs.len() >= end * QK && acts.d.len() >= end && acts.s.len() >= end && acts.qsum.len() >= end, "activations too short");
    for (gi, g) in p.chunks_exact(group_bytes).enumerate() {
        let lanes = (rows - gi * GROUP).min(GROUP);
        let mut i = 0;
        while i < n {
            let k = (n - i).min(TILE);
            let mut res = [[0.0f32; GROUP]; TILE];
            // SAFETY: only reached with Isa::Avx512Vnni (features detected); `g` holds nb
            // packed blocks and rows first+i..first+i+k < first+n are within the asserted
            // activation lengths.
            unsafe {
                match k {
                    4 => group::<4>(ty, g.as_ptr(), nb, acts, first + i, &mut res),
                    3 => group::<3>(ty, g.as_ptr(), nb, acts, first + i, &mut res),
                    2 => group::<2>(ty, g.as_ptr(), nb, acts, first + i, &mut res),
                    _ => group::<1>(ty, g.as_ptr(), nb, acts, first + i, &mut res),
                }
            }
            for (j, r) in res.iter().enumerate().take(k) {
                let at = (i + j) * rows + gi * GROUP;
                out[at..at + lanes].copy_from_slice(&r[..lanes]);
            }
            i += k;
        }
    }
}
