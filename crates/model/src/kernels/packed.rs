//! Weights regrouped for the packed kernels: sixteen matrix rows interleaved block by block,
//! so one 512-bit `vpdpbusd` multiplies four bytes of each of sixteen rows with the same
//! four activation bytes and leaves sixteen row sums, one per lane (the AVX2 kernel,
//! `avx2_packed.rs`, takes each vector's two 32-byte halves, eight rows each, apart).
//!
//! Per group of sixteen rows and per 32-element block (`16 * block_bytes(ty)` bytes, the
//! same size as the sixteen rows' blocks it replaces):
//! - `d[16]` (f16), then for Q4_1 and Q5_1 `m[16]` (f16);
//! - Q5_0 and Q5_1: then one 64-byte vector of the sixteen rows' `qh`, four bytes each,
//!   transposed: bit `k` of byte `e` is element `4k + e`'s fifth bit (ggml's `qh` has it at
//!   bit `4k + e`), so a lane's four fifth bits sit one in each of its four bytes; then their
//!   nibbles as for Q4_0;
//! - Q4_0 and Q4_1: four 64-byte vectors; vector `k` holds bytes `4k..4k+4` of each row's
//!   16 nibble bytes, row after row: low nibbles are elements `4k..4k+4`, high nibbles
//!   elements `16+4k..16+4k+4`;
//! - Q8_0: eight 64-byte vectors; vector `k` holds elements `4k..4k+4` of each row.
//!
//! Either way lane `k` of the kernel's integer dot product covers the same elements as lane
//! `k` of the AVX2 row kernel's, which is what keeps the two bit-identical.
//!
//! Rows past the last group boundary are zero (scale 0), and their results are discarded.
//! Packing is a permutation of the bytes (of the bits, within a Q5 row's `qh`), so
//! [`unpack`] restores the original rows exactly.
//!
//! The k-quants Q4_K, Q5_K and Q6_K are packed per 256-element superblock instead (16 rows'
//! superblocks together, [`KSB_Q4K`] and [`KSB_Q6K`] bytes):
//! - Q4_K: `d[16]`, `dmin[16]` (f16); the eight 6-bit scales and eight mins decoded to bytes,
//!   `sc[8][16]` then `mn[8][16]` (so a kernel reads sixteen rows' scale as one vector; 64
//!   bytes more than the 16 rows' 192 bytes of packed scales); then 32 vectors of 64 bytes,
//!   vector `8c + k` holding bytes `32c + 4k..32c + 4k + 4` of each row's 128 nibble bytes:
//!   low nibbles are lane `k` of block `2c`, high nibbles lane `k` of block `2c + 1`.
//! - Q5_K: Q4_K's layout (the nibbles from ggml's `qs`), then 8 vectors of the fifth bits,
//!   vector `k` holding bytes `4k..4k + 4` of each row's 32-byte `qh` (bit `j` of byte `l` is
//!   element `l`'s fifth bit in block `j`, as in ggml).
//! - Q6_K: `d[16]` (f16); the sixteen i8 scales as `sc[16][16]`; 32 vectors of the low nibbles,
//!   vector `8c + k` holding bytes `32c + 4k..32c + 4k + 4` of each row's `ql` (source chunk
//!   `c` = `ql[32c..32c + 32]`: low nibbles block `4(c / 2) + c % 2`, high nibbles block
//!   `4(c / 2) + 2 + c % 2`), and 16 vectors of the high bits, vector `8h + k` holding bytes
//!   `32h + 4k..32h + 4k + 4` of each row's `qh` (bits `2u, 2u + 1` of a byte belong to block
//!   `4h + u`). The 48 vectors are stored as triples in the order the one-row kernel reads
//!   them ([`q6k_qh`], [`q6k_ql`]): high-bit vector `8h + k`, then nibble vectors
//!   `8(2h) + k` and `8(2h + 1) + k`. A superblock is then read front to back, which the
//!   hardware prefetcher follows; read as three interleaved runs it streamed from memory at a
//!   third of Q4_K's rate. The same size as the rows.
//!
//! Lane `k` of a block again covers the elements the AVX2 row kernel's lane `k` covers.

use bulkhead_gguf::GgmlType;

use crate::quant::{Q8Acts, QK};

/// Whether the packed kernels have a packed layout for `ty` (the others stay in rows and
/// run the AVX2 row kernel).
pub fn supports(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0) || is_packed_kquant(ty)
}

/// Whether `ty` is a k-quant with a packed superblock layout.
pub fn is_packed_kquant(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K)
}

