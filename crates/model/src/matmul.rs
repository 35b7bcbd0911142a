//! Matrix products over a batch of activation rows, split across the thread pool by output
//! rows. Each weight row is read once per call for all activation rows (the point of
//! batching decode steps together), and several matrices that share an input (Q, K, V; gate
//! and up) run as one parallel call.

use rayon::prelude::*;

use crate::kernels::{Isa, dot_f_row, dot_q_packed, dot_q_rows, packed::GROUP, quantize_acts};
use crate::quant::Q8Acts;
use crate::weights::Matrix;

/// Reusable buffers for [`matmul`]: once they have grown to a shape, a call of that shape
/// allocates nothing.
#[derive(Debug, Default)]
pub struct MatmulScratch {
    q8: Q8Acts,
    /// Per matrix, its tasks' results in task order (when there are several activation rows).
    tmp: Vec<Vec<f32>>,
}

/// Output rows per parallel task: enough tasks for balance, few enough that each is worth
/// its scheduling cost; whole packed groups.
fn rows_per_task(total_rows: usize) -> usize {
    let tasks = rayon::current_num_threads().max(1) * 4;
    total_rows.div_ceil(tasks).max(16).next_multiple_of(GROUP)
}

/// `outs[m] = x · mats[m]ᵀ`: `x` holds `n` rows of `cols` values; `outs[m]` receives `n`
/// rows of `mats[m].rows` values. All matrices must have `cols` columns.
pub fn matmul(isa: Isa, mats: &[&Matrix], x: &[f32], n: usize, scratch: &mut MatmulScratch, outs: &mut [&mut [f32]]) {
    let cols = mats[0].cols;
    assert!(mats.iter().all(|m| m.cols == cols), "fused matrices must share their input width");
    assert!(x.len() == n * cols && outs.len() == mats.len(), "matmul input shape");
    for (m, o) in mats.iter().zip(outs.iter()) {
        assert_eq!(o.len(), n * m.rows, "matmul output shape");
    }
    if mats.iter().any(|m| m.is_quantized()) {
        quantize_acts(isa, x, n, cols, &mut scratch.q8);
    }
    // Task `ti` of matrix `mi` computes its output rows `ti * ch..` (at most `ch` of them).
    let ch = rows_per_task(mats.iter().map(|m| m.rows).sum());
    let q8 = &scratch.q8;
    let task = |mi: usize, ti: usize, buf: &mut [f32]| {
        let m = mats[mi];
        let (r0, r1) = (ti * ch, (ti * ch + ch).min(m.rows));
        if let Some(p) = m.packed_rows(r0, r1) {
            dot_q_packed(isa, m.ty, p, r1 - r0, q8, 0, n, buf);
        } else if m.is_quantized() {
            dot_q_rows(isa, m.ty, m.rows_bytes(r0, r1), m.row_bytes(), q8, 0, n, buf);
        } else {
            for r in r0..r1 {
                dot_f_row(isa, m.ty, m.row(r), x, cols, &mut buf[(r - r0) * n..(r - r0 + 1) * n]);
            }
        }
    };
    if n >= SPLIT_ACTS_FROM && mats.iter().all(|m| m.is_packed()) {
        for_each_act_chunk(isa, mats, q8, n, outs);
        return;
    }
    if n == 1 {
        // With one activation row, [row][batch] is [batch][row]: tasks write the outputs directly.
        for_each_task(outs, ch, 1, &task);
        return;
    }
    if scratch.tmp.len() < mats.len() {
        scratch.tmp.resize_with(mats.len(), Vec::new);
    }
    for (t, m) in scratch.tmp.iter_mut().zip(mats) {
        t.resize(m.rows * n, 0.0);
    }
    for_each_task(&mut scratch.tmp[..mats.len()], ch, n, &task);
    // Row-kernel results are [row][batch] per task, packed-kernel results [batch][row]; outputs
    // are [batch][row]. One parallel task per `tile` batch rows (but at least a task per
    // thread) reads each cache line of a row-kernel result once; a task per batch row read
    // each line once per row (9% of a 512-token prefill on AVX2).
    let tile = n.div_ceil(rayon::current_num_threads().max(1)).clamp(1, BATCH_TILE);
    for ((m, out), tmp) in mats.iter().zip(outs.iter_mut()).zip(&scratch.tmp) {
        let (rows, packed) = (m.rows, m.is_packed());
        out.par_chunks_mut(rows * tile).enumerate().for_each(|(c, o)| {
            let (b0, nb) = (c * tile, o.len() / rows);
            for r0 in (0..rows).step_by(ch) {
                let (len, at) = ((r0 + ch).min(rows) - r0, r0 * n);
                if packed {
                    for bi in 0..nb {
                        let from = at + (b0 + bi) * len;
                        o[bi * rows + r0..][..len].copy_from_slice(&tmp[from..from + len]);
                    }
                } else {
                    for r in 0..len {
                        for (bi, v) in tmp[at + r * n + b0..][..nb].iter().enumerate() {
                            o[bi * rows + r0 + r] = *v;
                        }
                    }
                }
            }
        });
    }
}

/// Most batch rows per task of the transposition after a row-kernel product: one cache line
/// of f32.
const BATCH_TILE: usize = 16;

/// From this many activation rows (a prefill), packed matrices split their tasks by
/// activation rows instead of weight rows: each task then reads the whole matrix (from
/// cache: the largest is about 0.5 MB) but writes its output rows in place, with no copy
/// after. Decode batches, bound by reading the weights once, keep the split by weight rows.
const SPLIT_ACTS_FROM: usize = 256;

/// `outs[m] = x · mats[m]ᵀ` for packed `mats`, in parallel tasks of consecutive activation
/// rows. The packed kernel gives each (weight row, activation row) pair the same bits in
/// any tile, so the split does not change results.
fn for_each_act_chunk(isa: Isa, mats: &[&Matrix], q8: &Q8Acts, n: usize, outs: &mut [&mut [f32]]) {
    let per = n.div_ceil(rayon::current_num_threads().max(1) * 4).max(16);
    outs.par_iter_mut()
        .enumerate()
        .flat_map(|(mi, o)| o.par_chunks_mut(per * mats[mi].rows).enumerate().map(move |(ci, buf)| (mi, ci, buf)))
        .for_each(|(mi, ci, buf)| {
            let m = mats[mi];
            if let Some(p) = m.packed_rows(0, m.rows) {
                dot_q_packed(isa, m.ty, p, m.rows, q8, ci * per, buf.len() / m.rows, buf);
            }
        });
}

/// Run `task(matrix, task index, its output)` in parallel for every `ch`-row task of every
/// matrix, each task's output being its `ch * n` values of `targets[matrix]`, in order.
fn for_each_task<S: AsMut<[f32]> + Send>(targets: &mut [S], ch: usize, n: usize, task: &(impl Fn(usize, usize, &mut [f32]) + Sync)) {
    targets
        .par_iter_mut()
        .enumerate()
        .flat_map(|(mi, t)| t.as_mut().par_chunks_mut(ch * n).enumerate().map(move |(ti, buf)| (mi, ti, buf)))
        .for_each(|(mi, ti, buf)| task(mi, ti, buf));
}
