//! The hot loops: quantised dot products (one weight row against several activation rows,
//! or, with AVX-512 VNNI, sixteen packed weight rows against several activation rows) and the
//! f16 attention helpers, with a portable implementation and SIMD ones chosen once at run
//! time.
//!
//! Row determinism: the result for a (weight row, activation row) pair is computed by the
//! same sequence of operations whether the activation row is alone or in a tile with
//! others, so a sequence's logits do not depend on what else shares its batch.

use bulkhead_gguf::GgmlType;
use half::f16;
use rayon::prelude::*;

use crate::quant::{Q8Acts, QK};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_packed;
pub mod packed;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod vnni;

/// The five 32-element block formats as const parameters of the kernels (one instance per
/// format: no branch on the format inside a block loop).
mod format {
    use bulkhead_gguf::GgmlType;

    pub const Q4_0: u8 = 0;
    pub const Q4_1: u8 = 1;
    pub const Q5_0: u8 = 2;
    pub const Q5_1: u8 = 3;
    pub const Q8_0: u8 = 4;

    /// `ty`'s code.
    pub fn code(ty: GgmlType) -> u8 {
        match ty {
            GgmlType::Q4_0 => Q4_0,
            GgmlType::Q4_1 => Q4_1,
            GgmlType::Q5_0 => Q5_0,
            GgmlType::Q5_1 => Q5_1,
            GgmlType::Q8_0 => Q8_0,
            other => unreachable!("{other} is not a 32-element block format"),
        }
    }

    /// The inverse of [`code`].
    pub const fn ty(f: u8) -> GgmlType {
        [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0][f as usize]
    }
}

/// Activation rows handled together against one weight row (weights unpacked once).
pub const TILE: usize = 4;

/// The instruction-set levels the kernels have code for, for matching and names. An
/// [`Isa`] is a level this CPU was found to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum IsaLevel {
    /// Portable Rust, any CPU.
    Scalar,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// AVX2 plus AVX-512F/VL/BW/VNNI: quantised matrices are packed ([`packed`]) and multiplied
    /// with `vpdpbusd`, bit-identical to the AVX2 kernels in either [`Sums`]; everything else
    /// runs those.
    Avx512Vnni,
}

impl IsaLevel {
    /// Name for logs and benchmarks.
    pub fn name(self) -> &'static str {
        match self {
            IsaLevel::Scalar => "scalar",
            IsaLevel::Avx2 => "avx2+fma+f16c",
            IsaLevel::Avx512Vnni => "avx512-vnni+avx2+fma+f16c",
        }
    }
}

/// How a quantised dot product adds up a 32-element block's products. Every ISA computes
/// each arithmetic bit for bit alike; the two give slightly different floats (both within
/// the llama.cpp fixtures' bounds). Every ISA defaults to blocks, its faster one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sums {
    /// One exact integer sum per block (the k-quants' scales applied in integers), then the
    /// block's float steps, blocks in order: ggml's portable reference arithmetic, and what
    /// an AMX tile computes. The packed kernels do an eighth of the float work of lanes
    /// (and on AVX2 half the multiplies).
    Blocks,
    /// ggml's x86 (AVX2) arithmetic: eight lanes of four products each keep their own float
    /// accumulator, summed at the end. SIMD ISAs only: the portable kernels always sum
    /// blocks (and agree with lanes to 1e-4). On AVX2 it runs the row kernels (weights in
    /// ggml's layout).
    Lanes,
}

impl Sums {
    /// Name for logs and benchmarks.
    pub fn name(self) -> &'static str {
        match self {
            Sums::Blocks => "blocks",
            Sums::Lanes => "lanes",
        }
    }
}

/// An instruction set the kernels run on, proven available, and the arithmetic they use:
/// only detection makes one ([`Isa::detect`], [`Isa::available`], [`Isa::get`]) besides the
/// portable [`Isa::scalar`], so safe code cannot select SIMD kernels this CPU lacks. The SIMD
/// kernels' `SAFETY` arguments rest on that.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Isa {
    level: IsaLevel,
    sums: Sums,
}

impl Isa {
    /// The portable kernels, on any CPU.
    pub fn scalar() -> Isa {
        Isa::at(IsaLevel::Scalar)
    }

    /// `level` (its availability checked by the caller) with block sums, the faster
    /// arithmetic on every ISA that has both (1.5-1.9x lanes on Gemma's prefill with AVX-512
    /// VNNI and with AVX2), so every CPU gives the same bits by default.
    fn at(level: IsaLevel) -> Isa {
        Isa { level, sums: Sums::Blocks }
    }

    /// The same instruction set with another arithmetic.
    pub fn with_sums(self, sums: Sums) -> Isa {
        Isa { sums, ..self }
    }

    /// The arithmetic of the quantised dot products.
    pub fn sums(self) -> Sums {
        self.sums
    }