/// Bytes of one packed group (sixteen rows) of rows of `row_bytes` bytes.
pub fn group_bytes(ty: GgmlType, row_bytes: usize) -> usize {
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
            let (src, dst) = ksb_sizes(ty);
            row_bytes / src * dst
        }
        _ => GROUP * row_bytes,
    }
}

/// Bytes of a Q4_K, a Q5_K and a Q6_K superblock in ggml's row layout.
const Q4K_BYTES: usize = 144;
const Q5K_BYTES: usize = 176;
const Q6K_BYTES: usize = 210;

/// Bytes of sixteen rows' packed Q4_K superblock: d, dmin, sc, mn, 32 nibble vectors.
pub const KSB_Q4K: usize = 2 * 2 * GROUP + 2 * 8 * GROUP + 32 * 4 * GROUP;
/// Offsets in a packed Q4_K superblock: dmin, the scales, the mins, the nibble vectors.
pub const Q4K_DMIN: usize = 2 * GROUP;
pub const Q4K_SC: usize = 4 * GROUP;
pub const Q4K_MN: usize = Q4K_SC + 8 * GROUP;
pub const Q4K_QS: usize = Q4K_MN + 8 * GROUP;

/// Bytes of sixteen rows' packed Q5_K superblock: Q4_K's layout, then 8 vectors of fifth bits.
pub const KSB_Q5K: usize = KSB_Q4K + 8 * 4 * GROUP;
/// Offset of the fifth bits' vectors in a packed Q5_K superblock.
pub const Q5K_QH: usize = KSB_Q4K;

/// Bytes of sixteen rows' packed Q6_K superblock: d, sc, 32 nibble vectors, 16 high-bit vectors.
pub const KSB_Q6K: usize = 2 * GROUP + 16 * GROUP + 48 * 4 * GROUP;
/// Offset of the scales in a packed Q6_K superblock.
pub const Q6K_SC: usize = 2 * GROUP;
/// Offset of the 48 vectors (triples of a high-bit and two nibble vectors) after them.
const Q6K_VECS: usize = Q6K_SC + 16 * GROUP;

/// Offset of high-bit vector `v` (`8h + k`) in a packed Q6_K superblock: its triple's first.
pub const fn q6k_qh(v: usize) -> usize {
    Q6K_VECS + 3 * v * 4 * GROUP
}

/// Offset of nibble vector `v` (`8c + k`, chunk `c`) in a packed Q6_K superblock: in the
/// triple of high-bit vector `8(c / 2) + k`, second for an even chunk, third for an odd one.
pub const fn q6k_ql(v: usize) -> usize {
    let (c, k) = (v / 8, v % 8);
    q6k_qh(8 * (c / 2) + k) + (1 + c % 2) * 4 * GROUP
}

/// Where byte `q` of row `r`'s run of bytes lands among the packed vectors: vector `q / 4`,
/// row `r`, byte `q % 4`.
fn vec_dest(q: usize, r: usize) -> usize {
    (q / 4) * 4 * GROUP + r * 4 + q % 4
}

/// Pack one row's superblock `sb` (ggml layout) into lane `r` of a packed group superblock.
fn pack_ksb(ty: GgmlType, sb: &[u8], r: usize, out: &mut [u8]) {
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K => {
            out[2 * r..2 * r + 2].copy_from_slice(&sb[0..2]);
            out[Q4K_DMIN + 2 * r..Q4K_DMIN + 2 * r + 2].copy_from_slice(&sb[2..4]);
            for j in 0..8 {
                let (s, m) = crate::kquant::scale_min_k4(j, &sb[4..16]);
                out[Q4K_SC + j * GROUP + r] = s;
                out[Q4K_MN + j * GROUP + r] = m;
            }
            let qs = if ty == GgmlType::Q5_K { 48 } else { 16 };
            for (q, &b) in sb[qs..qs + 128].iter().enumerate() {
                out[Q4K_QS + vec_dest(q, r)] = b;
            }
            if ty == GgmlType::Q5_K {
                for (q, &b) in sb[16..48].iter().enumerate() {
                    out[Q5K_QH + vec_dest(q, r)] = b;
                }
            }
        }
        GgmlType::Q6_K => {
            out[2 * r..2 * r + 2].copy_from_slice(&sb[208..210]);
            for g in 0..16 {
                out[Q6K_SC + g * GROUP + r] = sb[192 + g];
            }
            for (q, &b) in sb[..128].iter().enumerate() {
                out[q6k_ql(q / 4) + vec_dest(q % 4, r)] = b;
            }
            for (q, &b) in sb[128..192].iter().enumerate() {
                out[q6k_qh(q / 4) + vec_dest(q % 4, r)] = b;
            }
        }
        other => unreachable!("{other} has no packed superblock layout"),
    }
}

