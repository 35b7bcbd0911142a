//! The forward pass over paged KV for a batch of sequences.
//!
//! One call takes any mix of prefill chunks (many tokens of one sequence) and decode steps
//! (one token each of many sequences): every token is a row of the same matrix products, so
//! each weight is read once per call. KV is written and read only through the sequence's
//! leases ([`bulkhead_kv::KvPool::write`] / [`bulkhead_kv::KvPool::read`]): a stale lease or a
//! slot past a page's watermark is an error, never a read; before each call every sequence's
//! committed positions pass [`bulkhead_kv::KvPool::check_reads`].

use bulkhead_kv::{KvPool, PageRead, PageReader, SeqPage, SequenceKv};
use rayon::prelude::*;

use crate::config::{Activation, RopeStyle};
use crate::kernels::{
    Isa, KvElem, dot_kv_rows, dot_kv_rows2, exp_shifted, gelu_mul, prefetch, weighted_sum_kv, weighted_sum_kv2, widen_f16,
};
use crate::matmul::{MatmulScratch, matmul};
use crate::{Llama, ModelError};

/// One sequence's part of a forward call.
pub struct SeqInput<'a> {
    /// The sequence's pages; `tokens` go at positions `kv.len()..kv.len() + tokens.len()`,
    /// which must already be reserved.
    pub kv: &'a mut SequenceKv,
    /// New tokens (a prefill chunk, or one decode token).
    pub tokens: &'a [u32],
    /// Logit rows to return: for the last `logit_rows` of `tokens` (at most all of them), in
    /// order. 0 for none, 1 for the next token's; a speculative step verifying `k` drafted
    /// tokens asks for `k + 1`.
    pub logit_rows: usize,
}

/// Rows per parallel task in the row-wise steps (norms, RoPE, SiLU, residuals): below this a
/// split costs more than it saves, so a decode step of a few rows stays on one thread.
/// Each row is computed the same way whichever task it lands in.
const ROWS_PER_TASK: usize = 32;

/// Row-wise RMS norm (sum of squares in f64, as ggml does), then scale by `w`. Each row's
/// sum runs in element order, but [`NORM_SIDE`] rows' sums run side by side: one chain of
/// dependent adds per row left the adders idle (a few percent of a prefill).
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    let chunk = n * NORM_SIDE;
    x.par_chunks(chunk).zip(out.par_chunks_mut(chunk)).with_min_len(ROWS_PER_TASK / NORM_SIDE).for_each(|(xs, os)| {
        // A short last chunk repeats its first row in the missing places (results unused).
        let rows: [&[f32]; NORM_SIDE] = std::array::from_fn(|r| xs.get(r * n..(r + 1) * n).unwrap_or(&xs[..n]));
        let mut ss = [0.0f64; NORM_SIDE];
        for i in 0..n {
            for (s, row) in ss.iter_mut().zip(&rows) {
                *s += f64::from(row[i]) * f64::from(row[i]);
            }
        }
        for ((xr, or), ss) in xs.chunks_exact(n).zip(os.chunks_exact_mut(n)).zip(ss) {
            let scale = 1.0 / ((ss / n as f64) as f32 + eps).sqrt();
            for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
                *o = (v * scale) * g;
            }
        }
    });
}

/// Rows whose RMS sums [`rms_norm`] runs side by side.
const NORM_SIDE: usize = 8;

/// `x += y`, row by row in parallel.
fn add_rows(x: &mut [f32], y: &[f32], width: usize) {
    x.par_chunks_mut(width)
        .zip(y.par_chunks(width))
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, b)| *a += b));
}

/// Rotate each head of `x` by position `pos` (ggml's RoPE: angle `scale · pos · base^(-2i/d)
/// / freqs[i]` for pair `i`, built iteratively in f32). `Adjacent` pairs dimensions `(2i,
/// 2i + 1)`, `Halves` pairs `(i, i + d/2)`.
pub(crate) fn rope(x: &mut [f32], head_dim: usize, pos: usize, r: Rope<'_>) {
    // The angles depend on the position only: computed once for every head of `x`, up to
    // `ROPE_PAIRS` pairs at a time (on the stack).
    const ROPE_PAIRS: usize = 128;
    let step = r.base.powf(-2.0 / head_dim as f32);
    let half = head_dim / 2;
    let mut theta = pos as f32;
    let mut sc = [(0.0f32, 0.0f32); ROPE_PAIRS];
    for i0 in (0..half).step_by(ROPE_PAIRS) {
        let pairs = (half - i0).min(ROPE_PAIRS);
        for (i, sc) in (i0..).zip(&mut sc[..pairs]) {
            let ff = r.freqs.map_or(1.0, |f| f[i]);
            *sc = (r.scale * (theta / ff)).sin_cos();
            theta *= step;
        }
        for head in x.chunks_exact_mut(head_dim) {
            for (i, &(s, c)) in (i0..).zip(&sc[..pairs]) {
                let (ia, ib) = match r.style {
                    RopeStyle::Adjacent => (2 * i, 2 * i + 1),
                    RopeStyle::Halves => (i, i + half),
                };
                let (a, b) = (head[ia], head[ib]);
                head[ia] = a * c - b * s;
                head[ib] = a * s + b * c;
            }
        }
    }
}

