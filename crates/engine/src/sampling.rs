//! Next-token sampling: greedy, temperature, top-k and top-p (nucleus).
//!
//! A [`Sampler`] belongs to one sequence and is called once per generated
//! token with that sequence's logits row. Performance notes (vocabularies of
//! ~50k, one call per token per sequence):
//!
//! - greedy is a single pass over the logits;
//! - scratch buffers are kept in the sampler, so steady-state sampling does
//!   not allocate;
//! - top-k streams once over the logits with a rising threshold and
//!   `select_nth_unstable_by`, exponentiating only the `k` survivors;
//! - the full softmax uses a branch-free polynomial `exp` that vectorises;
//! - top-p never sorts the vocabulary: a threshold pass bounds the nucleus,
//!   and a weighted quickselect finds its exact cut.

use std::cmp::Ordering;

use bulkhead_protocol::Sampling;
use thiserror::Error;

use crate::rng::{Rng, entropy_seed};

/// Largest accepted temperature. Values above ~2 are rarely useful, but
/// they are well defined, so they are accepted up to this bound.
pub const MAX_TEMPERATURE: f32 = 100.0;

/// Scaled logits (`(logit - max) / temperature`) below this get weight 0:
/// `exp(-87)` ≈ 1.6e-38 is at the bottom of the normal `f32` range and is
/// negligible against the argmax's weight of 1.
const PRUNE_BELOW: f32 = -87.0;

/// Errors from parameter validation and sampling.
#[derive(Debug, Clone, Copy, PartialEq, Error)]
pub enum SamplingError {
    /// `temperature` is NaN, infinite, negative or above [`MAX_TEMPERATURE`].
    #[error("invalid temperature {value}: must be finite and in [0, {MAX_TEMPERATURE}]")]
    InvalidTemperature {
        /// The rejected value.
        value: f32,
    },
    /// `top_p` is NaN or outside `(0, 1]`.
    #[error("invalid top_p {value}: must be in (0, 1]")]
    InvalidTopP {
        /// The rejected value.
        value: f32,
    },
    /// The logits slice was empty.
    #[error("empty logits: vocabulary size is zero")]
    EmptyLogits,
    /// The logits slice is longer than token ids (`u32`) can address.
    #[error("vocabulary of {len} logits exceeds the u32 token-id range")]
    VocabTooLarge {
        /// Length of the logits slice.
        len: usize,
    },
    /// Every logit was NaN or negative infinity, so no token can be chosen.
    #[error("no finite logits: every logit is NaN or -inf")]
    NoFiniteLogits,
}

/// Checks sampling settings, returning a typed error naming the first bad field and its
/// value. [`Sampler::new`] calls it; the API checks its own, narrower ranges first.
pub fn validate(params: &Sampling) -> Result<(), SamplingError> {
    let t = params.temperature;
    if !(t.is_finite() && (0.0..=MAX_TEMPERATURE).contains(&t)) {
        return Err(SamplingError::InvalidTemperature { value: t });
    }
    let p = params.top_p;
    if !(p > 0.0 && p <= 1.0) {
        return Err(SamplingError::InvalidTopP { value: p });
    }
    Ok(())
}

/// Candidate token: a logit or weight, and its id.
type Cand = (f32, u32);

/// Descending by value, then ascending by id: a total order on candidates
/// (values are never NaN), so ties resolve to the lowest token id. `-0.0`
/// and `0.0` tie, as they do in the greedy argmax.
fn by_value_desc(a: &Cand, b: &Cand) -> Ordering {
    b.0.partial_cmp(&a.0).unwrap_or(Ordering::Equal).then(a.1.cmp(&b.1))
}

/// Per-sequence sampler: validated parameters, an RNG and scratch buffers.
///
/// With `seed: Some(s)` the sequence of sampled tokens is a pure function of
/// `s` and the logits passed in. With `seed: None` the RNG is seeded from
/// [`entropy_seed`] (a process-wide counter mixed with the clock and process
/// id), so two samplers differ even when created at the same instant.
///
/// The scratch buffers grow to the vocabulary size on first use and are then
/// reused, so steady-state sampling does not allocate.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: Sampling,
    rng: Rng,
    /// Per-id unnormalised probabilities (full-vocabulary path).
    weights: Vec<f32>,
    /// Sums of `weights` per [`CHUNK`] ids, to find the drawn id quickly.
    chunk_sums: Vec<f64>,
    /// Candidate list (top-k survivors or top-p nucleus).
    cands: Vec<Cand>,
}