    /// The best level this CPU runs, ignoring the environment.
    fn best_supported() -> IsaLevel {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                if has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512vnni") {
                    return IsaLevel::Avx512Vnni;
                }
                return IsaLevel::Avx2;
            }
        }
        IsaLevel::Scalar
    }

    /// The best instruction set this CPU supports. `BULKHEAD_FORCE_SCALAR=1` forces the
    /// portable kernels and `BULKHEAD_NO_VNNI=1` the AVX2 ones (to test them, to compare,
    /// or to rule a SIMD path out).
    pub fn detect() -> Isa {
        let set = |var: &str| std::env::var_os(var).is_some_and(|v| v == "1");
        if set("BULKHEAD_FORCE_SCALAR") {
            return Isa::scalar();
        }
        match Isa::best_supported() {
            IsaLevel::Avx512Vnni if set("BULKHEAD_NO_VNNI") => Isa::at(IsaLevel::Avx2),
            level => Isa::at(level),
        }
    }

    /// `level`, if this CPU runs it.
    pub fn get(level: IsaLevel) -> Option<Isa> {
        (level <= Isa::best_supported()).then_some(Isa::at(level))
    }

    /// Every instruction set this CPU can run, portable first (for tests that compare them).
    pub fn available() -> Vec<Isa> {
        [IsaLevel::Scalar, IsaLevel::Avx2, IsaLevel::Avx512Vnni].into_iter().filter_map(Isa::get).collect()
    }

    /// Its level.
    pub fn level(self) -> IsaLevel {
        self.level
    }

    /// Whether quantised matrices are multiplied in the packed layout: always with AVX-512
    /// VNNI, with block sums on AVX2 (lane sums there run the row kernels).
    pub fn packs_weights(self) -> bool {
        match self.level {
            IsaLevel::Avx512Vnni => true,
            IsaLevel::Avx2 => self.sums == Sums::Blocks,
            IsaLevel::Scalar => false,
        }
    }

    /// Name for logs and benchmarks.
    pub fn name(self) -> &'static str {
        self.level.name()
    }
}

/// Whether `ty` is a block-quantised weight type, multiplied against 8-bit activations.
pub fn is_block_quantized(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0) || crate::kquant::is_kquant(ty)
}

/// `out[i * rows + r] = dot(row r, activation row first_act + i)` for the `rows` rows of a
/// packed matrix ([`packed::pack`]), activation-major (unlike [`dot_q_rows`]); needs
/// an [`Isa`] at [`IsaLevel::Avx512Vnni`].
#[allow(clippy::too_many_arguments)] // mirrors dot_q_rows
pub fn dot_q_packed(isa: Isa, ty: GgmlType, p: &[u8], rows: usize, acts: &Q8Acts, first_act: usize, n: usize, out: &mut [f32]) {
    assert!(first_act + n <= acts.rows, "activation rows {first_act}+{n} of {}", acts.rows);
    match isa.level() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx512Vnni => vnni::dot_packed(ty, isa.sums(), p, rows, acts, first_act, n, out),
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 if isa.packs_weights() => avx2_packed::dot_packed(ty, p, rows, acts, first_act, n, out),
        _ => panic!("packed weights need AVX-512 VNNI or AVX2 with block sums, not {} with {}", isa.name(), isa.sums().name()),
    }
}

/// `out[r * n + i] = dot(weight row r, activation row first_act + i)` for the consecutive
/// rows in `w` (`row_bytes` each, of a block-quantised type with `acts.cols` columns) and
/// `n` activation rows.
#[allow(clippy::too_many_arguments)] // mirrors the kernel: matrix rows, activation rows, output
pub fn dot_q_rows(isa: Isa, ty: GgmlType, w: &[u8], row_bytes: usize, acts: &Q8Acts, first_act: usize, n: usize, out: &mut [f32]) {
    let nb = acts.blocks_per_row();
    let want = ty.bytes_for(acts.cols as u64).filter(|_| is_block_quantized(ty)).map(|b| b as usize);
    assert!(want == Some(row_bytes) && w.len().is_multiple_of(row_bytes), "weight rows of {row_bytes} bytes for {nb} blocks of {ty}");
    assert!(acts.sums.len() == acts.qs.len() / 16, "activation sums");
    assert!(out.len() == w.len() / row_bytes * n, "output of {} for {} rows x {n}", out.len(), w.len() / row_bytes);
    assert!(first_act + n <= acts.rows, "activation rows {first_act}+{n} of {}", acts.rows);
    // Block sums of the 32-element formats: the scalar kernel's, which they are by definition
    // (the SIMD ISAs multiply these formats packed, so only tests and odd callers come here).
    let rows_simd = isa.sums() == Sums::Lanes || crate::kquant::is_kquant(ty);
    match isa.level() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 if rows_simd => avx2::dot_q_rows(ty, isa.sums(), w, row_bytes, acts, first_act, n, out, false),
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx512Vnni if rows_simd => avx2::dot_q_rows(ty, isa.sums(), w, row_bytes, acts, first_act, n, out, true),
        _ => scalar::dot_q_rows(ty, w, row_bytes, acts, first_act, n, out),
    }
}