/// A layer's RoPE: base, position scale, pairing and per-pair frequency divisors.
#[derive(Clone, Copy)]
pub(crate) struct Rope<'a> {
    pub base: f32,
    pub scale: f32,
    pub style: RopeStyle,
    pub freqs: Option<&'a [f32]>,
}

/// Softmax of attention scores, max-subtracted; returns the max and the sum of the
/// exponentials (what [`fold_span`] needs).
pub(crate) fn softmax_in_place(isa: Isa, s: &mut [f32]) -> (f32, f32) {
    let mut stats = [(f32::NEG_INFINITY, 0.0)];
    if let Some(last) = s.len().checked_sub(1) {
        softmax_rows(isa, s, s.len(), 0..s.len(), &[last], None, &mut stats);
    }
    stats[0]
}

/// The softmax of each row `r` of `scores` (rows `width` apart, holding `keys`) over the
/// keys of `keys` row `r` sees, `first_seen(pos)..=pos` for its position, with 0 before
/// them ([`softmax_in_place`] is its one-row case, so every path gets the same bits); each
/// row's max and sum of exponentials into `stats` (`(-inf, 0)`: it sees none of `keys`).
/// Each row's sum still runs in key order from its first key, but eight rows' sums run side
/// by side: one dependent chain of adds per row was most of the softmax's time (eight
/// chains keep both adders busy).
fn softmax_rows(
    isa: Isa,
    scores: &mut [f32],
    width: usize,
    keys: std::ops::Range<usize>,
    positions: &[usize],
    window: Option<usize>,
    stats: &mut [(f32, f32)],
) {
    const SIDE: usize = 8;
    let span = |r: usize| {
        let end = (positions[r] + 1).clamp(keys.start, keys.end);
        (first_seen(positions[r], window).clamp(keys.start, end) - keys.start, end - keys.start)
    };
    for (r, st) in stats.iter_mut().enumerate().take(positions.len()) {
        let (lo, end) = span(r);
        let row = &mut scores[r * width..r * width + end];
        row[..lo].fill(0.0);
        let max = max_of(&row[lo..]);
        exp_shifted(isa, &mut row[lo..], max);
        *st = (max, 0.0);
    }
    for r0 in (0..positions.len()).step_by(SIDE) {
        let rows = SIDE.min(positions.len() - r0);
        let start = |k: usize| (r0 + k) * width + span(r0 + k).0;
        let len = |k: usize| span(r0 + k).1 - span(r0 + k).0;
        let mut sums = [0.0f32; SIDE];
        // The keys all the rows see, summed side by side; each row's own tail after.
        let common = if rows == SIDE { (0..SIDE).map(len).min().unwrap_or(0) } else { 0 };
        if common > 0 {
            let side: [&[f32]; SIDE] = std::array::from_fn(|k| &scores[start(k)..start(k) + common]);
            for i in 0..common {
                for (sum, row) in sums.iter_mut().zip(&side) {
                    *sum += row[i];
                }
            }
        }
        for (k, sum) in sums.iter_mut().enumerate().take(rows) {
            let row = &mut scores[start(k)..start(k) + len(k)];
            *sum = row[common..].iter().fold(*sum, |acc, &v| acc + v);
            let inv = 1.0 / *sum;
            row.iter_mut().for_each(|v| *v *= inv);
            stats[r0 + k].1 = *sum;
        }
    }
}

/// Values besides its `head_dim` outputs that attention keeps for a row: the max and the
/// sum of exponentials of its softmax so far ([`fold_span`]).
pub(crate) const ROW_EXTRA: usize = 2;

/// An empty fold ([`fold_span`]): no keys yet.
pub(crate) fn fold_start(acc: &mut [f32]) {
    let hd = acc.len() - ROW_EXTRA;
    acc.fill(0.0);
    acc[hd] = f32::NEG_INFINITY;
}

/// Fold one key span's attention into a row's: `acc` holds `head_dim` outputs, then the
/// max and sum of exponentials of the spans folded so far; `o` the span's own outputs
/// (its softmax normalised within it), `(max, sum)` its statistics. The two weigh by their
/// sums of exponentials at the common max. The first span is copied, so a row whose keys
/// lie in one span has the bits of an unsplit softmax. Every path (prefill, decode, a
/// decode row split between tasks, the reference pass) folds a row's spans in position
/// order through here: the same bits.
pub(crate) fn fold_span(isa: Isa, acc: &mut [f32], o: &[f32], (max, sum): (f32, f32)) {
    let hd = acc.len() - ROW_EXTRA;
    if sum == 0.0 {
        return; // the row sees none of this span's keys
    }
    let (m0, s0) = (acc[hd], acc[hd + 1]);
    if s0 == 0.0 {
        acc[..hd].copy_from_slice(o);
        (acc[hd], acc[hd + 1]) = (max, sum);
        return;
    }
    let m = m0.max(max);
    let mut e = [m0, max];
    exp_shifted(isa, &mut e, m);
    let (a, b) = (s0 * e[0], sum * e[1]);
    let total = a + b;
    let (ca, cb) = (a / total, b / total);
    for (x, &y) in acc[..hd].iter_mut().zip(o) {
        *x = *x * ca + y * cb;
    }
    (acc[hd], acc[hd + 1]) = (m, total);
}