impl Sampler {
    /// Validates `params` and creates a sampler.
    pub fn new(params: Sampling) -> Result<Self, SamplingError> {
        validate(&params)?;
        let seed = match params.seed {
            Some(seed) => seed,
            None => {
                let seed = entropy_seed();
                tracing::trace!(seed, "sampler seeded from entropy");
                seed
            }
        };
        Ok(Self { params, rng: Rng::seed_from_u64(seed), weights: Vec::new(), chunk_sums: Vec::new(), cands: Vec::new() })
    }

    /// The parameters this sampler was created with.
    pub fn params(&self) -> &Sampling {
        &self.params
    }

    /// Consume the random draw that one [`Sampler::sample`] call would, without sampling:
    /// a decode worker continues the stream of a sampler whose first draw the prefill
    /// worker made (greedy sampling draws nothing).
    pub fn skip_draw(&mut self) {
        if !self.params.is_greedy() {
            self.rng.next_f64();
        }
    }

    /// Picks the next token id from `logits` (one entry per vocabulary id).
    ///
    /// `temperature == 0` is greedy: a single pass returning the argmax, ties
    /// going to the lowest id; the RNG is not advanced. Otherwise the logits
    /// are scaled by `1 / temperature`, filtered by top-k (ties at the cut go
    /// to lower ids), then by top-p (the smallest prefix of the
    /// probability-sorted softmax whose mass reaches `top_p`, always at least
    /// the argmax), and one token is drawn from the renormalised remainder
    /// with exactly one RNG draw.
    ///
    /// NaN logits are treated as `-inf` (never chosen). `+inf` logits take
    /// the softmax limit: the mass is shared equally among them. Tokens whose
    /// probability relative to the argmax is below `exp(-87)` ≈ 1.6e-38 are
    /// treated as probability zero.
    ///
    /// # Errors
    ///
    /// [`SamplingError::EmptyLogits`] for an empty slice,
    /// [`SamplingError::VocabTooLarge`] if ids would not fit in `u32`, and
    /// [`SamplingError::NoFiniteLogits`] when every logit is NaN or `-inf`.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplingError> {
        if logits.is_empty() {
            return Err(SamplingError::EmptyLogits);
        }
        if u32::try_from(logits.len()).is_err() {
            return Err(SamplingError::VocabTooLarge { len: logits.len() });
        }
        let (best, max) = argmax(logits).ok_or(SamplingError::NoFiniteLogits)?;
        if self.params.is_greedy() {
            return Ok(best);
        }
        let u = self.rng.next_f64();
        if max == f32::INFINITY {
            return Ok(self.sample_infinite(logits, u));
        }
        let k = self.params.top_k as usize;
        Ok(if k > 0 && k < logits.len() { self.sample_top_k(logits, max, best, u) } else { self.sample_full(logits, max, best, u) })
    }

    /// Full-vocabulary path (no effective top-k): weights for every id in a
    /// vectorisable pass, then either a chunked draw or the top-p nucleus.
    fn sample_full(&mut self, logits: &[f32], max: f32, best: u32, u: f64) -> u32 {
        let t = self.params.temperature;
        let weights = &mut self.weights;
        weights.resize(logits.len(), 0.0);
        for (w, &l) in weights.iter_mut().zip(logits) {
            *w = weight(l, max, t);
        }
        self.chunk_sums.clear();
        let mut total = 0.0f64;
        for chunk in weights.chunks(CHUNK) {
            let s = masked_sum(chunk, -1.0);
            self.chunk_sums.push(s);
            total += s;
        }

        let top_p = self.params.top_p;
        if top_p < 1.0 {
            let target = f64::from(top_p) * total;
            // First (largest) threshold whose super-level set {w > tau} holds
            // the target mass: that set is a sorted prefix, so it contains
            // the nucleus, and usually it is small.
            let tau = NUCLEUS_THRESHOLDS
                .into_iter()
                .find(|&tau| {
                    let mass: f64 = weights.chunks(CHUNK).map(|c| masked_sum(c, tau)).sum();
                    mass >= target
                })
                .unwrap_or(0.0);
            let cands = &mut self.cands;
            cands.clear();
            cands.extend((0u32..).zip(weights.iter()).filter(|&(_, &w)| w > tau).map(|(id, &w)| (w, id)));
            if cands.is_empty() {
                return best;
            }
            let mut mass = 0.0;
            let n = nucleus_len(cands, target, &mut mass);
            return if n == 1 { best } else { draw(&cands[..n], mass, u).unwrap_or(best) };
        }

        draw_chunked(weights, &self.chunk_sums, total, u).unwrap_or(best)
    }

    /// Top-k path: select the `k` best raw logits without sorting the
    /// vocabulary, then weight, nucleus-filter and draw among them only.
    fn sample_top_k(&mut self, logits: &[f32], max: f32, best: u32, u: f64) -> u32 {
        let cands = &mut self.cands;
        top_k_into(logits, self.params.top_k as usize, cands);
        let t = self.params.temperature;
        for c in cands.iter_mut() {
            c.0 = weight(c.0, max, t);
        }
        cands.retain(|c| c.0 > 0.0);
        let mut total: f64 = cands.iter().map(|c| f64::from(c.0)).sum();
        let top_p = self.params.top_p;
        let n = if top_p < 1.0 { nucleus_len(cands, f64::from(top_p) * total, &mut total) } else { cands.len() };
        if n <= 1 {
            return best;
        }
        draw(&cands[..n], total, u).unwrap_or(best)
    }

    /// Some logit is `+inf`: the softmax limit spreads all mass equally over
    /// the `+inf` ids. Top-k keeps the lowest such ids, top-p the first
    /// `ceil(top_p * m)` of the `m` remaining.
    fn sample_infinite(&self, logits: &[f32], u: f64) -> u32 {
        let is_inf = |&(_, &l): &(u32, &f32)| l == f32::INFINITY;
        let mut m = logits.iter().filter(|&&l| l == f32::INFINITY).count();
        if self.params.top_k > 0 {
            m = m.min(self.params.top_k as usize);
        }
        if self.params.top_p < 1.0 {
            let kept = (f64::from(self.params.top_p) * m as f64).ceil() as usize;
            m = kept.clamp(1, m);
        }
        let j = ((u * m as f64) as usize).min(m - 1);
        (0u32..).zip(logits).filter(is_inf).nth(j).map_or(0, |(id, _)| id)
    }
}