/// Quantise `x` (`rows * cols` values) into `acts`, reusing its allocations.
pub fn quantize_acts(isa: Isa, x: &[f32], rows: usize, cols: usize, acts: &mut Q8Acts) {
    assert!(cols.is_multiple_of(QK) && x.len() == rows * cols, "activation shape {rows}x{cols} vs {} values", x.len());
    let nb = rows * cols / QK;
    acts.rows = rows;
    acts.cols = cols;
    acts.d.resize(nb, 0.0);
    acts.s.resize(nb, 0.0);
    acts.qs.resize(rows * cols, 0);
    // Blocks are independent: rows in parallel, 32 at a time (decode steps stay on one thread).
    let (rows_per_task, blocks) = (32, cols / QK);
    let (xs, qs) = (x.par_chunks(rows_per_task * cols), acts.qs.par_chunks_mut(rows_per_task * cols));
    let (d, s) = (acts.d.par_chunks_mut(rows_per_task * blocks), acts.s.par_chunks_mut(rows_per_task * blocks));
    xs.zip(d).zip(s).zip(qs).for_each(|(((x, d), s), qs)| match isa.level() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 | IsaLevel::Avx512Vnni => avx2::quantize(x, d, s, qs),
        _ => scalar::quantize(x, d, s, qs),
    });
    acts.sums.resize(rows * cols / 16, 0);
    acts.qs.par_chunks(rows_per_task * cols).zip(acts.sums.par_chunks_mut(rows_per_task * cols / 16)).for_each(|(q, s)| {
        for (g, o) in q.chunks_exact(16).zip(s) {
            *o = g.iter().map(|&v| i32::from(v)).sum();
        }
    });
}

/// `out[i] = dot(w_row, x row i)` for a row of an F32, F16 or BF16 matrix; `x` holds
/// `out.len()` rows of `cols` values.
pub fn dot_f_row(isa: Isa, ty: GgmlType, w_row: &[u8], x: &[f32], cols: usize, out: &mut [f32]) {
    let eb = match ty {
        GgmlType::F32 => 4,
        GgmlType::F16 | GgmlType::BF16 => 2,
        other => unreachable!("{other} is not a float type"),
    };
    assert!(w_row.len() == cols * eb && x.len() == out.len() * cols, "float row shapes");
    for (o, xr) in out.iter_mut().zip(x.chunks_exact(cols)) {
        *o = match (isa.level(), ty) {
            #[cfg(target_arch = "x86_64")]
            (IsaLevel::Avx2 | IsaLevel::Avx512Vnni, GgmlType::F16) => avx2::dot_f16_bytes(w_row, xr),
            (_, GgmlType::F16) => scalar::dot_f16_bytes(w_row, xr),
            (_, GgmlType::BF16) => scalar::dot_bf16_bytes(w_row, xr),
            _ => scalar::dot_f32_bytes(w_row, xr),
        };
    }
}

/// Element types of keys and values attention reads: the pool's f16, or f32 after a page
/// was converted once for many query rows. Results do not depend on which (f16 converts to
/// f32 exactly and the arithmetic is the same).
pub trait KvElem: Copy + private::Both {}
impl KvElem for f16 {}
impl KvElem for f32 {}

mod private {
    #[cfg(target_arch = "x86_64")]
    pub trait Both: super::avx2::Lanes + super::vnni::Lanes16 + super::scalar::Scalar {}
    #[cfg(not(target_arch = "x86_64"))]
    pub trait Both: super::scalar::Scalar {}
    impl Both for half::f16 {}
    impl Both for f32 {}
}

/// Integer multiply-adds one thread does in `rounds` rounds of independent chains of the
/// ISA's integer-dot instruction alone (`vpdpbusd` with AVX-512 VNNI, `vpmaddubsw` with AVX2):
/// timed, it is the compute wall of the quantised matrix kernels. `None` on the scalar level,
/// which has no such instruction.
pub fn int8_dot_chains(isa: Isa, rounds: u64) -> Option<u64> {
    match isa.level() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx512Vnni => Some(vnni::dot_chains(rounds)),
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 => Some(avx2::dot_chains(rounds)),
        _ => None,
    }
}

/// `sum(k[i] * q[i])`.
#[inline]
pub fn dot_kv<T: KvElem>(isa: Isa, k: &[T], q: &[f32]) -> f32 {
    assert_eq!(k.len(), q.len());
    match isa.level() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 | IsaLevel::Avx512Vnni => avx2::dot(k, q),
        _ => scalar::dot(k, q),
    }
}

/// `acc[i] += a * v[i]`.
#[inline]
pub fn axpy_kv<T: KvElem>(isa: Isa, acc: &mut [f32], a: f32, v: &[T]) {
    assert_eq!(acc.len(), v.len());
    match isa.level() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 | IsaLevel::Avx512Vnni => avx2::axpy(acc, a, v),
        _ => scalar::axpy(acc, a, v),
    }
}

/// `out[j] = dot(k row j, q)` for the `out.len()` rows of `k` (each `q.len()` wide); equal
/// to calling [`dot_kv`] per row.
pub fn dot_kv_rows<T: KvElem>(isa: Isa, k: &[T], q: &[f32], out: &mut [f32]) {
    assert_eq!(k.len(), q.len() * out.len(), "rows of k");
    match isa.level() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 | IsaLevel::Avx512Vnni => avx2::dot_rows(k, q, out),
        _ => scalar::dot_rows(k, q, out),
    }
}