/// The largest value of `v` (NaNs ignored, as by `f32::max`), sixteen lanes at a time: the
/// maximum does not depend on the order it is taken in (only a zero's sign might, and
/// `x - max` is then the same).
fn max_of(v: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = v.chunks_exact(16);
    for c in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = m.max(x);
        }
    }
    chunks.remainder().iter().chain(&lanes).copied().fold(f32::NEG_INFINITY, f32::max)
}

pub(crate) fn silu_mul(isa: Isa, gate: &mut [f32], up: &[f32]) {
    // e^-g through the softmax's exact exp (glibc's bits), a stack buffer at a time.
    let mut e = [0.0f32; 64];
    for (g, u) in gate.chunks_mut(e.len()).zip(up.chunks(e.len())) {
        let e = &mut e[..g.len()];
        e.iter_mut().zip(g.iter()).for_each(|(e, g)| *e = -*g);
        exp_shifted(isa, e, 0.0);
        for ((g, &u), &e) in g.iter_mut().zip(u).zip(e.iter()) {
            *g = *g / (1.0 + e) * u;
        }
    }
}

/// Consecutive rows of one sequence handled by one attention task: they share each page's
/// K and V, converted from f16 to f32 once for all of them (exact, so results are the same
/// as row by row).
const ATTN_ROWS: usize = 16;

/// Where a page sits among a task's score rows.
#[derive(Clone, Copy)]
struct Span {
    /// First position in the page.
    page: usize,
    page_size: usize,
    /// The position of a score row's first value (the first page any row sees).
    base: usize,
    /// Score row length (positions from `base` to the last row's, inclusive).
    width: usize,
    head_dim: usize,
    scale: f32,
}

/// The rows of `positions` that see part of the page whose first position is `page`, as
/// `(first row, rows, keys seen)`: two consecutive rows that see the same keys of it
/// together (the kernels then read each key once for both), otherwise one.
fn page_rows(positions: &[usize], page: usize, page_size: usize) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    let seen = move |r: usize| (positions[r] + 1).saturating_sub(page).min(page_size);
    let mut r = 0;
    std::iter::from_fn(move || {
        while r < positions.len() {
            let (at, n) = (r, seen(r));
            let rows = if r + 1 < positions.len() && seen(r + 1) == n { 2 } else { 1 };
            r += rows;
            if n > 0 {
                return Some((at, rows, n));
            }
        }
        None
    })
}

/// Scaled scores of every row that sees part of this page, against its keys `k` (as stored,
/// or converted once to f32 when several rows share them).
fn score_page<T: KvElem>(isa: Isa, k: &[T], q: &[f32], positions: &[usize], at: Span, scores: &mut [f32]) {
    let hd = at.head_dim;
    for (r, rows, n) in page_rows(positions, at.page, at.page_size) {
        let o = r * at.width + at.page - at.base;
        let (k, q) = (&k[..n * hd], &q[r * hd..(r + rows) * hd]);
        if rows == 2 {
            dot_kv_rows2(isa, k, q, &mut scores[o..o + at.width + n], at.width);
        } else {
            dot_kv_rows(isa, k, q, &mut scores[o..o + n]);
        }
        for row in 0..rows {
            scores[o + row * at.width..][..n].iter_mut().for_each(|v| *v *= at.scale);
        }
    }
}

/// Reusable buffers of one attention task.
#[derive(Default)]
struct AttnScratch {
    scores: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// One key span's outputs, and each row's softmax statistics over it.
    o: Vec<f32>,
    stats: Vec<(f32, f32)>,
}

/// What a compute thread reuses from one attention task to the next: [`attend`]'s buffers,
/// and a block task's positions and gathered queries.
#[derive(Default)]
struct TaskScratch {
    attn: AttnScratch,
    positions: Vec<usize>,
    q: Vec<f32>,
}

impl TaskScratch {
    /// Room for tasks of up to `rows` score rows over key spans of up to `keys` positions in
    /// `page_size`-token pages.
    fn reserve(&mut self, rows: usize, keys: usize, page_size: usize, head_dim: usize) {
        let grow = |v: &mut Vec<f32>, n: usize| v.reserve(n.saturating_sub(v.len()));
        grow(&mut self.attn.scores, rows * keys);
        grow(&mut self.attn.k, page_size * head_dim);
        grow(&mut self.attn.v, page_size * head_dim);
        grow(&mut self.attn.o, rows * head_dim);
        self.attn.stats.reserve(rows.saturating_sub(self.attn.stats.len()));
        grow(&mut self.q, rows * head_dim);
        self.positions.reserve(rows.saturating_sub(self.positions.len()));
    }
}

thread_local! {
    /// One per compute thread (rayon's threads live as long as the model), so a warm step
    /// allocates nothing for attention.
    static TASK: std::cell::RefCell<TaskScratch> = std::cell::RefCell::default();
}

/// Buffers a forward pass reuses from one call to the next: once grown to a batch's shape,
/// a decode step allocates nothing. Every buffer is written before it is read (activations
/// of one call never reach another).
#[derive(Debug, Default)]
pub(crate) struct ForwardScratch {
    rows: Vec<(usize, usize)>,
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    heads: Vec<f32>,
    matmul: MatmulScratch,
    /// Attention tasks of this step.
    tasks: Vec<AttnTask>,
    /// Attention tasks' outputs, the same number of values per task (the largest task's).
    blocks: Vec<f32>,
    last: Vec<usize>,
    sel: Vec<f32>,
    seln: Vec<f32>,
}