/// Ids per chunk for the chunked cumulative search in [`draw_chunked`].
const CHUNK: usize = 512;

/// Weight thresholds (relative to the argmax's weight of 1) tried, largest
/// first, to bound the top-p nucleus before partitioning it: e^-4, e^-10,
/// e^-24, then every nonzero weight. Each try is one vectorised pass.
const NUCLEUS_THRESHOLDS: [f32; 4] = [0.018_315_64, 4.539_993e-5, 3.775_134_5e-11, 0.0];

/// Unnormalised probability of logit `l` given the (finite) maximum `max`
/// and temperature `t > 0`: `exp((l - max) / t)`, or 0 for NaN, `-inf` and
/// negligible tokens. Branch-free so the full-vocabulary pass vectorises.
#[inline(always)]
fn weight(l: f32, max: f32, t: f32) -> f32 {
    // x <= 0 because l <= max; NaN, -inf and tiny x fail the comparison.
    let x = (l - max) / t;
    let keep = x >= PRUNE_BELOW;
    let e = exp_neg(if keep { x } else { PRUNE_BELOW });
    if keep { e } else { 0.0 }
}

/// `exp(x)` for `x` in `[PRUNE_BELOW, 0]`, about 1 ulp accurate.
///
/// Cephes-style: `x = n ln2 + r` with `|r| <= ln2 / 2` (Cody–Waite split of
/// ln 2), a degree-7 polynomial for `exp(r)`, and `2^n` built from exponent
/// bits. No libm call, so loops over it vectorise. Outside the domain the
/// result is unspecified (but never a panic).
#[inline(always)]
pub(crate) fn exp_neg(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // Exactly 355/512 = 0.693359375: few mantissa bits, so n * LN2_HI is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    // The integer n sits in the low mantissa bits of `shifted`.
    let ni = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_2e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    let scale = f32::from_bits((ni.wrapping_add(127).clamp(1, 254) as u32) << 23);
    er * scale
}

