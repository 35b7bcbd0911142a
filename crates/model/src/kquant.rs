//! ggml's k-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): 256-element superblocks, read into one
//! integer form that the dequantiser and every dot-product kernel share.
//!
//! A superblock unpacks to 256 small integer weights `q`, and per 16-element group `g` an
//! integer scale `sc[g]` and an integer min `mn[g]`, with two float factors: element `e`
//! is `(d * sc[g]) * q[e] - dmin * mn[g]` (`g = e / 16`), which is ggml's
//! `dequantize_row_*` arithmetic in its order. Types without mins have `mn = 0` and
//! `dmin = 0`; a 32-element scale (Q4_K, Q5_K) covers two groups.
//!
//! Byte layouts (ggml-common.h), `d`/`dmin` little-endian f16:
//! - Q2_K (84): `scales[16]` (low nibble scale, high nibble min, per 16), `qs[64]` (2 bits),
//!   `d`, `dmin`;
//! - Q3_K (110): `hmask[32]` (high bit), `qs[64]` (low 2 bits), `scales[12]` (sixteen 6-bit
//!   scales, offset 32), `d`;
//! - Q4_K (144): `d`, `dmin`, `scales[12]` (eight 6-bit scales and mins), `qs[128]` (nibbles);
//! - Q5_K (176): `d`, `dmin`, `scales[12]`, `qh[32]` (fifth bit), `qs[128]`;
//! - Q6_K (210): `ql[128]` (low nibbles), `qh[64]` (high 2 bits), `scales[16]` (i8), `d`.

use bulkhead_gguf::GgmlType;
use half::f16;

use crate::quant::f16_at;

/// Elements per superblock.
pub const QK_K: usize = 256;
/// Elements per scale group.
pub const GROUP: usize = 16;
/// Scale groups per superblock.
pub const GROUPS: usize = QK_K / GROUP;

/// One superblock in integer form (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct KBlock {
    /// The weights' integers, in element order.
    pub q: [i8; QK_K],
    /// Integer scale per 16-element group.
    pub sc: [i32; GROUPS],
    /// Integer min per 16-element group (0 for types without mins).
    pub mn: [i32; GROUPS],
    /// Scale factor.
    pub d: f32,
    /// Min factor (0 for types without mins).
    pub dmin: f32,
}

impl Default for KBlock {
    fn default() -> Self {
        KBlock { q: [0; QK_K], sc: [0; GROUPS], mn: [0; GROUPS], d: 0.0, dmin: 0.0 }
    }
}

/// Whether `ty` is a k-quant.
pub fn is_kquant(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K)
}

/// ggml's `get_scale_min_k4`: the `j`-th 6-bit scale and min of a Q4_K/Q5_K superblock.
#[inline(always)]
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 { (s[j] & 63, s[j + 4] & 63) } else { ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)) }
}

/// The sixteen signed 6-bit scales of a Q3_K superblock (offset 32 removed).
pub fn q3k_scales(s: &[u8]) -> [i32; GROUPS] {
    let mut out = [0; GROUPS];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = i32::from(low | (high << 4)) - 32;
    }
    out
}