/// [`dot_kv_rows`] for two query rows at once: `q` holds them (`d` values each), and row
/// `r`'s results go to `out[r * stride..r * stride + n]` for the `n` rows of `k`. The same
/// bits as two calls of [`dot_kv_rows`]; on AVX-512 one pass over `k` for both rows (the
/// prefill's scores, rows sharing a page's keys).
pub fn dot_kv_rows2<T: KvElem>(isa: Isa, k: &[T], q: &[f32], out: &mut [f32], stride: usize) {
    let d = q.len() / 2;
    assert!(d > 0 && q.len() == 2 * d && k.len().is_multiple_of(d), "dot_kv_rows2 shape");
    let n = k.len() / d;
    assert!(stride >= n && out.len() >= stride + n, "dot_kv_rows2 output");
    match isa.level() {
        // 64-wide heads keep their query in registers in the one-row kernel: not this one.
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx512Vnni if d.is_multiple_of(8) && d != 64 => vnni::dot_rows2(k, q, out, stride),
        _ => {
            let (first, second) = out.split_at_mut(stride);
            dot_kv_rows(isa, k, &q[..d], &mut first[..n]);
            dot_kv_rows(isa, k, &q[d..], &mut second[..n]);
        }
    }
}

/// [`weighted_sum_kv`] for two output rows at once: `out` holds both (`cols` values each),
/// `w[r]` row `r`'s weights for the rows of `v`. The same bits as two calls.
pub fn weighted_sum_kv2<T: KvElem>(isa: Isa, out: &mut [f32], w: [&[f32]; 2], v: &[T]) {
    let cols = out.len() / 2;
    assert!(out.len() == 2 * cols && w[0].len() == w[1].len() && v.len() == cols * w[0].len(), "rows of v");
    match isa.level() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx512Vnni if cols.is_multiple_of(16) => vnni::weighted_sum2(out, w, v),
        _ => {
            let (first, second) = out.split_at_mut(cols);
            weighted_sum_kv(isa, first, w[0], v);
            weighted_sum_kv(isa, second, w[1], v);
        }
    }
}

/// `out += Σ_j w[j] · v row j` for the `w.len()` rows of `v` (each `out.len()` wide); equal to
/// calling [`axpy_kv`] per row, in order.
pub fn weighted_sum_kv<T: KvElem>(isa: Isa, out: &mut [f32], w: &[f32], v: &[T]) {
    assert_eq!(v.len(), out.len() * w.len(), "rows of v");
    match isa.level() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx512Vnni if out.len().is_multiple_of(16) => vnni::weighted_sum(out, w, v),
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 | IsaLevel::Avx512Vnni => avx2::weighted_sum(out, w, v),
        _ => scalar::weighted_sum(out, w, v),
    }
}

/// `v[i] = e^(v[i] - max)`, rounded exactly as glibc's `expf` rounds `e^(v[i] - max)` (the
/// softmax's weights; the llama.cpp fixtures were matched with those bits), on every ISA and
/// every C library.
pub fn exp_shifted(isa: Isa, v: &mut [f32], max: f32) {
    match isa.level() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx512Vnni => vnni::exp_shifted(v, max),
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 => avx2::exp_shifted(v, max),
        _ => scalar::exp_shifted(v, max),
    }
}

/// `gate[i] = gelu(gate[i]) · up[i]` with ggml's CPU GELU (tanh approximation through an
/// f16 table), the same bits on every ISA.
pub fn gelu_mul(isa: Isa, gate: &mut [f32], up: &[f32]) {
    match isa.level() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 | IsaLevel::Avx512Vnni => avx2::gelu_mul(gate, up),
        _ => scalar::gelu_mul(gate, up),
    }
}

/// `dst = src` widened to f32 (exact), replacing `dst`'s contents.
pub fn widen_f16(isa: Isa, src: &[f16], dst: &mut Vec<f32>) {
    dst.clear();
    dst.resize(src.len(), 0.0);
    match isa.level() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 | IsaLevel::Avx512Vnni => avx2::widen(src, dst),
        _ => dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32()),
    }
}