/// Sum (in `f64`) of the entries of `c` above `tau`, with independent lanes
/// so that it vectorises.
fn masked_sum(c: &[f32], tau: f32) -> f64 {
    const LANES: usize = 8;
    let mut acc = [0.0f64; LANES];
    let mut it = c.chunks_exact(LANES);
    for ch in &mut it {
        for (a, &w) in acc.iter_mut().zip(ch) {
            *a += if w > tau { f64::from(w) } else { 0.0 };
        }
    }
    let mut s: f64 = acc.iter().sum();
    for &w in it.remainder() {
        if w > tau {
            s += f64::from(w);
        }
    }
    s
}

/// Single-pass argmax: the lowest id holding the largest non-NaN logit, with
/// that logit. `None` when every logit is NaN or `-inf`.
pub(crate) fn argmax(logits: &[f32]) -> Option<(u32, f32)> {
    let mut best_val = f32::NEG_INFINITY;
    let mut best_id = None;
    for (id, &l) in (0u32..).zip(logits) {
        // NaN > x is false: NaN is never selected. Strict `>` keeps the
        // lowest id on ties.
        if l > best_val {
            best_val = l;
            best_id = Some(id);
        }
    }
    best_id.map(|id| (id, best_val))
}

/// Fills `out` with the `k` best `(logit, id)` pairs of `logits` (fewer if
/// fewer are finite-or-`+inf`), ordered by [`by_value_desc`]'s key but not
/// sorted. NaN and `-inf` never qualify.
///
/// Streams once over the logits with a rising threshold: candidates above it
/// are buffered, and when the buffer fills it is cut back to the best `k`
/// with `select_nth_unstable_by`, whose k-th value becomes the threshold.
/// Later ids lose ties, so only values strictly above it can still qualify.
pub(crate) fn top_k_into(logits: &[f32], k: usize, out: &mut Vec<Cand>) {
    debug_assert!(k > 0);
    out.clear();
    let cap = k + k.max(256);
    let mut threshold = f32::NEG_INFINITY;
    for (id, &l) in (0u32..).zip(logits) {
        if l > threshold {
            out.push((l, id));
            if out.len() == cap {
                out.select_nth_unstable_by(k - 1, by_value_desc);
                out.truncate(k);
                threshold = out[k - 1].0;
            }
        }
    }
    if out.len() > k {
        out.select_nth_unstable_by(k - 1, by_value_desc);
        out.truncate(k);
    }
}

/// Reorders `cands` (weights) so that its first `n` entries are the top-p
/// nucleus, and returns `n`: the length of the shortest prefix of `cands`
/// sorted by [`by_value_desc`] whose mass reaches `target` (at least 1,
/// all of `cands` if rounding keeps the sum just short). `mass` is set to
/// the nucleus mass. The nucleus itself is left in an unspecified but
/// deterministic order.
///
/// Weighted quickselect, O(len) expected and no full sort: repeatedly split
/// the undecided range at its median with `select_nth_unstable_by`, commit
/// the better half if its mass still falls short of the target, otherwise
/// recurse into it; small ranges are sorted and scanned.
fn nucleus_len(cands: &mut [Cand], target: f64, mass: &mut f64) -> usize {
    const SMALL: usize = 64;
    // Invariant: cands[..lo] beat everything after them and hold mass `acc`
    // short of the target; the nucleus ends within (lo, hi].
    let (mut lo, mut hi) = (0, cands.len());
    let mut acc = 0.0f64;
    while hi - lo > SMALL {
        let half = (hi - lo) / 2;
        let range = &mut cands[lo..hi];
        range.select_nth_unstable_by(half - 1, by_value_desc);
        let top: f64 = range[..half].iter().map(|c| f64::from(c.0)).sum();
        if acc + top >= target {
            hi = lo + half;
        } else {
            acc += top;
            lo += half;
        }
    }
    let tail = &mut cands[lo..hi];
    tail.sort_unstable_by(by_value_desc);
    let mut cum = acc;
    for (i, c) in tail.iter().enumerate() {
        cum += f64::from(c.0);
        if cum >= target {
            *mass = cum;
            return lo + i + 1;
        }
    }
    // Rounding kept the sum just under the target: keep the whole range.
    *mass = cum;
    hi
}

/// Draws one id from `cands` (weights summing to `total`) given a uniform
/// `u` in `[0, 1)`. `None` only if no candidate has positive weight.
fn draw(cands: &[Cand], total: f64, u: f64) -> Option<u32> {
    let r = u * total;
    let mut cum = 0.0f64;
    for &(w, id) in cands {
        cum += f64::from(w);
        if r < cum {
            return Some(id);
        }
    }
    // `r` rounded up to `total`: fall back to the last token with weight.
    cands.iter().rev().find(|c| c.0 > 0.0).map(|c| c.1)
}