/// Unpack one superblock of `ty` from its bytes into `out`.
pub fn unpack(ty: GgmlType, b: &[u8], out: &mut KBlock) {
    match ty {
        GgmlType::Q2_K => {
            let (scales, qs) = (&b[..16], &b[16..80]);
            out.d = f16_at(&b[80..]);
            out.dmin = f16_at(&b[82..]);
            for g in 0..GROUPS {
                out.sc[g] = i32::from(scales[g] & 0xF);
                out.mn[g] = i32::from(scales[g] >> 4);
            }
            // Each 128-element half: 32 bytes of 2-bit values, four shifts of two 16-groups.
            for (half, qh) in qs.chunks_exact(32).enumerate() {
                for shift in 0..4 {
                    for l in 0..32 {
                        out.q[half * 128 + shift * 32 + l] = ((qh[l] >> (2 * shift)) & 3) as i8;
                    }
                }
            }
        }
        GgmlType::Q3_K => {
            let (hmask, qs, scales) = (&b[..32], &b[32..96], &b[96..108]);
            out.d = f16_at(&b[108..]);
            out.dmin = 0.0;
            out.sc = q3k_scales(scales);
            out.mn = [0; GROUPS];
            let mut m = 1u8;
            for (half, qh) in qs.chunks_exact(32).enumerate() {
                for shift in 0..4 {
                    for l in 0..32 {
                        let low = ((qh[l] >> (2 * shift)) & 3) as i8;
                        let high = if hmask[l] & m != 0 { 0 } else { 4 };
                        out.q[half * 128 + shift * 32 + l] = low - high;
                    }
                    m <<= 1;
                }
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            out.d = f16_at(b);
            out.dmin = f16_at(&b[2..]);
            let scales = &b[4..16];
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, scales);
                out.sc[2 * j] = i32::from(sc);
                out.sc[2 * j + 1] = i32::from(sc);
                out.mn[2 * j] = i32::from(m);
                out.mn[2 * j + 1] = i32::from(m);
            }
            let five = ty == GgmlType::Q5_K;
            let (qh, qs) = if five { (&b[16..48], &b[48..176]) } else { (&b[..0], &b[16..144]) };
            // Each 64 elements: 32 bytes, low nibbles first; Q5_K's fifth bits come two per
            // 64 from each qh byte.
            for (c, chunk) in qs.chunks_exact(32).enumerate() {
                for l in 0..32 {
                    let (mut lo, mut hi) = (chunk[l] & 0xF, chunk[l] >> 4);
                    if five {
                        lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                    }
                    out.q[c * 64 + l] = lo as i8;
                    out.q[c * 64 + 32 + l] = hi as i8;
                }
            }
        }
        GgmlType::Q6_K => {
            let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
            out.d = f16_at(&b[208..]);
            out.dmin = 0.0;
            for g in 0..GROUPS {
                out.sc[g] = i32::from(scales[g] as i8);
            }
            out.mn = [0; GROUPS];
            for half in 0..2 {
                let (ql, qh) = (&ql[half * 64..], &qh[half * 32..]);
                for l in 0..32 {
                    let q = |low: u8, shift: u32| ((low | (((qh[l] >> shift) & 3) << 4)) as i8) - 32;
                    let base = half * 128;
                    out.q[base + l] = q(ql[l] & 0xF, 0);
                    out.q[base + 32 + l] = q(ql[l + 32] & 0xF, 2);
                    out.q[base + 64 + l] = q(ql[l] >> 4, 4);
                    out.q[base + 96 + l] = q(ql[l + 32] >> 4, 6);
                }
            }
        }
        other => unreachable!("{other} is not a k-quant"),
    }
}

/// Dequantise whole superblocks of `ty` (ggml's `dequantize_row_*`).
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    let bb = ty.block().map_or(0, |b| b.1);
    let mut kb = KBlock::default();
    for (blk, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(QK_K)) {
        unpack(ty, blk, &mut kb);
        for (g, og) in o.chunks_exact_mut(GROUP).enumerate() {
            let (dl, ml) = (kb.d * kb.sc[g] as f32, kb.dmin * kb.mn[g] as f32);
            for (e, v) in og.iter_mut().enumerate() {
                *v = dl * f32::from(kb.q[g * GROUP + e]) - ml;
            }
        }
    }
}