/// The inverse of [`pack_ksb`]: lane `r` of a packed group superblock as ggml's superblock.
fn unpack_ksb(ty: GgmlType, p: &[u8], r: usize, sb: &mut [u8]) {
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K => {
            sb[0..2].copy_from_slice(&p[2 * r..2 * r + 2]);
            sb[2..4].copy_from_slice(&p[Q4K_DMIN + 2 * r..Q4K_DMIN + 2 * r + 2]);
            let sc = |j: usize| p[Q4K_SC + j * GROUP + r];
            let mn = |j: usize| p[Q4K_MN + j * GROUP + r];
            // The inverse of `scale_min_k4`: 96 bits, sixteen 6-bit values, one way each.
            for j in 0..4 {
                sb[4 + j] = (sc(j) & 63) | ((sc(j + 4) >> 4) << 6);
                sb[8 + j] = (mn(j) & 63) | ((mn(j + 4) >> 4) << 6);
                sb[12 + j] = (sc(j + 4) & 0xF) | ((mn(j + 4) & 0xF) << 4);
            }
            let qs = if ty == GgmlType::Q5_K { 48 } else { 16 };
            for (q, b) in sb[qs..qs + 128].iter_mut().enumerate() {
                *b = p[Q4K_QS + vec_dest(q, r)];
            }
            if ty == GgmlType::Q5_K {
                for (q, b) in sb[16..48].iter_mut().enumerate() {
                    *b = p[Q5K_QH + vec_dest(q, r)];
                }
            }
        }
        GgmlType::Q6_K => {
            sb[208..210].copy_from_slice(&p[2 * r..2 * r + 2]);
            for g in 0..16 {
                sb[192 + g] = p[Q6K_SC + g * GROUP + r];
            }
            for (q, b) in sb[..128].iter_mut().enumerate() {
                *b = p[q6k_ql(q / 4) + vec_dest(q % 4, r)];
            }
            for (q, b) in sb[128..192].iter_mut().enumerate() {
                *b = p[q6k_qh(q / 4) + vec_dest(q % 4, r)];
            }
        }
        other => unreachable!("{other} has no packed superblock layout"),
    }
}

/// The bytes of a source and a packed superblock of `ty`.
fn ksb_sizes(ty: GgmlType) -> (usize, usize) {
    match ty {
        GgmlType::Q4_K => (Q4K_BYTES, KSB_Q4K),
        GgmlType::Q5_K => (Q5K_BYTES, KSB_Q5K),
        _ => (Q6K_BYTES, KSB_Q6K),
    }
}

fn pack_kquant(ty: GgmlType, rows: usize, row_bytes: usize, data: &[u8]) -> Vec<u8> {
    let (src, dst) = ksb_sizes(ty);
    let nsb = row_bytes / src;
    let mut out = vec![0u8; rows.div_ceil(GROUP) * nsb * dst];
    for (r, row) in data.chunks_exact(row_bytes).enumerate().take(rows) {
        let (g, lane) = (r / GROUP, r % GROUP);
        for (s, sb) in row.chunks_exact(src).enumerate() {
            let at = (g * nsb + s) * dst;
            pack_ksb(ty, sb, lane, &mut out[at..at + dst]);
        }
    }
    out
}

/// Bytes of one 32-element block of Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0.
pub(super) fn block_bytes(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_0 => 18,
        GgmlType::Q4_1 => 20,
        GgmlType::Q5_0 => 22,
        GgmlType::Q5_1 => 24,
        GgmlType::Q8_0 => 34,
        other => unreachable!("{other} has no packed layout"),
    }
}

/// Rows in a group.
pub const GROUP: usize = 16;

/// The most activation rows a packed kernel call handles.
pub const MAX_TILE: usize = 4;

/// Results of one packed kernel call: a group's rows for each of up to [`MAX_TILE`]
/// activation rows.
pub type Res = [[f32; GROUP]; MAX_TILE];

/// A kernel over `width` rows of a group ([`for_each_tile`]'s `call` with its arguments:
/// the group, its length in blocks (superblocks for k-quants), which `width` rows of it, the
/// first activation row, the results).
pub type HalfFn = unsafe fn(*const u8, usize, usize, &Q8Acts, usize, &mut Res);

