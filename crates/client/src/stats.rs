//! Percentiles and summaries of latency samples, and the two-sample Kolmogorov–Smirnov
//! test that tells whether two sets of latencies come from one distribution.

use serde::Serialize;

/// The `p`-th percentile (`0..=100`) of `sorted` (ascending), interpolating linearly
/// between the two nearest ranks (numpy's default). `None` for no samples.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    debug_assert!(sorted.windows(2).all(|w| w[0] <= w[1]), "percentile needs ascending samples");
    let last = sorted.len().checked_sub(1)?;
    let rank = p.clamp(0.0, 100.0) / 100.0 * last as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64))
}

/// Count, mean and percentiles of a set of samples (milliseconds, by convention here).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    /// Number of samples.
    pub count: usize,
    /// Arithmetic mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest sample.
    pub max: f64,
}

impl Summary {
    /// Summarise `samples` (any order; NaNs dropped). `None` for no samples.
    pub fn of(samples: &[f64]) -> Option<Summary> {
        let mut s: Vec<f64> = samples.iter().copied().filter(|x| !x.is_nan()).collect();
        s.sort_by(f64::total_cmp);
        let max = *s.last()?;
        Some(Summary {
            count: s.len(),
            mean: s.iter().sum::<f64>() / s.len() as f64,
            p50: percentile(&s, 50.0)?,
            p90: percentile(&s, 90.0)?,
            p99: percentile(&s, 99.0)?,
            max,
        })
    }
}

/// The result of a two-sample Kolmogorov–Smirnov test.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct KsTest {
    /// The statistic: the largest distance between the two empirical distribution
    /// functions, in `[0, 1]`.
    pub d: f64,
    /// The asymptotic probability of a `d` at least this large when both samples come from
    /// one continuous distribution, in `[0, 1]`.
    pub p_value: f64,
}

/// The two-sample Kolmogorov–Smirnov test of `a` against `b` (any order; NaNs dropped), as
/// Numerical Recipes' `ks2`: `D = sup |F_a(x) - F_b(x)|`, and the p-value
/// `Q_KS((sqrt(n_e) + 0.12 + 0.11 / sqrt(n_e)) * D)` with `n_e = n m / (n + m)`. Ties (also
/// across the samples) step both distribution functions at once. `None` when either sample
/// is empty.
pub fn ks_two_sample(a: &[f64], b: &[f64]) -> Option<KsTest> {
    let sorted = |x: &[f64]| {
        let mut s: Vec<f64> = x.iter().copied().filter(|v| !v.is_nan()).collect();
        s.sort_by(f64::total_cmp);
        s
    };
    let (a, b) = (sorted(a), sorted(b));
    if a.is_empty() || b.is_empty() {
        return None;
    }
    let (n, m) = (a.len() as f64, b.len() as f64);
    let (mut i, mut j, mut d) = (0, 0, 0.0f64);
    while i < a.len() && j < b.len() {
        // Step past every copy of the smaller value (of both samples on a tie), so the two
        // distribution functions are compared only between distinct values.
        let x = a[i].min(b[j]);
        while i < a.len() && a[i] == x {
            i += 1;
        }
        while j < b.len() && b[j] == x {
            j += 1;
        }
        d = d.max((i as f64 / n - j as f64 / m).abs());
    }
    let ne = (n * m / (n + m)).sqrt();
    Some(KsTest { d, p_value: q_ks((ne + 0.12 + 0.11 / ne) * d) })
}

