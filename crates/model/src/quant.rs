//! Block formats of quantised weights and of quantised activations.
//!
//! Weights keep ggml's block layouts byte for byte (they are copied out of the GGUF file):
//! - Q4_0: `d: f16, qs: [u8; 16]`, value `d * (q - 8)`;
//! - Q4_1: `d: f16, m: f16, qs: [u8; 16]`, value `d * q + m`;
//! - Q5_0: `d: f16, qh: u32, qs: [u8; 16]`, value `d * (q - 16)` with bit `j` of `qh` the
//!   fifth bit of element `j`;
//! - Q5_1: `d: f16, m: f16, qh: u32, qs: [u8; 16]`, value `d * q + m`;
//! - Q8_0: `d: f16, qs: [i8; 32]`, value `d * q`;
//! - BF16: the high half of an f32;
//! - the k-quants' 256-element superblocks: [`crate::kquant`].
//!
//! In a 4-bit block, byte `j` holds element `j` in its low nibble and element `j + 16` in its
//! high nibble. Activations are quantised per 32-element block to 8 bits the way llama.cpp
//! does (Q8_1: scale `d` rounded to f16 and `s = d * sum(q)` for the Q4_1 offset term), so our
//! integer dot products see the same numbers as llama.cpp's.

use half::f16;

/// Elements per quantisation block.
pub const QK: usize = 32;

/// Activations of `rows` rows, each quantised to 8-bit blocks.
#[derive(Debug, Default, Clone)]
pub struct Q8Acts {
    /// Number of rows.
    pub rows: usize,
    /// Elements per row (a multiple of [`QK`]).
    pub cols: usize,
    /// Per block scale (already rounded through f16), `rows * cols / QK`.
    pub d: Vec<f32>,
    /// Per block `d * sum(q)` (rounded through f16), for Q4_1's offset.
    pub s: Vec<f32>,
    /// Quantised values, `rows * cols`.
    pub qs: Vec<i8>,
    /// Sums of `qs` per 16 values, `rows * cols / 16`: the k-quants' min terms.
    pub sums: Vec<i32>,
}

impl Q8Acts {
    /// Blocks per row.
    pub fn blocks_per_row(&self) -> usize {
        self.cols / QK
    }
}

/// f16 stored little-endian at `b[0..2]`.
#[inline(always)]
pub fn f16_at(b: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Dequantise one row of `cols` elements of type `ty` from its bytes into `out`.
pub fn dequantize_row(ty: bulkhead_gguf::GgmlType, bytes: &[u8], out: &mut [f32]) {
    use bulkhead_gguf::GgmlType as T;
    match ty {
        T::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        T::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16_at(c);
            }
        }
        T::Q4_0 => {
            for (o, blk) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(18)) {
                let d = f16_at(blk);
                for j in 0..16 {
                    o[j] = d * (f32::from(blk[2 + j] & 0x0F) - 8.0);
                    o[j + 16] = d * (f32::from(blk[2 + j] >> 4) - 8.0);
                }
            }
        }
        T::Q4_1 => {
            for (o, blk) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(20)) {
                let (d, m) = (f16_at(blk), f16_at(&blk[2..]));
                for j in 0..16 {
                    o[j] = d * f32::from(blk[4 + j] & 0x0F) + m;
                    o[j + 16] = d * f32::from(blk[4 + j] >> 4) + m;
                }
            }
        }
        T::Q8_0 => {
            for (o, blk) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(34)) {
                let d = f16_at(blk);
                for j in 0..QK {
                    o[j] = d * f32::from(blk[2 + j] as i8);
                }
            }
        }
        T::Q5_0 | T::Q5_1 => {
            let (bb, has_min) = if ty == T::Q5_1 { (24, true) } else { (22, false) };
            for (o, blk) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(bb)) {
                let (q, _) = q5_values(blk, has_min);
                let d = f16_at(blk);
                if has_min {
                    let m = f16_at(&blk[2..]);
                    for j in 0..QK {
                        o[j] = f32::from(q[j]) * d + m;
                    }
                } else {
                    for j in 0..QK {
                        o[j] = f32::from(q[j]) * d;
                    }
                }
            }
        }
        T::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
            }
        }
        T::Q2_K | T::Q3_K | T::Q4_K | T::Q5_K | T::Q6_K => crate::kquant::dequantize(ty, bytes, out),
        T::Other(c) => unreachable!("ggml type {c} is refused when weights are loaded"),
    }
}