fn put_f16(out: &mut Vec<u8>, v: f32) {
    out.extend_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// Quantise whole superblocks to `ty` with plain per-group maxima (not ggml's search for
/// the best scales): valid blocks close to `x`, for test fixtures.
// Long on purpose (~150 lines): one arm per k-quant format, each a few lines of its
// layout, kept side by side so the layouts can be read against `unpack`'s.
pub fn quantize(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for sb in x.chunks_exact(QK_K) {
        let groups: Vec<&[f32]> = sb.chunks_exact(GROUP).collect();
        match ty {
            GgmlType::Q4_K | GgmlType::Q5_K => {
                let nmax = if ty == GgmlType::Q5_K { 31.0 } else { 15.0 };
                // Per 32: scale and (positive) min, then six bits each under d and dmin.
                let (mut scales, mut mins) = ([0.0f32; 8], [0.0f32; 8]);
                for j in 0..8 {
                    let v = &sb[j * 32..(j + 1) * 32];
                    let lo = v.iter().copied().fold(0.0f32, f32::min);
                    let hi = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    scales[j] = (hi - lo) / nmax;
                    mins[j] = -lo;
                }
                let d = scales.iter().copied().fold(0.0f32, f32::max) / 63.0;
                let dmin = mins.iter().copied().fold(0.0f32, f32::max) / 63.0;
                let (df, dminf) = (f16::from_f32(d).to_f32(), f16::from_f32(dmin).to_f32());
                let q6 = |v: f32, f: f32| if f > 0.0 { (v / f).round().clamp(0.0, 63.0) as u8 } else { 0 };
                let ls: Vec<u8> = scales.iter().map(|&s| q6(s, df)).collect();
                let lm: Vec<u8> = mins.iter().map(|&m| q6(m, dminf)).collect();
                let mut sc = [0u8; 12];
                for j in 0..8 {
                    if j < 4 {
                        sc[j] = ls[j];
                        sc[j + 4] = lm[j];
                    } else {
                        sc[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4);
                        sc[j - 4] |= (ls[j] >> 4) << 6;
                        sc[j] |= (lm[j] >> 4) << 6;
                    }
                }
                put_f16(&mut out, d);
                put_f16(&mut out, dmin);
                out.extend_from_slice(&sc);
                let mut l = [0u8; QK_K];
                for j in 0..8 {
                    let (s, m) = scale_min_k4(j, &sc);
                    let (dl, ml) = (df * f32::from(s), dminf * f32::from(m));
                    for i in 0..32 {
                        let v = sb[j * 32 + i];
                        l[j * 32 + i] = if dl > 0.0 { ((v + ml) / dl).round().clamp(0.0, nmax) as u8 } else { 0 };
                    }
                }
                if ty == GgmlType::Q5_K {
                    let mut qh = [0u8; 32];
                    for c in 0..4 {
                        for i in 0..32 {
                            qh[i] |= ((l[c * 64 + i] >> 4) & 1) << (2 * c);
                            qh[i] |= ((l[c * 64 + 32 + i] >> 4) & 1) << (2 * c + 1);
                        }
                    }
                    out.extend_from_slice(&qh);
                }
                for c in 0..4 {
                    out.extend((0..32).map(|i| (l[c * 64 + i] & 0xF) | ((l[c * 64 + 32 + i] & 0xF) << 4)));
                }
            }
            GgmlType::Q6_K | GgmlType::Q3_K => {
                let (qmax, smax) = if ty == GgmlType::Q6_K { (31.0, 127.0) } else { (3.0, 31.0) };
                let scales: Vec<f32> = groups.iter().map(|g| g.iter().fold(0.0f32, |m, v| m.max(v.abs())) / qmax).collect();
                let d = scales.iter().copied().fold(0.0f32, f32::max) / smax;
                let df = f16::from_f32(d).to_f32();
                let ls: Vec<i32> =
                    scales.iter().map(|&s| if df > 0.0 { (s / df).round().clamp(-smax - 1.0, smax) as i32 } else { 0 }).collect();
                let mut l = [0i32; QK_K];
                for (g, grp) in groups.iter().enumerate() {
                    let dl = df * ls[g] as f32;
                    for (i, &v) in grp.iter().enumerate() {
                        l[g * GROUP + i] = if dl != 0.0 { (v / dl).round().clamp(-qmax - 1.0, qmax) as i32 } else { 0 };
                    }
                }
                if ty == GgmlType::Q6_K {
                    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
                    for half in 0..2 {
                        for i in 0..32 {
                            let u = |e: usize| (l[half * 128 + e] + 32) as u8;
                            let (q1, q2, q3, q4) = (u(i), u(i + 32), u(i + 64), u(i + 96));
                            ql[half * 64 + i] = (q1 & 0xF) | ((q3 & 0xF) << 4);
                            ql[half * 64 + 32 + i] = (q2 & 0xF) | ((q4 & 0xF) << 4);
                            qh[half * 32 + i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
                        }
                    }
                    out.extend_from_slice(&ql);
                    out.extend_from_slice(&qh);
                    out.extend(ls.iter().map(|&s| s as i8 as u8));
                    put_f16(&mut out, d);
                } else {
                    let (mut hmask, mut qs, mut sc) = ([0u8; 32], [0u8; 64], [0u8; 12]);
                    for (j, &s) in ls.iter().enumerate() {
                        let v = (s + 32) as u8;
                        if j < 8 {
                            sc[j] = v & 0xF;
                        } else {
                            sc[j - 8] |= (v & 0xF) << 4;
                        }
                        sc[8 + j % 4] |= (v >> 4) << (2 * (j / 4));
                    }
                    for half in 0..2 {
                        for shift in 0..4 {
                            for i in 0..32 {
                                let e = half * 128 + shift * 32 + i;
                                let u = (l[e] + 4) as u8;
                                if u > 3 {
                                    hmask[i] |= 1 << (half * 4 + shift);
                                }
                                qs[half * 32 + i] |= (u & 3) << (2 * shift);
                            }
                        }
                    }
                    out.extend_from_slice(&hmask);
                    out.extend_from_slice(&qs);
                    out.extend_from_slice(&sc);
                    put_f16(&mut out, d);
                }
            }
            GgmlType::Q2_K => {
                let (mut scales, mut mins) = ([0.0f32; GROUPS], [0.0f32; GROUPS]);
                for (g, grp) in groups.iter().enumerate() {
                    let lo = grp.iter().copied().fold(0.0f32, f32::min);
                    let hi = grp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    scales[g] = (hi - lo) / 3.0;
                    mins[g] = -lo;
                }
                let d = scales.iter().copied().fold(0.0f32, f32::max) / 15.0;
                let dmin = mins.iter().copied().fold(0.0f32, f32::max) / 15.0;
                let (df, dminf) = (f16::from_f32(d).to_f32(), f16::from_f32(dmin).to_f32());
                let q4 = |v: f32, f: f32| if f > 0.0 { (v / f).round().clamp(0.0, 15.0) as u8 } else { 0 };
                let sc: Vec<u8> = (0..GROUPS).map(|g| q4(scales[g], df) | (q4(mins[g], dminf) << 4)).collect();
                let mut qs = [0u8; 64];
                for (g, grp) in groups.iter().enumerate() {
                    let (dl, ml) = (df * f32::from(sc[g] & 0xF), dminf * f32::from(sc[g] >> 4));
                    for (i, &v) in grp.iter().enumerate() {
                        let e = g * GROUP + i;
                        let q = if dl > 0.0 { ((v + ml) / dl).round().clamp(0.0, 3.0) as u8 } else { 0 };
                        let (half, rest) = (e / 128, e % 128);
                        qs[half * 32 + rest % 32] |= q << (2 * (rest / 32));
                    }
                }
                out.extend_from_slice(&sc);
                out.extend_from_slice(&qs);
                put_f16(&mut out, d);
                put_f16(&mut out, dmin);
            }
            other => unreachable!("{other} is not a k-quant"),
        }
    }
    out
}