/// The Kolmogorov distribution's tail `Q_KS(λ) = 2 Σ_{j≥1} (−1)^{j−1} e^{−2 j² λ²}`:
/// 1 at `λ = 0`, falling to 0. The series is summed until a term is negligible against the
/// previous one or the sum (Numerical Recipes' `probks`); where it does not converge
/// (`λ` near 0) the answer is 1.
pub fn q_ks(lambda: f64) -> f64 {
    const EPS_TERM: f64 = 1e-3;
    const EPS_SUM: f64 = 1e-8;
    let a2 = -2.0 * lambda * lambda;
    let (mut sign, mut sum, mut previous) = (2.0, 0.0, 0.0);
    for j in 1..=100 {
        let jf = f64::from(j);
        let term = sign * (a2 * jf * jf).exp();
        sum += term;
        if term.abs() <= EPS_TERM * previous || term.abs() <= EPS_SUM * sum {
            return sum.clamp(0.0, 1.0);
        }
        sign = -sign;
        previous = term.abs();
    }
    1.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_ranks_like_numpy() {
        let s = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&s, 0.0), Some(1.0));
        assert_eq!(percentile(&s, 100.0), Some(4.0));
        assert_eq!(percentile(&s, 50.0), Some(2.5));
        // numpy.percentile([1,2,3,4], 90) == 3.7; 99 -> 3.97
        assert!((percentile(&s, 90.0).unwrap() - 3.7).abs() < 1e-12);
        assert!((percentile(&s, 99.0).unwrap() - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&[5.0], 99.0), Some(5.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn percentiles_of_1_to_100_are_close_to_their_rank() {
        let s: Vec<f64> = (1..=100).map(f64::from).collect();
        // rank = p/100 * 99, value = rank + 1
        assert!((percentile(&s, 50.0).unwrap() - 50.5).abs() < 1e-12);
        assert!((percentile(&s, 99.0).unwrap() - 99.01).abs() < 1e-12);
    }

    #[test]
    fn a_summary_sorts_its_input_and_drops_nans() {
        let s = Summary::of(&[3.0, f64::NAN, 1.0, 2.0]).unwrap();
        assert_eq!((s.count, s.mean, s.p50, s.max), (3, 2.0, 2.0, 3.0));
        assert!(Summary::of(&[]).is_none());
        assert!(Summary::of(&[f64::NAN]).is_none());
    }

    #[test]
    fn identical_samples_have_d_zero_and_p_one() {
        let a = [3.0, 1.0, 2.0, 5.0, 4.0];
        let t = ks_two_sample(&a, &a).unwrap();
        assert_eq!((t.d, t.p_value), (0.0, 1.0));
        assert_eq!(q_ks(0.0), 1.0);
        assert!(ks_two_sample(&a, &[]).is_none() && ks_two_sample(&[f64::NAN], &a).is_none());
    }

    #[test]
    fn fully_separated_samples_have_d_one_and_a_tiny_p() {
        let a: Vec<f64> = (0..50).map(f64::from).collect();
        let b: Vec<f64> = (100..150).map(f64::from).collect();
        let t = ks_two_sample(&a, &b).unwrap();
        assert_eq!(t.d, 1.0);
        // n_e = 25, λ = 5 + 0.12 + 0.022 = 5.142, Q = 2 e^{-2 λ²} ≈ 2.2e-23.
        assert!(t.p_value > 0.0 && t.p_value < 1e-20, "{t:?}");
        assert_eq!(ks_two_sample(&b, &a), Some(t), "symmetric");
    }

    #[test]
    fn a_small_example_matches_the_hand_computation() {
        // F_a steps at 1,2,3,4 and F_b at 3,4,5,6 (quarters). At x = 2: F_a = 2/4, F_b = 0;
        // at 3: 3/4 vs 1/4; at 4: 1 vs 2/4 — D = 1/2. n_e = 4·4/8 = 2,
        // λ = (√2 + 0.12 + 0.11/√2) · 0.5 = 0.805998,
        // Q = 2 (e^{-2λ²} − e^{-8λ²} + e^{-18λ²} − …) = 2 (0.272732 − 0.005533 + 0.000008) = 0.534416.
        let t = ks_two_sample(&[4.0, 3.0, 2.0, 1.0], &[3.0, 4.0, 5.0, 6.0]).unwrap();
        assert_eq!(t.d, 0.5);
        assert!((t.p_value - 0.534416).abs() < 1e-5, "{t:?}");
        // Ties across the samples step both functions together: at 1, 2/3 vs 1/3; at 2, 1 vs 1.
        let t = ks_two_sample(&[1.0, 1.0, 2.0], &[1.0, 2.0, 2.0]).unwrap();
        assert!((t.d - 1.0 / 3.0).abs() < 1e-12, "{t:?}");
        // n_e = 1.5, λ = 0.478186: Q = 0.976213.
        assert!((t.p_value - 0.976213).abs() < 1e-5, "{t:?}");
    }
}
