//! Matrix products over a batch of activation rows, split across the thread pool by output
//! rows. Each weight row is read once per call for all activation rows (the point of
//! batching decode steps together), and several matrices that share an input (Q, K, V; gate
//! and up) run as one parallel call.

use rayon::prelude::*;

use crate::kernels::{dot_f_row, dot_q_packed, dot_q_rows, packed::GROUP, quantize_acts, Isa};
use crate::quant::Q8Acts;
use crate::weights::Matrix;

/// Reusable buffers for [`matmul`].
#[derive(Debug, Default)]
pub struct MatmulScratch {
    q8: Q8Acts,
    tmp: Vec<f32>,
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
    let mut tasks = Vec::new();
    let mut total = 0;
    for (mi, m) in mats.iter().enumerate() {
        let ch = rows_per_task(mats.iter().map(|m| m.rows).sum());
        let mut r = 0;
        while r < m.rows {
            let e = (r + ch).min(m.rows);
            tasks.push((mi, r, e));
            r = e;
        }
        total += m.rows;
    }
    // With one activation row, [row][batch] is [batch][row]: tasks write the outputs directly.
    let direct = n == 1;
    if !direct {
        scratch.tmp.resize(total * n, 0.0);
    }
    let mut bufs = Vec::with_capacity(tasks.len());
    if direct {
        for (mi, out) in outs.iter_mut().enumerate() {
            let mut rest: &mut [f32] = out;
            for &(_, r0, r1) in tasks.iter().filter(|t| t.0 == mi) {
                let (head, tail) = rest.split_at_mut(r1 - r0);
                bufs.push(head);
                rest = tail;
            }
        }
    } else {
        let mut rest: &mut [f32] = &mut scratch.tmp;
        for &(_, r0, r1) in &tasks {
            let (head, tail) = rest.split_at_mut((r1 - r0) * n);
            bufs.push(head);
            rest = tail;
        }
    }
    let q8 = &scratch.q8;
    tasks.par_iter().zip(bufs.par_iter_mut()).for_each(|(&(mi, r0, r1), buf)| {
        let m = mats[mi];
        if let Some(p) = m.packed_rows(r0, r1) {
            dot_q_packed(isa, m.ty, p, r1 - r0, q8, 0, n, buf);
        } else if m.is_quantized() {
            dot_q_rows(isa, m.ty, m.rows_bytes(r0, r1), m.row_bytes(), q8, 0, n, buf);
        } else {
            for r in r0..r1 {
                dot_f_row(isa, m.ty, m.row(r), x, cols, &mut buf[(r - r0) * n..(r - r0 + 1) * n]);
            }
        }
    });
    if direct {
        return;
    }
    // Row-kernel results are [row][batch] per task, packed-kernel results [batch][row]; outputs
    // are [batch][row], one parallel task per batch row.
    let tmp = &scratch.tmp;
    let mut at = 0;
    let mut spans = Vec::with_capacity(tasks.len());
    for &(mi, r0, r1) in &tasks {
        spans.push((mi, r0, r1, at, mats[mi].is_packed()));
        at += (r1 - r0) * n;
    }
    for (mi, out) in outs.iter_mut().enumerate() {
        let rows = mats[mi].rows;
        out.par_chunks_mut(rows).enumerate().for_each(|(b, o)| {
            for &(_, r0, r1, at, packed) in spans.iter().filter(|s| s.0 == mi) {
                let len = r1 - r0;
                if packed {
                    o[r0..r1].copy_from_slice(&tmp[at + b * len..at + (b + 1) * len]);
                } else {
                    for (r, v) in o[r0..r1].iter_mut().enumerate() {
                        *v = tmp[at + r * n + b];
                    }
                }
            }
        });
    }
}