/// Drive a packed kernel over the groups in `p` (`rows` rows, which may end inside the last
/// group), `width` rows a call (16 or 8), and tiles of the `n` activation rows from `first`:
/// `call(group, blocks, part, first row, rows left, res)` fills `res` for the group's rows
/// `part * width..` and returns how many activation rows it did. Writes `out[i * rows + r] =
/// dot(row r, activation row first + i)`. Checks the shapes the kernels rely on.
#[allow(clippy::too_many_arguments)] // mirrors kernels::dot_q_packed, plus the kernel
pub(super) fn for_each_tile(
    ty: GgmlType,
    p: &[u8],
    rows: usize,
    acts: &Q8Acts,
    first: usize,
    n: usize,
    out: &mut [f32],
    width: usize,
    mut call: impl FnMut(&[u8], usize, usize, usize, usize, &mut Res) -> usize,
) {
    let nb = acts.blocks_per_row();
    let row_bytes = ty.bytes_for((nb * QK) as u64).map_or(0, |b| b as usize);
    let gbytes = group_bytes(ty, row_bytes);
    let end = (first + n) * nb;
    assert!(row_bytes > 0 && p.len() == rows.div_ceil(GROUP) * gbytes, "packed groups for {rows} rows");
    assert!(out.len() == rows * n, "output shape");
    assert!(acts.qs.len() >= end * QK && acts.d.len() >= end && acts.s.len() >= end && acts.sums.len() >= 2 * end, "activations too short");
    assert!(!is_packed_kquant(ty) || nb.is_multiple_of(8), "k-quant rows of whole superblocks");
    assert!(GROUP.is_multiple_of(width), "a group splits into whole parts");
    let len = if is_packed_kquant(ty) { nb / 8 } else { nb };
    for (gi, g) in p.chunks_exact(gbytes).enumerate() {
        for part in 0..GROUP / width {
            let r0 = gi * GROUP + part * width;
            if r0 >= rows {
                break;
            }
            let lanes = (rows - r0).min(width);
            let mut i = 0;
            while i < n {
                let mut res = [[0.0f32; GROUP]; MAX_TILE];
                let k = call(g, len, part, first + i, n - i, &mut res);
                for (j, r) in res.iter().enumerate().take(k) {
                    let at = (i + j) * rows + r0;
                    out[at..at + lanes].copy_from_slice(&r[..lanes]);
                }
                i += k;
            }
        }
    }
}

/// Whether `ty`'s blocks carry a min `m` after `d` (the weights are then unsigned).
fn has_min(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1)
}

/// Bytes of one block's scales (`d`, and `m` for Q4_1 and Q5_1) in the source row layout.
fn scale_bytes(ty: GgmlType) -> usize {
    if has_min(ty) { 4 } else { 2 }
}

/// Byte offset of group `g`'s block `b` in packed data of `nb` blocks per row.
#[inline]
pub fn block_offset(ty: GgmlType, nb: usize, g: usize, b: usize) -> usize {
    (g * nb + b) * GROUP * block_bytes(ty)
}

/// Where byte `j` of row `r`'s block (source layout) lands within a packed group block.
fn dest(ty: GgmlType, r: usize, j: usize) -> usize {
    let sb = scale_bytes(ty);
    if j < sb {
        // d at 0, m at 2: d[r] then (Q4_1, Q5_1) m[r], each an f16 array of GROUP.
        return (j / 2) * 2 * GROUP + r * 2 + j % 2;
    }
    let q = j - sb;
    GROUP * sb + (q / 4) * 4 * GROUP + r * 4 + q % 4
}

/// Regroup `rows` rows of `row_bytes` bytes each (`ty` blocks) into packed groups.
pub fn pack(ty: GgmlType, rows: usize, row_bytes: usize, data: &[u8]) -> Vec<u8> {
    if is_packed_kquant(ty) {
        return pack_kquant(ty, rows, row_bytes, data);
    }
    let bs = block_bytes(ty);
    let nb = row_bytes / bs;
    let groups = rows.div_ceil(GROUP);
    let mut out = vec![0u8; groups * GROUP * row_bytes];
    for (r, row) in data.chunks_exact(row_bytes).enumerate().take(rows) {
        let (g, lane) = (r / GROUP, r % GROUP);
        for (b, blk) in row.chunks_exact(bs).enumerate() {
            let base = block_offset(ty, nb, g, b);
            let mut blk: [u8; 34] = std::array::from_fn(|j| blk.get(j).copied().unwrap_or(0));
            transpose_qh(ty, &mut blk, false);
            for (j, &byte) in blk[..bs].iter().enumerate() {
                out[base + dest(ty, lane, j)] = byte;
            }
        }
    }
    out
}