/// `v` as `n` zeros, reusing its memory.
fn zeroed(v: &mut Vec<f32>, n: usize) -> &mut Vec<f32> {
    v.clear();
    v.resize(n, 0.0);
    v
}

/// One attention task: consecutive rows of one sequence, against one KV head, for some of
/// its query heads, over some of its key spans.
#[derive(Debug, Clone)]
struct AttnTask {
    /// The step's rows.
    rows: std::ops::Range<usize>,
    /// The KV head.
    kv: usize,
    /// Query heads, all of them `kv`'s.
    heads: std::ops::Range<usize>,
    /// Key spans ([`KEY_SPAN`] positions each): all of them, or one of a decode row
    /// whose spans are tasks of their own.
    spans: std::ops::Range<usize>,
}

/// Positions per key span: attention splits a row's keys at multiples of this. Each span's
/// softmax and weighted sum are computed alone and folded in position order
/// ([`fold_span`]), so the split points, fixed by position, decide a row's bits and nothing
/// else does: not the batch, not the threads, not the tasks. Rows within the first span
/// keep an unsplit softmax's bits.
pub const KEY_SPAN: usize = 4096;

/// The attention tasks of a step over `rows` (sequence, position) at a layer with `window`,
/// in key spans of `span` positions: blocks of up to [`ATTN_ROWS`] consecutive rows of a
/// sequence, per KV head, each for all of that head's `group` query heads, so that they
/// share each page's read. A decode step (one row a sequence) gives each query head its own
/// task while the keys a row sees lie in one span (more tasks to share among the threads;
/// the pages come again from cache), and each of a longer row's spans a task of all `group`
/// heads, which read the pages once between them (Gemma 3 270M on the Zen 4: 1.03–1.05× at
/// 8k of context, 1.19–1.24× at 16k, against a task per head). Which rows, heads and spans
/// a task holds does not change any row's bits.
fn attention_tasks(
    rows: &[(usize, usize)],
    (kv_heads, group): (usize, usize),
    window: Option<usize>,
    span: usize,
    tasks: &mut Vec<AttnTask>,
) {
    tasks.clear();
    let decode = rows.windows(2).all(|w| w[0].0 != w[1].0);
    let all = 0..usize::MAX;
    let mut r0 = 0;
    while r0 < rows.len() {
        let mut r1 = r0;
        while r1 < rows.len() && rows[r1].0 == rows[r0].0 && r1 - r0 < ATTN_ROWS {
            r1 += 1;
        }
        let pos = rows[r0].1;
        let first = first_seen(pos, window);
        let per = match decode {
            true if first / span < pos / span => {
                for kv in 0..kv_heads {
                    for s in first / span..=pos / span {
                        tasks.push(AttnTask { rows: r0..r1, kv, heads: kv * group..(kv + 1) * group, spans: s..s + 1 });
                    }
                }
                r0 = r1;
                continue;
            }
            true => 1,
            false => group,
        };
        for kv in 0..kv_heads {
            for h0 in (kv * group..(kv + 1) * group).step_by(per) {
                tasks.push(AttnTask { rows: r0..r1, kv, heads: h0..(h0 + per).min((kv + 1) * group), spans: all.clone() });
            }
        }
        r0 = r1;
    }
}

/// What one layer's attention needs besides the queries.
#[derive(Clone, Copy)]
struct AttnAt {
    layer: usize,
    /// Scores are multiplied by this.
    scale: f32,
    /// Keys a query sees, its own included (a sliding-window layer); `None`: all before it.
    window: Option<usize>,
    /// Positions per key span ([`KEY_SPAN`]).
    span: usize,
    /// Positions per KV page.
    page_size: usize,
}

/// The first position a query at `pos` attends to.
#[inline]
fn first_seen(pos: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| (pos + 1).saturating_sub(w))
}

/// Attention over the positions `first_seen(pos)..=pos` of each row's sequence that lie in
/// the key spans `spans`, for rows of one sequence that share KV head `g` (`positions`
/// their positions, in runs of consecutive ones, one run per query head; `q` their query
/// vectors, `head_dim` apart), read page by page through the sequence's leases. Each row
/// gets `head_dim + ROW_EXTRA` values of `out`: its spans folded in order ([`fold_span`]).
/// Positions a row does not see get weight 0; pages no row sees are not read.
#[allow(clippy::too_many_arguments)]
fn attend(
    isa: Isa,
    pool: &KvPool,
    kv: &SequenceKv,
    at: AttnAt,
    g: usize,
    positions: &[usize],
    q: &[f32],
    spans: std::ops::Range<usize>,
    out: &mut [f32],
    scr: &mut AttnScratch,
) -> Result<(), ModelError> {
    let head_dim = q.len() / positions.len();
    let n_max = positions.iter().max().map_or(0, |p| p + 1);
    if kv.pages().len() < n_max.div_ceil(at.page_size) {
        return Err(ModelError::NotReserved { pos: n_max - 1 });
    }
    out.chunks_exact_mut(head_dim + ROW_EXTRA).for_each(fold_start);
    // Spans start at the first key any row sees: a sliding-window layer's rows read the
    // window's keys, not the whole prefix.
    let first = positions.iter().map(|&p| first_seen(p, at.window)).min().unwrap_or(0);
    let reader = pool.reader();
    for s in spans.start.max(first / at.span)..spans.end.min(n_max.div_ceil(at.span)) {
        let keys = (s * at.span).max(first)..((s + 1) * at.span).min(n_max);
        attend_span(isa, &reader, kv.pages(), at, g, positions, q, keys, scr)?;
        for (r, acc) in out.chunks_exact_mut(head_dim + ROW_EXTRA).enumerate() {
            fold_span(isa, acc, &scr.o[r * head_dim..(r + 1) * head_dim], scr.stats[r]);
        }
    }
    Ok(())
}