/// The 32 integers of a Q5_0 (`q - 16`) or Q5_1 (`q`) block and where its nibbles start.
#[inline]
pub fn q5_values(blk: &[u8], has_min: bool) -> ([i8; QK], usize) {
    let at = if has_min { 4 } else { 2 };
    let qh = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
    let qs = &blk[at + 4..at + 20];
    let off = if has_min { 0 } else { 16 };
    let mut q = [0i8; QK];
    for j in 0..16 {
        let h0 = ((qh >> j) & 1) as u8;
        let h1 = ((qh >> (j + 16)) & 1) as u8;
        q[j] = ((qs[j] & 0x0F) | (h0 << 4)) as i8 - off;
        q[j + 16] = ((qs[j] >> 4) | (h1 << 4)) as i8 - off;
    }
    (q, at + 4)
}

/// Quantise `x` (a multiple of 32 values) to ggml bytes of type `ty`, the way
/// ggml's reference quantisers do. Used to build test fixtures.
pub fn quantize_row(ty: bulkhead_gguf::GgmlType, x: &[f32]) -> Vec<u8> {
    use bulkhead_gguf::GgmlType as T;
    let mut out = Vec::new();
    match ty {
        T::F32 => x.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        T::F16 => x.iter().for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes())),
        T::Q4_0 => {
            for b in x.chunks_exact(QK) {
                // ggml: scale from the value of largest magnitude, mapped to -8.
                let max = b.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                for j in 0..16 {
                    let q0 = ((b[j] * id + 8.5) as u8).min(15);
                    let q1 = ((b[j + 16] * id + 8.5) as u8).min(15);
                    out.push(q0 | (q1 << 4));
                }
            }
        }
        T::Q4_1 => {
            for b in x.chunks_exact(QK) {
                let min = b.iter().copied().fold(f32::INFINITY, f32::min);
                let max = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_bits().to_le_bytes());
                for j in 0..16 {
                    let q0 = (((b[j] - min) * id + 0.5) as u8).min(15);
                    let q1 = (((b[j + 16] - min) * id + 0.5) as u8).min(15);
                    out.push(q0 | (q1 << 4));
                }
            }
        }
        T::Q8_0 => {
            for b in x.chunks_exact(QK) {
                let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                out.extend(b.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        T::Q5_0 | T::Q5_1 => {
            let has_min = ty == T::Q5_1;
            for b in x.chunks_exact(QK) {
                // ggml's reference: Q5_0 from the value of largest magnitude mapped to -16,
                // Q5_1 from the range.
                let (d, m) = if has_min {
                    let min = b.iter().copied().fold(f32::INFINITY, f32::min);
                    let max = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    ((max - min) / 31.0, min)
                } else {
                    let max = b.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                    (max / -16.0, 0.0)
                };
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                if has_min {
                    out.extend_from_slice(&f16::from_f32(m).to_bits().to_le_bytes());
                }
                let q: Vec<u8> = if has_min {
                    b.iter().map(|&v| (((v - m) * id + 0.5) as u8).min(31)).collect()
                } else {
                    b.iter().map(|&v| ((v * id + 16.5) as u8).min(31)).collect()
                };
                let qh = (0..QK).fold(0u32, |h, j| h | (u32::from(q[j] >> 4) << j));
                out.extend_from_slice(&qh.to_le_bytes());
                out.extend((0..16).map(|j| (q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4)));
            }
        }
        T::BF16 => x.iter().for_each(|v| {
            // Round to nearest even, as torch and ggml do.
            let b = v.to_bits();
            let r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
            out.extend_from_slice(&r.to_le_bytes());
        }),
        T::Q2_K | T::Q3_K | T::Q4_K | T::Q5_K | T::Q6_K => out = crate::kquant::quantize(ty, x),
        T::Other(c) => panic!("cannot quantise to ggml type {c}"),
    }
    out
}
