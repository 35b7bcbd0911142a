//! Block formats of quantised weights and of quantised activations.
//!
//! Weights keep ggml's block layouts byte for byte (they are copied out of the GGUF file):
//! - Q4_0: `d: f16, qs: [u8; 16]`, value `d * (q - 8)`;
//! - Q4_1: `d: f16, m: f16, qs: [u8; 16]`, value `d * q + m`;
//! - Q8_0: `d: f16, qs: [i8; 32]`, value `d * q`.
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
        T::Other(c) => unreachable!("ggml type {c} is refused when weights are loaded"),
    }
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
        T::Other(c) => panic!("cannot quantise to ggml type {c}"),
    }
    out
}