/// Draws one id from per-id `weights` whose per-[`CHUNK`] sums are
/// `chunk_sums` (accumulating to `total`): skips whole chunks, then scans
/// inside one. `None` only if every weight is zero.
fn draw_chunked(weights: &[f32], chunk_sums: &[f64], total: f64, u: f64) -> Option<u32> {
    let r = u * total;
    let mut cum = 0.0f64;
    for (ci, (chunk, &s)) in weights.chunks(CHUNK).zip(chunk_sums).enumerate() {
        let next = cum + s;
        if r < next {
            let base = ci * CHUNK;
            let mut c = cum;
            for (j, &w) in chunk.iter().enumerate() {
                c += f64::from(w);
                if r < c {
                    return u32::try_from(base + j).ok();
                }
            }
            // Lane-order vs sequential rounding: last weighted id in chunk.
            let j = chunk.iter().rposition(|&w| w > 0.0)?;
            return u32::try_from(base + j).ok();
        }
        cum = next;
    }
    let j = weights.iter().rposition(|&w| w > 0.0)?;
    u32::try_from(j).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sampler(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> Sampler {
        Sampler::new(Sampling { temperature, top_k: top_k as u32, top_p, seed: Some(seed), ..Sampling::default() }).unwrap()
    }

    fn greedy() -> Sampler {
        Sampler::new(Sampling::default()).unwrap()
    }

    #[test]
    fn default_is_greedy_and_valid() {
        let p = Sampling::default();
        assert!(p.is_greedy());
        assert_eq!((p.top_k, p.top_p, p.seed), (0, 1.0, None));
        validate(&p).unwrap();
    }

    #[test]
    fn validate_rejects_bad_values_naming_field() {
        let bad_t = [-0.1, f32::NAN, f32::INFINITY, MAX_TEMPERATURE + 1.0];
        for t in bad_t {
            let p = Sampling { temperature: t, ..Default::default() };
            let err = validate(&p).unwrap_err();
            assert!(matches!(err, SamplingError::InvalidTemperature { .. }));
            assert!(err.to_string().contains("temperature"));
        }
        for top_p in [0.0, -0.5, 1.01, f32::NAN, f32::INFINITY] {
            let p = Sampling { top_p, ..Default::default() };
            let err = validate(&p).unwrap_err();
            assert!(matches!(err, SamplingError::InvalidTopP { .. }));
            assert!(err.to_string().contains("top_p"));
        }
        let err = Sampler::new(Sampling { temperature: 3.5, top_p: 2.0, ..Default::default() }).unwrap_err();
        assert_eq!(err, SamplingError::InvalidTopP { value: 2.0 });
        assert!(err.to_string().contains('2'));
        for t in [0.0, 0.5, 2.0, MAX_TEMPERATURE] {
            validate(&Sampling { temperature: t, top_p: 0.01, ..Default::default() }).unwrap();
        }
    }

    #[test]
    fn greedy_picks_argmax_and_lowest_id_on_ties() {
        let mut s = greedy();
        assert_eq!(s.sample(&[0.1, 3.0, -2.0, 2.9]).unwrap(), 1);
        assert_eq!(s.sample(&[1.0, 5.0, 2.0, 5.0, 5.0]).unwrap(), 1);
        assert_eq!(s.sample(&[7.0, 7.0]).unwrap(), 0);
        assert_eq!(s.sample(&[-1.0]).unwrap(), 0);
        assert_eq!(s.sample(&[-0.0, 0.0]).unwrap(), 0);
        // top_k = 1 agrees, signed zeros included.
        let mut k1 = sampler(1.0, 1, 1.0, 0);
        assert_eq!(k1.sample(&[-0.0, 0.0, -1.0]).unwrap(), 0);
        assert_eq!(k1.sample(&[1.0, 5.0, 2.0, 5.0, 5.0]).unwrap(), 1);
    }

    #[test]
    fn nan_and_inf_do_not_panic() {
        for mut s in [greedy(), sampler(1.0, 0, 1.0, 1), sampler(0.7, 2, 0.9, 1)] {
            assert_eq!(s.sample(&[f32::NAN, 1.0, f32::NAN]).unwrap(), 1);
            assert_eq!(s.sample(&[f32::NAN, f32::NEG_INFINITY, 0.5, f32::NAN]).unwrap(), 2);
            assert_eq!(s.sample(&[f32::NAN, f32::NAN]), Err(SamplingError::NoFiniteLogits));
            assert_eq!(s.sample(&[f32::NEG_INFINITY; 4]), Err(SamplingError::NoFiniteLogits));
            assert_eq!(s.sample(&[]), Err(SamplingError::EmptyLogits));
            // +inf takes all the mass.
            assert_eq!(s.sample(&[1.0, f32::INFINITY, f32::NAN, 3.0]).unwrap(), 1);
            // Extreme finite values do not overflow into NaN.
            assert_eq!(s.sample(&[f32::MIN, f32::MAX, f32::MIN]).unwrap(), 1);
        }
        // Several +inf share the mass equally.
        let mut s = sampler(1.0, 0, 1.0, 3);
        let mut seen = [0u32; 3];
        for _ in 0..200 {
            seen[s.sample(&[f32::INFINITY, 0.0, f32::INFINITY]).unwrap() as usize] += 1;
        }
        assert_eq!(seen[1], 0);
        assert!(seen[0] > 50 && seen[2] > 50, "{seen:?}");
    }

    #[test]
    fn tiny_temperature_does_not_produce_nan() {
        let mut s = sampler(f32::MIN_POSITIVE / 1024.0, 0, 1.0, 9);
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.0, 1.0, 0.999_999]).unwrap(), 1);
        }
    }

    fn draws(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<u32> {
        (0..n).map(|_| s.sample(logits).unwrap()).collect()
    }

    fn flat(n: usize) -> Vec<f32> {
        (0..n).map(|i| (i % 7) as f32 * 0.1).collect()
    }

    #[test]
    fn same_seed_same_sequence() {
        let logits = flat(1000);
        for (t, k, p) in [(1.0, 0, 1.0), (0.8, 50, 1.0), (1.3, 0, 0.9), (1.0, 200, 0.5)] {
            let a = draws(&mut sampler(t, k, p, 1234), &logits, 300);
            let b = draws(&mut sampler(t, k, p, 1234), &logits, 300);
            assert_eq!(a, b);
        }
    }

    #[test]
    fn different_seeds_differ() {
        let logits = vec![0.0f32; 100];
        let a = draws(&mut sampler(1.0, 0, 1.0, 1), &logits, 1000);
        let b = draws(&mut sampler(1.0, 0, 1.0, 2), &logits, 1000);
        let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
        // Independent uniform draws over 100 ids agree ~1% of the time.
        assert!(same < 40, "{same} of 1000 draws agree");
        // Unseeded samplers also differ from each other.
        let params = Sampling { temperature: 1.0, ..Default::default() };
        let c = draws(&mut Sampler::new(params.clone()).unwrap(), &logits, 1000);
        let d = draws(&mut Sampler::new(params).unwrap(), &logits, 1000);
        let same = c.iter().zip(&d).filter(|(x, y)| x == y).count();
        assert!(same < 40, "{same} of 1000 draws agree");
    }

    /// Pearson chi-square statistic of observed counts against probabilities.
    fn chi_square(counts: &[u64], probs: &[f64]) -> f64 {
        let n: u64 = counts.iter().sum();
        counts
            .iter()
            .zip(probs)
            .map(|(&c, &p)| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    fn softmax(logits: &[f32], t: f32) -> Vec<f64> {
        let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = logits.iter().map(|&l| ((f64::from(l) - f64::from(m)) / f64::from(t)).exp()).collect();
        let s: f64 = w.iter().sum();
        w.iter().map(|x| x / s).collect()
    }

    fn frequencies(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<u64> {
        let mut counts = vec![0u64; logits.len()];
        for _ in 0..n {
            counts[s.sample(logits).unwrap() as usize] += 1;
        }
        counts
    }

    #[test]
    fn frequencies_match_softmax() {
        let logits = [0.0f32, 1.0, 2.0];
        for t in [1.0f32, 0.5, 2.0] {
            let counts = frequencies(&mut sampler(t, 0, 1.0, 77), &logits, 30_000);
            let chi = chi_square(&counts, &softmax(&logits, t));
            // 2 degrees of freedom: P(chi² > 13.8) = 0.001.
            assert!(chi < 13.8, "t={t}: chi²={chi}, counts {counts:?}");
        }
    }

    #[test]
    fn frequencies_match_softmax_across_chunks() {
        // Mass on three ids in different chunks; the rest is negligible.
        let mut logits = vec![-200.0f32; 3 * CHUNK];
        let ids = [5usize, CHUNK + 188, 3 * CHUNK - 1];
        for (i, &id) in ids.iter().enumerate() {
            logits[id] = i as f32;
        }
        let probs = softmax(&[0.0, 1.0, 2.0], 1.0);
        for (k, p) in [(0, 1.0), (3, 1.0), (10, 0.9999), (0, 0.9999)] {
            let counts = frequencies(&mut sampler(1.0, k, p, 99), &logits, 30_000);
            let picked: Vec<u64> = ids.iter().map(|&i| counts[i]).collect();
            assert_eq!(picked.iter().sum::<u64>(), 30_000, "k={k} p={p}");
            let chi = chi_square(&picked, &probs);
            assert!(chi < 13.8, "k={k} p={p}: chi²={chi}, counts {picked:?}");
        }
    }

    #[test]
    fn top_k_restricts_and_renormalises() {
        let logits = [2.0f32, 0.0, 1.0, -1.0];
        let counts = frequencies(&mut sampler(1.0, 2, 1.0, 5), &logits, 20_000);
        assert_eq!((counts[1], counts[3]), (0, 0));
        let probs = softmax(&[2.0, 1.0], 1.0);
        let chi = chi_square(&[counts[0], counts[2]], &probs);
        assert!(chi < 10.8, "chi²={chi}, counts {counts:?}"); // 1 dof, p=0.001
    }

    #[test]
    fn top_p_keeps_smallest_nucleus() {
        // Probabilities 0.5, 0.3, 0.2 (in shuffled id order).
        let logits = [0.2f32.ln(), 0.5f32.ln(), 0.3f32.ln()];
        // 0.5 < 0.7 <= 0.8: keep ids 1 and 2, in ratio 5:3.
        let counts = frequencies(&mut sampler(1.0, 0, 0.7, 11), &logits, 20_000);
        assert_eq!(counts[0], 0);
        let chi = chi_square(&[counts[1], counts[2]], &[0.625, 0.375]);
        assert!(chi < 10.8, "chi²={chi}, counts {counts:?}");
        // top_p at exactly the first mass keeps only the first.
        let counts = frequencies(&mut sampler(1.0, 0, 0.5, 11), &logits, 1000);
        assert_eq!(counts, vec![0, 1000, 0]);
    }

    #[test]
    fn nucleus_search_grows_past_first_guess() {
        // Uniform over 5000 ids: top_p 0.5 needs 2500 of them, so the
        // partial-selection search has to grow several times.
        let logits = vec![0.0f32; 5000];
        let mut s = sampler(1.0, 0, 0.5, 8);
        let mut max_id = 0;
        for _ in 0..2000 {
            max_id = max_id.max(s.sample(&logits).unwrap());
        }
        // Ties resolve to lower ids, so the nucleus is ids 0..2500.
        assert!((2400..2500).contains(&max_id), "max id {max_id}");
    }

    /// Reference allowed set: full sort by raw logit for top-k, same weight
    /// function, full sort by weight for the nucleus. The argmax is always
    /// allowed (a nucleus of one returns it even if another id ties in weight).
    fn reference_allowed(logits: &[f32], t: f32, k: usize, p: f32) -> Vec<u32> {
        let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut c: Vec<Cand> = (0u32..).zip(logits).filter(|(_, l)| !l.is_nan()).map(|(id, &l)| (l, id)).collect();
        c.sort_by(by_value_desc);
        if k > 0 {
            c.truncate(k);
        }
        let mut c: Vec<Cand> = c.into_iter().map(|(l, id)| (weight(l, m, t), id)).filter(|c| c.0 > 0.0).collect();
        c.sort_by(by_value_desc);
        let total: f64 = c.iter().map(|c| f64::from(c.0)).sum();
        let target = f64::from(p) * total;
        let mut cum = 0.0;
        let mut out = vec![greedy().sample(logits).unwrap()];
        for &(w, id) in &c {
            out.push(id);
            cum += f64::from(w);
            if cum >= target {
                break;
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    #[test]
    fn exp_neg_is_accurate() {
        let mut worst = 0.0f64;
        let mut x = PRUNE_BELOW;
        while x <= 0.0 {
            let got = f64::from(exp_neg(x));
            let want = f64::from(x).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.000_731;
        }
        for x in [0.0f32, -0.0, -1e-30, -1e-7, -0.5, -1.0, PRUNE_BELOW] {
            let (got, want) = (f64::from(exp_neg(x)), f64::from(x).exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert_eq!(exp_neg(0.0), 1.0);
        assert!(worst < 3e-7, "max relative error {worst}");
        // Weights of NaN / -inf / negligible logits are exactly zero.
        assert_eq!(weight(f32::NAN, 1.0, 1.0), 0.0);
        assert_eq!(weight(f32::NEG_INFINITY, 1.0, 1.0), 0.0);
        assert_eq!(weight(-100.0, 1.0, 1.0), 0.0);
        assert_eq!(weight(f32::MIN, f32::MAX, 0.5), 0.0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn top_k_one_equals_greedy(
            logits in prop::collection::vec(-20.0f32..20.0, 1..300),
            t in 0.01f32..MAX_TEMPERATURE,
            seed: u64,
        ) {
            let expected = greedy().sample(&logits).unwrap();
            let mut s = sampler(t, 1, 1.0, seed);
            for _ in 0..4 {
                prop_assert_eq!(s.sample(&logits).unwrap(), expected);
            }
        }

        #[test]
        fn tiny_top_p_equals_greedy(
            // Few distinct values so that ties are common.
            logits in prop::collection::vec((-8i32..8).prop_map(|x| x as f32), 1..300),
            t in 0.01f32..10.0,
            seed: u64,
        ) {
            let expected = greedy().sample(&logits).unwrap();
            let mut s = sampler(t, 0, 1e-6, seed);
            for _ in 0..4 {
                prop_assert_eq!(s.sample(&logits).unwrap(), expected);
            }
        }

        #[test]
        fn top_k_selection_matches_sort(
            logits in prop::collection::vec(
                prop_oneof![(-4i32..4).prop_map(|x| x as f32), Just(f32::NAN),
                            Just(f32::NEG_INFINITY), -4.0f32..4.0], 1..2000),
            k in 1usize..700,
        ) {
            let mut got = Vec::new();
            top_k_into(&logits, k, &mut got);
            got.sort_by(by_value_desc);
            let mut want: Vec<Cand> = (0u32..)
                .zip(&logits)
                .filter(|(_, l)| **l > f32::NEG_INFINITY)
                .map(|(id, &l)| (l, id))
                .collect();
            want.sort_by(by_value_desc);
            want.truncate(k);
            prop_assert_eq!(got, want);
        }

        #[test]
        fn nucleus_matches_full_sort(
            weights in prop::collection::vec(
                prop_oneof![(1u8..6).prop_map(f32::from), 0.001f32..4.0], 1..800),
            p in 0.001f64..1.0,
        ) {
            let mut cands: Vec<Cand> = (0u32..).zip(&weights).map(|(id, &w)| (w, id)).collect();
            let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
            let target = p * total;
            let mut mass = 0.0;
            let n = nucleus_len(&mut cands, target, &mut mass);
            let mut got: Vec<u32> = cands[..n].iter().map(|c| c.1).collect();
            got.sort_unstable();

            let mut sorted: Vec<Cand> = (0u32..).zip(&weights).map(|(id, &w)| (w, id)).collect();
            sorted.sort_by(by_value_desc);
            let mut cum = 0.0;
            let mut want = Vec::new();
            for &(w, id) in &sorted {
                want.push(id);
                cum += f64::from(w);
                if cum >= target {
                    break;
                }
            }
            want.sort_unstable();
            prop_assert_eq!(got, want);
            prop_assert!((mass - cum).abs() <= 1e-9 * total);
        }

        #[test]
        fn samples_lie_in_reference_nucleus(
            logits in prop::collection::vec(
                prop_oneof![-5.0f32..5.0, (-3i32..3).prop_map(|x| x as f32)], 1..1500),
            t in 0.1f32..3.0,
            k in prop_oneof![Just(0usize), 1usize..400],
            p in prop_oneof![Just(1.0f32), 0.01f32..1.0],
            seed: u64,
        ) {
            let allowed = reference_allowed(&logits, t, k, p);
            let mut s = sampler(t, k, p, seed);
            for _ in 0..8 {
                let id = s.sample(&logits).unwrap();
                prop_assert!(allowed.binary_search(&id).is_ok(), "id {} not in nucleus", id);
            }
        }
    }
}