/// [`attend`] over the positions `keys` (within one key span) of the pages `leases`: each
/// row's outputs into `scr.o`, its softmax statistics into `scr.stats`.
#[allow(clippy::too_many_arguments)]
fn attend_span(
    isa: Isa,
    reader: &PageReader<'_>,
    leases: &[SeqPage],
    at: AttnAt,
    g: usize,
    positions: &[usize],
    q: &[f32],
    keys: std::ops::Range<usize>,
    scr: &mut AttnScratch,
) -> Result<(), ModelError> {
    let (layer, rows) = (at.layer, positions.len());
    let head_dim = q.len() / rows;
    let page_size = at.page_size;
    let width = keys.len();
    let first_page = keys.start / page_size;
    let leases = &leases[first_page..(keys.end - 1) / page_size + 1];
    // The slots of page `pi` within `keys`.
    let part = |pi: usize| keys.start.saturating_sub(pi * page_size)..(keys.end - pi * page_size).min(page_size);
    scr.scores.clear();
    scr.scores.resize(rows * width, 0.0);
    each_page_ahead(
        reader,
        leases,
        layer,
        |p| prefetch(p.k_head(g)),
        |i, page| {
            let (pi, slots) = (first_page + i, part(first_page + i));
            if page.len() < slots.end {
                return Err(ModelError::MissingKv { page: leases[i].page().0, layer, written: page.len(), needed: slots.end });
            }
            let k = &page.k_head(g)[slots.start * head_dim..slots.end * head_dim];
            let at =
                Span { page: pi * page_size + slots.start, page_size: slots.len(), base: keys.start, width, head_dim, scale: at.scale };
            if rows == 1 {
                score_page(isa, k, q, positions, at, &mut scr.scores);
            } else {
                widen_f16(isa, k, &mut scr.k);
                score_page(isa, &scr.k, q, positions, at, &mut scr.scores);
            }
            Ok(())
        },
    )?;
    scr.stats.clear();
    scr.stats.resize(rows, (f32::NEG_INFINITY, 0.0));
    softmax_rows(isa, &mut scr.scores, width, keys.clone(), positions, at.window, &mut scr.stats);
    let o = zeroed(&mut scr.o, rows * head_dim);
    each_page_ahead(
        reader,
        leases,
        layer,
        |p| prefetch(p.v_head(g)),
        |i, page| {
            let (pi, slots) = (first_page + i, part(first_page + i));
            let start = pi * page_size + slots.start;
            let v = &page.v_head(g)[slots.start * head_dim..slots.end * head_dim];
            if rows > 1 {
                widen_f16(isa, v, &mut scr.v);
            }
            for (r, k, n) in page_rows(positions, start, slots.len()) {
                let w = |r: usize| &scr.scores[r * width + start - keys.start..][..n];
                let o = &mut o[r * head_dim..(r + k) * head_dim];
                if rows == 1 {
                    weighted_sum_kv(isa, o, w(r), &v[..n * head_dim]);
                } else if k == 2 {
                    weighted_sum_kv2(isa, o, [w(r), w(r + 1)], &scr.v[..n * head_dim]);
                } else {
                    weighted_sum_kv(isa, o, w(r), &scr.v[..n * head_dim]);
                }
            }
            Ok(())
        },
    )
}

/// Pages a sequence's attention reads from DRAM before their turn comes.
const PAGES_AHEAD: usize = 2;

