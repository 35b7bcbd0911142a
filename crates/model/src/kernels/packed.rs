//! Weights regrouped for the VNNI kernel: sixteen matrix rows interleaved block by block,
//! so one 512-bit `vpdpbusd` multiplies four bytes of each of sixteen rows with the same
//! four activation bytes and leaves sixteen row sums, one per lane.
//!
//! Per group of sixteen rows and per 32-element block (`16 * block_bytes(ty)` bytes, the
//! same size as the sixteen rows' blocks it replaces):
//! - `d[16]` (f16), then for Q4_1 and Q5_1 `m[16]` (f16);
//! - Q5_0 and Q5_1: then one 64-byte vector of the sixteen rows' `qh` (a u32 each: bit `e`
//!   is element `e`'s fifth bit), and their nibbles as for Q4_0;
//! - Q4_0 and Q4_1: four 64-byte vectors; vector `k` holds bytes `4k..4k+4` of each row's
//!   16 nibble bytes, row after row: low nibbles are elements `4k..4k+4`, high nibbles
//!   elements `16+4k..16+4k+4`;
//! - Q8_0: eight 64-byte vectors; vector `k` holds elements `4k..4k+4` of each row.
//!
//! Either way lane `k` of the kernel's integer dot product covers the same elements as lane
//! `k` of the AVX2 row kernel's, which is what keeps the two bit-identical.
//!
//! Rows past the last group boundary are zero (scale 0), and their results are discarded.
//! Packing is a permutation of the bytes, so [`unpack`] restores the original rows exactly.

use bulkhead_gguf::GgmlType;

/// Whether the VNNI kernel has a packed layout for `ty` (the others stay in rows and run
/// the AVX2 row kernel).
pub fn supports(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0)
}

/// Bytes of one 32-element block of a type the packed layout supports.
fn block_bytes(ty: GgmlType) -> usize {
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
    let bs = block_bytes(ty);
    let nb = row_bytes / bs;
    let groups = rows.div_ceil(GROUP);
    let mut out = vec![0u8; groups * GROUP * row_bytes];
    for (r, row) in data.chunks_exact(row_bytes).enumerate().take(rows) {
        let (g, lane) = (r / GROUP, r % GROUP);
        for (b, blk) in row.chunks_exact(bs).enumerate() {
            let base = block_offset(ty, nb, g, b);
            for (j, &byte) in blk.iter().enumerate() {
                out[base + dest(ty, lane, j)] = byte;
            }
        }
    }
    out
}

/// The inverse of [`pack`]: `rows` rows in ggml's row layout.
pub fn unpack(ty: GgmlType, rows: usize, row_bytes: usize, packed: &[u8]) -> Vec<u8> {
    let bs = block_bytes(ty);
    let nb = row_bytes / bs;
    let mut out = vec![0u8; rows * row_bytes];
    for (r, row) in out.chunks_exact_mut(row_bytes).enumerate() {
        let (g, lane) = (r / GROUP, r % GROUP);
        for (b, blk) in row.chunks_exact_mut(bs).enumerate() {
            let base = block_offset(ty, nb, g, b);
            for (j, byte) in blk.iter_mut().enumerate() {
                *byte = packed[base + dest(ty, lane, j)];
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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