/// A Q5 block's `qh` between ggml's bit order (element `i` at bit `i`) and the packed one
/// (element `4k + e` at bit `k` of byte `e`); `back` undoes it. Other types: nothing.
fn transpose_qh(ty: GgmlType, blk: &mut [u8; 34], back: bool) {
    if !matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1) {
        return;
    }
    let at = scale_bytes(ty);
    let qh = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
    let mut out = 0u32;
    for k in 0..8 {
        for e in 0..4 {
            let (ggml, packed) = (4 * k + e, 8 * e + k);
            let (from, to) = if back { (packed, ggml) } else { (ggml, packed) };
            out |= ((qh >> from) & 1) << to;
        }
    }
    blk[at..at + 4].copy_from_slice(&out.to_le_bytes());
}

/// The inverse of [`pack`]: `rows` rows in ggml's row layout.
pub fn unpack(ty: GgmlType, rows: usize, row_bytes: usize, packed: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; rows * row_bytes];
    for (r, row) in out.chunks_exact_mut(row_bytes).enumerate() {
        unpack_row(ty, row_bytes, packed, r, row);
    }
    out
}

/// Row `r` of packed data, in ggml's row layout, into `out` (`row_bytes` bytes): what a
/// token lookup reads from an embedding held only packed (the output head it is tied to).
pub fn unpack_row(ty: GgmlType, row_bytes: usize, packed: &[u8], r: usize, out: &mut [u8]) {
    let (g, lane) = (r / GROUP, r % GROUP);
    if is_packed_kquant(ty) {
        let (src, dst) = ksb_sizes(ty);
        let nsb = row_bytes / src;
        for (s, sb) in out.chunks_exact_mut(src).enumerate() {
            let at = (g * nsb + s) * dst;
            unpack_ksb(ty, &packed[at..at + dst], lane, sb);
        }
        return;
    }
    let bs = block_bytes(ty);
    let nb = row_bytes / bs;
    for (b, blk) in out.chunks_exact_mut(bs).enumerate() {
        let base = block_offset(ty, nb, g, b);
        let mut got: [u8; 34] = std::array::from_fn(|j| if j < bs { packed[base + dest(ty, lane, j)] } else { 0 });
        transpose_qh(ty, &mut got, true);
        blk.copy_from_slice(&got[..bs]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kquant_packing_is_lossless() {
        for (ty, src) in [(GgmlType::Q4_K, Q4K_BYTES), (GgmlType::Q5_K, Q5K_BYTES), (GgmlType::Q6_K, Q6K_BYTES)] {
            for rows in [1, 7, 16, 17, 24] {
                let row_bytes = 2 * src;
                let data: Vec<u8> = (0..rows * row_bytes).map(|i| (i * 131 % 251) as u8).collect();
                let p = pack(ty, rows, row_bytes, &data);
                assert_eq!(p.len(), rows.div_ceil(GROUP) * group_bytes(ty, row_bytes));
                assert_eq!(unpack(ty, rows, row_bytes, &p), data, "{ty} rows {rows}");
            }
        }
        assert_eq!(KSB_Q6K, GROUP * Q6K_BYTES);
    }

    #[test]
    fn a_q6k_superblocks_vectors_lie_in_the_one_row_kernels_reading_order() {
        // The one-row kernel reads, for h in 0..2 and k in 0..8, high-bit vector 8h + k and
        // nibble vectors 8(2h) + k, 8(2h + 1) + k: each must follow the last with no gap.
        let mut at = Q6K_SC + 16 * GROUP;
        for h in 0..2 {
            for k in 0..8 {
                for off in [q6k_qh(8 * h + k), q6k_ql(16 * h + k), q6k_ql(16 * h + 8 + k)] {
                    assert_eq!(off, at, "h {h} k {k}");
                    at += 4 * GROUP;
                }
            }
        }
        assert_eq!(at, KSB_Q6K);
    }

    #[test]
    fn packing_is_a_lossless_permutation() {
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0] {
            let bs = block_bytes(ty);
            for rows in [1, 7, 8, 9, 24] {
                let row_bytes = 3 * bs;
                let data: Vec<u8> = (0..rows * row_bytes).map(|i| (i * 131 % 251) as u8).collect();
                let p = pack(ty, rows, row_bytes, &data);
                assert_eq!(p.len(), rows.div_ceil(GROUP) * GROUP * row_bytes);
                assert_eq!(unpack(ty, rows, row_bytes, &p), data, "{ty} rows {rows}");
            }
            // Every destination within a block is hit once.
            let mut seen = vec![false; GROUP * bs];
            for r in 0..GROUP {
                for j in 0..bs {
                    let d = dest(ty, r, j);
                    assert!(!seen[d], "{ty}: ({r}, {j}) collides");
                    seen[d] = true;
                }
            }
        }
    }
}