/// Calls `f(i, page)` for each of `leases` in order, each page read (checked, once) and
/// `touch`ed [`PAGES_AHEAD`] pages before its turn, so that the part of it `f` reads is on
/// its way into cache while `f` works on the pages before.
fn each_page_ahead<'p>(
    reader: &PageReader<'p>,
    leases: &[SeqPage],
    layer: usize,
    touch: impl Fn(&PageRead<'p>),
    mut f: impl FnMut(usize, PageRead<'p>) -> Result<(), ModelError>,
) -> Result<(), ModelError> {
    // Slot `i % PAGES_AHEAD` holds page `i - PAGES_AHEAD` until page `i` is read.
    let mut ring: [Option<PageRead<'p>>; PAGES_AHEAD] = [None; PAGES_AHEAD];
    for i in 0..leases.len() + PAGES_AHEAD {
        let ahead = leases.get(i).map(|lease| reader.read(lease, layer)).transpose()?;
        if let Some(page) = &ahead {
            touch(page);
        }
        if let Some(page) = std::mem::replace(&mut ring[i % PAGES_AHEAD], ahead) {
            f(i - PAGES_AHEAD, page)?;
        }
    }
    Ok(())
}

impl Llama {
    /// Run one forward step over `seqs`, writing their new tokens' KV into `pool` and
    /// returning `vocab` logits for each row each sequence asks for ([`SeqInput::logit_rows`]), in order.
    /// On success each sequence's committed length grows by its token count.
    pub fn forward(&self, pool: &mut KvPool, seqs: &mut [SeqInput<'_>]) -> Result<Vec<f32>, ModelError> {
        let mut logits = Vec::new();
        self.forward_into(pool, seqs, &mut logits)?;
        Ok(logits)
    }

    /// Size every compute thread's attention buffers for sequences of up to `context`
    /// tokens in `page_size`-token pages, so that steps never grow them as contexts grow.
    pub fn reserve_attention(&self, context: usize, page_size: usize) {
        let (head_dim, rows, keys) = (self.config.head_dim, self.config.group() * ATTN_ROWS, context.min(self.key_span));
        for pool in std::iter::once(&self.threads).chain(&self.narrow) {
            pool.broadcast(|_| TASK.with_borrow_mut(|t| t.reserve(rows, keys, page_size, head_dim)));
        }
    }

    /// [`Llama::forward`] into `logits` (replacing what it held), with the model's reusable
    /// buffers: a step of the same shape as one before allocates nothing.
    pub fn forward_into(&self, pool: &mut KvPool, seqs: &mut [SeqInput<'_>], logits: &mut Vec<f32>) -> Result<(), ModelError> {
        // Concurrent calls (an in-process prefill beside a decode step) each get buffers:
        // the second a fresh set. A poisoned lock holds only buffers, all written before read.
        let mut fresh = ForwardScratch::default();
        let mut held = match self.scratch.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        let scratch = held.as_deref_mut().unwrap_or(&mut fresh);
        self.threads.install(|| self.forward_inner(pool, seqs, scratch, logits))
    }

    // Long on purpose (~170 lines): the pass's phases (embedding, each layer's attention
    // and MLP, the head) share the scratch buffers and the thread pool's scope; split, each
    // phase would take a dozen of them as arguments and hide the order they run in.
    fn forward_inner(
        &self,
        pool: &mut KvPool,
        seqs: &mut [SeqInput<'_>],
        scratch: &mut ForwardScratch,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let (hd, group) = (c.head_dim, c.group());
        let (q_dim, kv_dim) = (c.heads * hd, c.kv_heads * hd);
        let ForwardScratch { rows, x, xn, q, k, v, att, o, gate, up, heads: xn_heads, matmul: scratch, tasks, blocks, last, sel, seln } =
            scratch;
        // Row t of every activation matrix is token t; remember whose and where.
        rows.clear();
        // Every position attention will read, checked before anything is written (design
        // I1, I2): lease generations always, canaries and the auditor as configured.
        for (s, seq) in seqs.iter_mut().enumerate() {
            pool.check_reads(seq.kv).map_err(|source| ModelError::ReadCheck { seq: s, source })?;
        }
        for (s, seq) in seqs.iter().enumerate() {
            let start = seq.kv.len();
            let end = start + seq.tokens.len();
            if end > c.context_length {
                return Err(ModelError::ContextOverflow { needed: end, context: c.context_length });
            }
            if !seq.tokens.is_empty() {
                seq.kv.locate(end - 1)?;
            }
            for (i, &tok) in seq.tokens.iter().enumerate() {
                if tok as usize >= c.vocab {
                    return Err(ModelError::TokenOutOfRange { token: tok, vocab: c.vocab });
                }
                rows.push((s, start + i));
            }
        }
        let t = rows.len();
        if t == 0 {
            return Err(ModelError::EmptyBatch);
        }
        zeroed(x, t * c.hidden);
        for (xr, tok) in x.chunks_exact_mut(c.hidden).zip(seqs.iter().flat_map(|s| s.tokens.iter())) {
            self.embed(*tok, xr);
        }
        let xn = zeroed(xn, t * c.hidden);
        let (q, k, v) = (zeroed(q, t * q_dim), zeroed(k, t * kv_dim), zeroed(v, t * kv_dim));
        let att = zeroed(att, t * q_dim);
        let o = zeroed(o, t * c.hidden);
        let (gate, up) = (zeroed(gate, t * c.ffn), zeroed(up, t * c.ffn));
        let isa = self.isa;
        // A task's values: each of its rows' outputs and softmax statistics, head-major.
        let row_values = hd + ROW_EXTRA;
        // The window `tasks` were listed for (they depend on nothing else that varies by
        // layer), and the most values one of them writes.
        let (mut tasks_window, mut task_values) = (None, 1);

        for (li, l) in self.weights.layers.iter().enumerate() {
            // Each layer on the threads the core share leaves it (all of them without one).
            self.narrowed(|| -> Result<(), ModelError> {
                rms_norm(x, &l.attn_norm, c.norm_eps, xn);
                self.pause();
                matmul(isa, &[&l.wq, &l.wk, &l.wv], xn, t, scratch, &mut [&mut q[..], &mut k[..], &mut v[..]]);
                self.prepare_qkv(li, q, k, v, xn_heads);
                let r = self.rope_of(li);
                q.par_chunks_mut(q_dim).zip(k.par_chunks_mut(kv_dim)).zip(&rows[..]).with_min_len(ROWS_PER_TASK).for_each(
                    |((qr, kr), &(_, pos))| {
                        rope(qr, hd, pos, r);
                        rope(kr, hd, pos, r);
                    },
                );
                let at = AttnAt {
                    layer: li,
                    scale: c.attn_scale,
                    window: c.window(li),
                    span: self.key_span,
                    page_size: pool.layout().page_size,
                };
                if tasks_window != Some(at.window) {
                    attention_tasks(rows, (c.kv_heads, group), at.window, at.span, tasks);
                    tasks_window = Some(at.window);
                    task_values = tasks.iter().map(|a| a.rows.len() * a.heads.len() * row_values).max().unwrap_or(0).max(1);
                }
                for (r, &(s, pos)) in rows.iter().enumerate() {
                    let (lease, slot) = seqs[s].kv.locate(pos)?;
                    pool.write(lease, li, slot, &k[r * kv_dim..(r + 1) * kv_dim], &v[r * kv_dim..(r + 1) * kv_dim])?;
                }
                self.pause();
                {
                    let pool: &KvPool = pool;
                    let seqs: &[SeqInput<'_>] = seqs;
                    let (rows, q) = (&rows[..], &q[..]);
                    // Each task's query heads stacked as rows (head-major), sharing each page's
                    // read (and, for several rows, its conversion to f32).
                    zeroed(blocks, tasks.len() * task_values);
                    blocks.par_chunks_mut(task_values).zip(&tasks[..]).try_for_each(|(out, task)| {
                        TASK.with_borrow_mut(|scr| {
                            let TaskScratch { attn, positions, q: qh } = scr;
                            positions.clear();
                            qh.clear();
                            for h in task.heads.clone() {
                                positions.extend(rows[task.rows.clone()].iter().map(|&(_, p)| p));
                                for r in task.rows.clone() {
                                    qh.extend_from_slice(&q[r * q_dim + h * hd..][..hd]);
                                }
                            }
                            let out = &mut out[..task.heads.len() * task.rows.len() * row_values];
                            let kv: &SequenceKv = seqs[rows[task.rows.start].0].kv;
                            attend(isa, pool, kv, at, task.kv, positions, qh, task.spans.clone(), out, attn)
                        })
                    })?;
                    // The tasks of one decode row's key spans (in position order) fold into
                    // the first's values; then each task's outputs go to their rows and heads.
                    let mut i = 0;
                    while i < tasks.len() {
                        let task = &tasks[i];
                        let run = tasks[i..].iter().take_while(|u| u.rows == task.rows && u.heads == task.heads).count();
                        let (out, later) = blocks[i * task_values..(i + run) * task_values].split_at_mut(task_values);
                        let n = task.rows.len();
                        for part in later.chunks(task_values) {
                            for (acc, p) in out.chunks_exact_mut(row_values).zip(part.chunks_exact(row_values)).take(n * task.heads.len()) {
                                fold_span(isa, acc, &p[..hd], (p[hd], p[hd + 1]));
                            }
                        }
                        for (j, h) in task.heads.clone().enumerate() {
                            for (i, r) in task.rows.clone().enumerate() {
                                att[r * q_dim + h * hd..r * q_dim + (h + 1) * hd].copy_from_slice(&out[(j * n + i) * row_values..][..hd]);
                            }
                        }
                        i += run;
                    }
                }
                self.pause();
                matmul(isa, &[&l.wo], att, t, scratch, &mut [&mut o[..]]);
                self.post_norm(l.post_attn_norm.as_deref(), o, xn);
                add_rows(x, o, c.hidden);
                rms_norm(x, &l.ffn_norm, c.norm_eps, xn);
                self.pause();
                matmul(isa, &[&l.w_gate, &l.w_up], xn, t, scratch, &mut [&mut gate[..], &mut up[..]]);
                let act = c.activation;
                gate.par_chunks_mut(c.ffn)
                    .zip(up.par_chunks(c.ffn))
                    .with_min_len(ROWS_PER_TASK)
                    .for_each(|(g, u)| activate(isa, act, g, u));
                self.pause();
                matmul(isa, &[&l.w_down], gate, t, scratch, &mut [&mut o[..]]);
                self.post_norm(l.post_ffn_norm.as_deref(), o, xn);
                add_rows(x, o, c.hidden);
                Ok(())
            })?;
        }

        // Logits only for the rows the sequences asked for: the last ones of each.
        last.clear();
        let mut r = 0;
        for seq in seqs.iter() {
            r += seq.tokens.len();
            last.extend(r - seq.logit_rows.min(seq.tokens.len())..r);
        }
        zeroed(logits, last.len() * c.vocab);
        if !last.is_empty() {
            sel.clear();
            for &r in last.iter() {
                sel.extend_from_slice(&x[r * c.hidden..(r + 1) * c.hidden]);
            }
            let seln = zeroed(seln, sel.len());
            rms_norm(sel, &self.weights.out_norm, c.norm_eps, seln);
            self.narrowed(|| matmul(isa, &[self.weights.output()], seln, last.len(), scratch, &mut [&mut logits[..]]));
            self.soft_cap(logits);
        }
        for seq in seqs.iter_mut() {
            let n = seq.tokens.len();
            seq.kv.commit(pool, n)?;
        }
        Ok(())
    }
}

/// The MLP's activation of `gate`, times `up`.
pub(crate) fn activate(isa: Isa, act: Activation, gate: &mut [f32], up: &[f32]) {
    match act {
        Activation::Silu => silu_mul(isa, gate, up),
        Activation::GeluTanh => gelu_mul(isa, gate, up),
    }
}

/// `x += bias` for every row of `x`.
fn add_bias(x: &mut [f32], bias: &[f32]) {
    x.par_chunks_mut(bias.len()).with_min_len(ROWS_PER_TASK).for_each(|r| r.iter_mut().zip(bias).for_each(|(a, b)| *a += b));
}

/// The steps of a layer that differ by family, shared by the paged pass and the reference
/// pass so that the two stay bit-identical.
impl Llama {
    /// Token `tok`'s embedding, scaled as the family says.
    pub(crate) fn embed(&self, tok: u32, out: &mut [f32]) {
        self.weights.embedding.dequantize_row(tok as usize, out);
        let s = self.config.embed_scale;
        if s != 1.0 {
            out.iter_mut().for_each(|v| *v *= s);
        }
    }

    /// Q, K and V of any number of rows, after their projections: biases (Qwen2), then an
    /// RMS norm of each head of Q and K (Qwen3, Gemma 3). `tmp` is scratch.
    pub(crate) fn prepare_qkv(&self, li: usize, q: &mut [f32], k: &mut [f32], v: &mut [f32], tmp: &mut Vec<f32>) {
        let l = &self.weights.layers[li];
        for (x, b) in [(&mut *q, &l.bq), (&mut *k, &l.bk), (&mut *v, &l.bv)] {
            if let Some(b) = b {
                add_bias(x, b);
            }
        }
        for (x, w) in [(q, &l.q_norm), (k, &l.k_norm)] {
            if let Some(w) = w {
                tmp.clear();
                tmp.extend_from_slice(x);
                rms_norm(tmp, w, self.config.norm_eps, x);
            }
        }
    }

    /// Layer `li`'s RoPE.
    pub(crate) fn rope_of(&self, li: usize) -> Rope<'_> {
        let (base, scale) = self.config.rope_of(li);
        Rope { base, scale, style: self.config.rope_style, freqs: self.weights.rope_freqs.as_deref() }
    }

    /// `x = rms_norm(x) · w` when the layer has the norm (Gemma 3's post-norms); `tmp` is
    /// scratch of `x`'s size.
    pub(crate) fn post_norm(&self, w: Option<&[f32]>, x: &mut [f32], tmp: &mut [f32]) {
        if let Some(w) = w {
            rms_norm(x, w, self.config.norm_eps, tmp);
            x.copy_from_slice(&tmp[..x.len()]);
        }
    }

    /// Final logits soft-capped, for models that ask.
    pub(crate) fn soft_cap(&self, logits: &mut [f32]) {
        if let Some(cap) = self.config.final_softcap {
            logits.iter_mut().for_each(|l| *l = cap * (*l / cap).tanh());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every (row, query head, key span) is in exactly one task, with its own KV head; how
    /// many heads and spans a task holds follows the step's kind and the keys the row sees.
    #[test]
    fn attention_tasks_cover_every_row_head_and_span_once() {
        let (kv_heads, group, span) = (2, 4, KEY_SPAN);
        let long = 6 * span + 600;
        // Rows, window, heads a task, whether a task takes one span (or all).
        type Step<'a> = (&'a [(usize, usize)], Option<usize>, usize, bool);
        let steps: [Step; 5] = [
            (&[(0, 0), (0, 1), (0, 2), (1, long)], None, group, false), // prefill rows of two sequences
            (&[(0, 7), (1, 9)], None, 1, false),                        // decode, short contexts
            (&[(0, long), (1, span)], None, group, true),               // decode past one span: a task a span
            (&[(0, span - 1)], None, 1, false),                         // the first span's last position
            (&[(0, long)], Some(512), 1, false),                        // a window within one span
        ];
        for (rows, window, heads, per_span) in steps {
            let mut tasks = Vec::new();
            attention_tasks(rows, (kv_heads, group), window, span, &mut tasks);
            let n = rows.iter().map(|r| r.1).max().unwrap_or(0) / span + 1;
            let mut seen = vec![0; rows.len() * kv_heads * group * n];
            for t in &tasks {
                assert_eq!(t.heads.len(), heads, "{rows:?}: {t:?}");
                assert_eq!(per_span, t.spans.len() == 1, "{rows:?}: {t:?}");
                for r in t.rows.clone() {
                    assert!(t.rows.clone().all(|q| rows[q].0 == rows[r].0), "one sequence a task: {t:?}");
                    let (lo, pos) = (first_seen(rows[r].1, window), rows[r].1);
                    for h in t.heads.clone() {
                        assert_eq!(h / group, t.kv, "{t:?}");
                        for s in (lo / span..=pos / span).filter(|s| t.spans.contains(s)) {
                            seen[((r * kv_heads * group) + h) * n + s] += 1;
                        }
                    }
                }
            }
            for r in 0..rows.len() {
                let (lo, pos) = (first_seen(rows[r].1, window), rows[r].1);
                for h in 0..kv_heads * group {
                    for s in lo / span..=pos / span {
                        assert_eq!(seen[((r * kv_heads * group) + h) * n + s], 1, "{rows:?}: row {r} head {h} span {s}");
                    }
                }
            }
        }
    }
}