/// Ask the CPU to start loading `data` into its L2 cache: a hint, with no effect on any
/// result. Attention walks a sequence's pages, each a short run scattered through the pool,
/// and the hardware prefetcher finds each new run too late (BENCHMARKS.md, 2026-12-04
/// night).
pub fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        let base = data.as_ptr().cast::<i8>();
        for line in (0..std::mem::size_of_val(data)).step_by(64) {
            // SAFETY: the address lies inside `data`; a prefetch never faults and brings
            // nothing into the program, only into the cache.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(base.add(line)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_kernels_match_their_one_row_forms_bit_for_bit_on_every_isa_and_width() {
        // 16 keys (a full page) and 13 (a partial one, past the kernels' blocks of eight).
        for (cols, n) in [16, 48, 64, 80, 256].into_iter().flat_map(|c| [(c, 16), (c, 13)]) {
            // Random values: sums of them round differently in a different order.
            let mut seed = 0x51ED + cols as u64;
            let q: Vec<f32> = (0..cols).map(|_| rng(&mut seed)).collect();
            let k32: Vec<f32> = (0..cols * n).map(|_| rng(&mut seed)).collect();
            let k16: Vec<f16> = k32.iter().map(|&v| f16::from_f32(v)).collect();
            let w: Vec<f32> = (0..n).map(|j| 0.01 + j as f32 * 0.05).collect();
            let mut by_isa = Vec::new();
            for isa in Isa::available() {
                let mut got = Vec::new();
                for rows in [&k32[..], &widened(&k16)[..]] {
                    let mut batched = vec![0.0; n];
                    dot_kv_rows(isa, rows, &q, &mut batched);
                    let one: Vec<f32> = rows.chunks_exact(cols).map(|r| dot_kv(isa, r, &q)).collect();
                    assert_eq!(batched, one, "{isa:?}, {cols} columns: scores");
                    let (mut summed, mut stepped) = (q.clone(), q.clone());
                    weighted_sum_kv(isa, &mut summed, &w, rows);
                    for (r, &wj) in rows.chunks_exact(cols).zip(&w) {
                        axpy_kv(isa, &mut stepped, wj, r);
                    }
                    assert_eq!(summed, stepped, "{isa:?}, {cols} columns: weighted sum");
                    // Two rows at once: the second query and weights differ from the first.
                    let q2: Vec<f32> = q.iter().chain(q.iter().rev()).copied().collect();
                    let (mut second, stride) = (vec![0.0; n], n + 3);
                    dot_kv_rows(isa, rows, &q2[cols..], &mut second);
                    let mut pair = vec![0.0; stride + n];
                    dot_kv_rows2(isa, rows, &q2, &mut pair, stride);
                    assert_eq!((&pair[..n], &pair[stride..]), (&batched[..], &second[..]), "{isa:?}, {cols} columns: two rows' scores");
                    let w2: Vec<f32> = w.iter().rev().copied().collect();
                    let mut both = q2.clone();
                    weighted_sum_kv2(isa, &mut both, [&w, &w2], rows);
                    let mut other = q2[cols..].to_vec();
                    weighted_sum_kv(isa, &mut other, &w2, rows);
                    assert_eq!((&both[..cols], &both[cols..]), (&summed[..], &other[..]), "{isa:?}, {cols} columns: two rows' sums");
                    got.push((batched, summed));
                }
                // The f16 rows as stored (the decode path) give what their widened copy gives.
                let (mut from_f16, mut sum_f16) = (vec![0.0; n], q.clone());
                dot_kv_rows(isa, &k16, &q, &mut from_f16);
                weighted_sum_kv(isa, &mut sum_f16, &w, &k16);
                assert_eq!((&from_f16, &sum_f16), (&got[1].0, &got[1].1), "{isa:?}, {cols} columns: f16 rows");
                by_isa.push((isa, got));
            }
            // The AVX-512 weighted sum gives the AVX2 one's bits (same FMA per element).
            let sums: Vec<_> = by_isa
                .iter()
                .filter(|(i, _)| i.level() >= IsaLevel::Avx2)
                .map(|(_, g)| g.iter().map(|x| x.1.clone()).collect::<Vec<_>>())
                .collect();
            assert!(sums.windows(2).all(|p| p[0] == p[1]), "{cols} columns: weighted sums differ between SIMD levels");
        }
    }

    fn widened(k: &[f16]) -> Vec<f32> {
        k.iter().map(|v| v.to_f32()).collect()
    }

    use crate::quant::{dequantize_row, quantize_row};

    fn rng(seed: &mut u64) -> f32 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Every block-quantised weight type.
    const QUANTISED: [GgmlType; 10] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    /// Quantised dot products agree with dequantise-then-multiply (exact up to the
    /// activation's 8-bit rounding) and SIMD agrees with scalar, for every type and tile size.
    #[test]
    #[allow(clippy::needless_range_loop)]
    fn quantised_dots_match_a_dequantised_reference_on_every_isa() {
        let mut seed = 0x9E3779B97F4A7C15;
        let cols = 512;
        for ty in QUANTISED {
            let w: Vec<f32> = (0..cols).map(|_| rng(&mut seed)).collect();
            let wq = quantize_row(ty, &w);
            let many: Vec<u8> = (0..7).flat_map(|_| quantize_row(ty, &(0..cols).map(|_| rng(&mut seed)).collect::<Vec<_>>())).collect();
            let mut wd = vec![0.0; cols];
            dequantize_row(ty, &wq, &mut wd);
            for n in 1..=7 {
                let x: Vec<f32> = (0..n * cols).map(|_| rng(&mut seed) * 3.0).collect();
                let mut acts = Q8Acts::default();
                quantize_acts(Isa::scalar(), &x, n, cols, &mut acts);
                let mut simd = Q8Acts::default();
                quantize_acts(Isa::detect(), &x, n, cols, &mut simd);
                assert_eq!((&simd.d, &simd.s, &simd.qs), (&acts.d, &acts.s, &acts.qs), "quantisation differs across ISAs");
                let mut xd = vec![0.0; n * cols];
                for r in 0..n {
                    for (b, v) in xd[r * cols..(r + 1) * cols].chunks_exact_mut(32).enumerate() {
                        let blk = r * cols / 32 + b;
                        for (j, o) in v.iter_mut().enumerate() {
                            *o = acts.d[blk] * f32::from(acts.qs[blk * 32 + j]);
                        }
                    }
                }
                let mut s = vec![0.0; n];
                dot_q_rows(Isa::scalar(), ty, &wq, wq.len(), &acts, 0, n, &mut s);
                for r in 0..n {
                    let want: f32 = wd.iter().zip(&xd[r * cols..(r + 1) * cols]).map(|(a, b)| a * b).sum();
                    assert!((s[r] - want).abs() < 1e-2 * (1.0 + want.abs()), "{ty} scalar row {r}: {} vs {want}", s[r]);
                }
                // Lanes: every SIMD level gives the same bits (AVX-512 CPUs run the k-quants'
                // AVX2 kernel compiled for 32 registers). Blocks: every level, scalar included,
                // gives the scalar kernel's bits. Either way each row alone gives those of
                // the tile.
                for sums in [Sums::Lanes, Sums::Blocks] {
                    let mut bits_of: Option<Vec<u32>> = (sums == Sums::Blocks).then(|| s.iter().map(|x| x.to_bits()).collect());
                    for isa in Isa::available().into_iter().filter(|i| i.level() != IsaLevel::Scalar) {
                        let isa = isa.with_sums(sums);
                        let mut v = vec![0.0f32; n];
                        dot_q_rows(isa, ty, &wq, wq.len(), &acts, 0, n, &mut v);
                        for r in 0..n {
                            assert!((s[r] - v[r]).abs() < 1e-4 * (1.0 + s[r].abs()), "{ty} {isa:?} n={n} row {r}: {} vs {}", v[r], s[r]);
                            let mut one = [0.0];
                            dot_q_rows(isa, ty, &wq, wq.len(), &acts, r, 1, &mut one);
                            assert_eq!(one[0].to_bits(), v[r].to_bits(), "{ty} {isa:?} row {r} alone vs in a tile of {n}");
                        }
                        let bits: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
                        assert_eq!(bits_of.get_or_insert_with(|| bits.clone()), &bits, "{ty} n={n}: {isa:?} differs from another level");
                        // Several weight rows in one call (a decode step's row kernel runs up
                        // to four a call): each row gives the bits it gives alone.
                        let mut all = vec![0.0f32; many.len() / wq.len() * n];
                        dot_q_rows(isa, ty, &many, wq.len(), &acts, 0, n, &mut all);
                        for (r, row) in many.chunks_exact(wq.len()).enumerate() {
                            let mut alone = vec![0.0f32; n];
                            dot_q_rows(isa, ty, row, wq.len(), &acts, 0, n, &mut alone);
                            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(bits(&all[r * n..(r + 1) * n]), bits(&alone), "{ty} {isa:?} n={n}: weight row {r} of 7");
                        }
                    }
                }
            }
        }
    }

    /// The instruction sets with the arithmetic in which each multiplies packed weights (VNNI:
    /// both; AVX2: block sums), with the AVX2 level whose row kernels they must agree with
    /// (for block sums of the 32-element formats, the scalar kernel); none without AVX2.
    fn packing_isas(test: &str) -> Option<(Isa, Vec<Isa>)> {
        let Some(avx2) = Isa::get(IsaLevel::Avx2) else {
            eprintln!("{test}: this CPU has no AVX2; nothing to compare");
            return None;
        };
        let all = Isa::available().into_iter().flat_map(|i| [i.with_sums(Sums::Lanes), i.with_sums(Sums::Blocks)]);
        Some((avx2, all.filter(|i| i.packs_weights()).collect()))
    }

    /// The packed kernels (VNNI in either arithmetic, AVX2 with block sums) give the row
    /// kernels' results bit for bit, for every type, for row counts that end inside a group
    /// (and inside its first half) and for every tile size (so each activation row is also
    /// the same alone or in a tile).
    #[test]
    fn packed_weights_give_the_row_kernels_bits() {
        let Some((avx2_isa, packers)) = packing_isas("packed_weights_give_the_row_kernels_bits") else {
            return;
        };
        let mut seed = 7;
        let types = QUANTISED.into_iter().filter(|&t| packed::supports(t));
        for ty in types {
            // k-quants come in 256-element superblocks: two of them.
            let cols = if crate::kquant::is_kquant(ty) { 512 } else { 128 };
            for rows in [1, 5, 8, 13, 24] {
                let mut w: Vec<u8> =
                    (0..rows).flat_map(|_| quantize_row(ty, &(0..cols).map(|_| rng(&mut seed)).collect::<Vec<_>>())).collect();
                let row_bytes = w.len() / rows;
                if ty == GgmlType::Q8_0 {
                    w[2] = 0x80; // -128 is a valid Q8_0 weight the quantiser never writes
                }
                let p = packed::pack(ty, rows, row_bytes, &w);
                for (n, &isa) in (1..=9).flat_map(|n| packers.iter().map(move |i| (n, i))) {
                    let avx2_isa = avx2_isa.with_sums(isa.sums());
                    let x: Vec<f32> = (0..n * cols).map(|_| rng(&mut seed) * 2.0).collect();
                    let mut acts = Q8Acts::default();
                    quantize_acts(avx2_isa, &x, n, cols, &mut acts);
                    let mut want = vec![0.0; rows * n];
                    dot_q_rows(avx2_isa, ty, &w, row_bytes, &acts, 0, n, &mut want);
                    let mut got = vec![0.0; rows * n];
                    dot_q_packed(isa, ty, &p, rows, &acts, 0, n, &mut got);
                    for r in 0..rows {
                        for a in 0..n {
                            assert_eq!(
                                got[a * rows + r].to_bits(),
                                want[r * n + a].to_bits(),
                                "{ty} {isa:?} rows {rows} n {n} row {r} act {a}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The packed k-quant kernels keep the row kernel's bits at the formats' extremes too:
    /// every byte of the superblocks random (scales up to 63, Q6_K's down to -128, all
    /// nibbles and high bits), activations at full scale, where the kernels' exactness rests
    /// on every product staying below 2^24.
    #[test]
    fn packed_kquants_give_the_row_kernels_bits_for_any_bytes() {
        let Some((avx2_isa, packers)) = packing_isas("packed_kquants_give_the_row_kernels_bits_for_any_bytes") else {
            return;
        };
        let mut seed = 11u64;
        let mut byte = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 56) as u8
        };
        let (rows, cols) = (19, 512);
        for (ty, sb, scales) in [
            (GgmlType::Q4_K, 144, [0usize, 2].as_slice()),
            (GgmlType::Q5_K, 176, [0, 2].as_slice()),
            (GgmlType::Q6_K, 210, [208].as_slice()),
        ] {
            let mut w: Vec<u8> = (0..rows * cols / 256 * sb).map(|_| byte()).collect();
            for blk in w.chunks_exact_mut(sb) {
                for &at in scales {
                    // A modest positive f16 scale (0.0039..0.0156): no infinities or NaNs.
                    blk[at..at + 2].copy_from_slice(&(0x1c00u16 + u16::from(byte())).to_le_bytes());
                }
            }
            let row_bytes = w.len() / rows;
            let p = packed::pack(ty, rows, row_bytes, &w);
            // Activations that quantise to the ends of the range.
            let x: Vec<f32> = (0..3 * cols)
                .map(|i| {
                    if i % 3 == 0 {
                        1.0
                    } else if i % 3 == 1 {
                        -1.0
                    } else {
                        0.5
                    }
                })
                .collect();
            let mut acts = Q8Acts::default();
            quantize_acts(avx2_isa, &x, 3, cols, &mut acts);
            // Blocks: the scalar kernel's bits as well.
            let mut scalar = vec![0.0; rows * 3];
            dot_q_rows(Isa::scalar(), ty, &w, row_bytes, &acts, 0, 3, &mut scalar);
            for &isa in &packers {
                let mut want = vec![0.0; rows * 3];
                dot_q_rows(avx2_isa.with_sums(isa.sums()), ty, &w, row_bytes, &acts, 0, 3, &mut want);
                let mut got = vec![0.0; rows * 3];
                dot_q_packed(isa, ty, &p, rows, &acts, 0, 3, &mut got);
                // And one activation row at a time (a decode step's one-row kernels).
                let mut one = vec![0.0; rows];
                for a in 0..3 {
                    dot_q_packed(isa, ty, &p, rows, &acts, a, 1, &mut one);
                    for r in 0..rows {
                        assert_eq!(one[r].to_bits(), want[r * 3 + a].to_bits(), "{ty} {isa:?} one row: row {r} act {a}");
                    }
                }
                for r in 0..rows {
                    for a in 0..3 {
                        assert_eq!(got[a * rows + r].to_bits(), want[r * 3 + a].to_bits(), "{ty} {isa:?} row {r} act {a}");
                        if isa.sums() == Sums::Blocks {
                            assert_eq!(got[a * rows + r].to_bits(), scalar[r * 3 + a].to_bits(), "{ty} scalar row {r} act {a}");
                        }
                    }
                }
            }
        }
    }

    /// `gelu_mul` gives the scalar function's bits on every ISA: inputs across the table's
    /// range and past both exact ends (±10, where the f16 rounding meets them), f16 rounding
    /// ties, infinities, subnormals, and lengths that leave a remainder.
    #[test]
    fn gelu_gives_the_scalar_bits_on_every_isa() {
        let mut seed = 5u64;
        let mut x: Vec<f32> = (0..4001).map(|i| (i as f32 - 2000.0) / 150.0).collect();
        x.extend((0..2000).map(|_| rng(&mut seed) * 12.0));
        // f16 rounding ties (half-way between two f16 values) and the ends of the table.
        x.extend((0..200u16).map(|i| (f16::from_bits(0x3c00 + i).to_f32() + f16::from_bits(0x3c01 + i).to_f32()) / 2.0));
        x.extend([-10.0, 10.0, -9.999, 9.999, -10.001, 10.001, f32::INFINITY, f32::NEG_INFINITY, 1e-40, -1e-40, 0.0, -0.0, 65504.0, 1e6]);
        let up: Vec<f32> = (0..x.len()).map(|_| rng(&mut seed) * 3.0).collect();
        for len in [x.len(), x.len() - 3, 7, 0] {
            let mut want = x[..len].to_vec();
            scalar::gelu_mul(&mut want, &up);
            for isa in Isa::available() {
                let mut got = x[..len].to_vec();
                gelu_mul(isa, &mut got, &up);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "{isa:?} gelu({}) * {}: {g} vs {w}", x[i], up[i]);
                }
            }
        }
    }

    /// `exp_shifted` gives glibc's `expf` bits on every ISA: the whole f32 line at a stride
    /// (every value with `BULKHEAD_EXP_STRIDE=1`), which crosses every branch (NaN, both
    /// infinities, overflow, the two underflow ranges, subnormals), and a dense run over the
    /// softmax's own domain. Against `f32::exp` only where that is glibc's FMA build.
    #[test]
    fn exp_gives_glibcs_expf_bits_on_every_isa() {
        let stride: u64 = std::env::var("BULKHEAD_EXP_STRIDE").ok().and_then(|v| v.parse().ok()).unwrap_or(4099);
        let glibc_fma = cfg!(all(target_os = "linux", target_env = "gnu", target_arch = "x86_64")) && {
            #[cfg(target_arch = "x86_64")]
            let fma = std::arch::is_x86_feature_detected!("fma");
            #[cfg(not(target_arch = "x86_64"))]
            let fma = false;
            fma
        };
        let dense = (-104.0f32).to_bits()..=(-96.0f32).to_bits();
        let line = (0..=u64::from(u32::MAX)).step_by(stride as usize).map(|b| f32::from_bits(b as u32));
        let specials = [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -88.0, 88.0, 88.72283, 89.0];
        let bits = |v: &[f32]| v.iter().map(|y| if y.is_nan() { u32::MAX } else { y.to_bits() }).collect::<Vec<_>>();
        let check = |chunk: &[f32]| {
            let mut by_isa = Vec::new();
            for isa in Isa::available() {
                let mut v = chunk.to_vec();
                exp_shifted(isa, &mut v, 0.0);
                if glibc_fma {
                    for (x, y) in chunk.iter().zip(&v) {
                        let want = x.exp();
                        assert!(
                            want.to_bits() == y.to_bits() || (want.is_nan() && y.is_nan()),
                            "{isa:?}: exp({x:e}) = {y:e}, glibc {want:e}"
                        );
                    }
                }
                by_isa.push(bits(&v));
            }
            assert!(by_isa.windows(2).all(|w| w[0] == w[1]), "exp differs between ISAs");
        };
        let mut buf = Vec::with_capacity(1 << 22);
        for x in line.chain(dense.step_by(7).map(f32::from_bits)).chain(specials) {
            buf.push(x);
            if buf.len() == buf.capacity() {
                check(&buf);
                buf.clear();
            }
        }
        check(&buf);
        // The shift is applied in f32 first, as the softmax does.
        let (mut v, mut w) = (vec![1.5f32, -3.25, 0.0], vec![0.0f32, -4.75, -1.5]);
        exp_shifted(Isa::detect(), &mut v, 1.5);
        exp_shifted(Isa::detect(), &mut w, 0.0);
        assert_eq!(v, w);
    }

    #[test]
    fn float_rows_and_attention_helpers_agree_across_isas() {
        let mut seed = 42;
        let cols = 96;
        let w: Vec<f32> = (0..cols).map(|_| rng(&mut seed)).collect();
        let x: Vec<f32> = (0..2 * cols).map(|_| rng(&mut seed)).collect();
        for ty in [GgmlType::F16, GgmlType::F32] {
            let wb = quantize_row(ty, &w);
            let mut wd = vec![0.0; cols];
            dequantize_row(ty, &wb, &mut wd);
            let mut a = [0.0; 2];
            let mut b = [0.0; 2];
            dot_f_row(Isa::scalar(), ty, &wb, &x, cols, &mut a);
            dot_f_row(Isa::detect(), ty, &wb, &x, cols, &mut b);
            for r in 0..2 {
                let want: f32 = wd.iter().zip(&x[r * cols..]).map(|(p, q)| p * q).sum();
                assert!((a[r] - want).abs() < 1e-4 && (b[r] - want).abs() < 1e-4, "{ty}: {a:?} {b:?} {want}");
            }
        }
        let k: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        let q = &x[..cols];
        let want: f32 = k.iter().zip(q).map(|(a, b)| a.to_f32() * b).sum();
        assert!((dot_kv(Isa::detect(), &k, q) - want).abs() < 1e-4);
        assert!((dot_kv(Isa::scalar(), &k, q) - want).abs() < 1e-4);
        let rows: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        for isa in [Isa::scalar(), Isa::detect()] {
            let mut one_by_one = vec![0.0; 2];
            for (j, o) in one_by_one.iter_mut().enumerate() {
                *o = dot_kv(isa, &rows[j * cols..(j + 1) * cols], &w);
            }
            let mut batched = vec![0.0; 2];
            dot_kv_rows(isa, &rows, &w, &mut batched);
            assert_eq!(one_by_one, batched, "{isa:?} dot rows");
            let mut a = w.clone();
            axpy_kv(isa, &mut a, 0.3, &rows[..cols]);
            axpy_kv(isa, &mut a, -1.7, &rows[cols..]);
            let mut b = w.clone();
            weighted_sum_kv(isa, &mut b, &[0.3, -1.7], &rows);
            assert_eq!(a, b, "{isa:?} weighted sum");
        }
        let mut acc1 = x[cols..].to_vec();
        let mut acc2 = acc1.clone();
        axpy_kv(Isa::scalar(), &mut acc1, 0.37, &k);
        axpy_kv(Isa::detect(), &mut acc2, 0.37, &k);
        for (a, b) in acc1.iter().zip(&acc2) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
