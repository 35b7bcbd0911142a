//! Percentiles and summaries of latency samples.

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
}
