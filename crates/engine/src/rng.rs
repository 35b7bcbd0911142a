//! A small, fast, seeded pseudo-random number generator.
//!
//! [`Rng`] is xoshiro256\*\* (Blackman & Vigna, 2018): 256 bits of state,
//! period 2^256 − 1, excellent statistical quality, and a few nanoseconds per
//! draw. It is **not** cryptographically secure; it only drives sampling.
//!
//! The 256-bit state is expanded from a single `u64` seed with SplitMix64, as
//! the xoshiro authors recommend, so every `u64` seed (including 0) gives a
//! valid, well-mixed, non-zero state. The output sequence for a given seed is
//! fixed by this implementation and is stable across platforms.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// One step of SplitMix64: advances `state` and returns the next output.
///
/// Used to expand seeds; its output function is a bijection, so consecutive
/// outputs from one state are distinct and never all zero.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xoshiro256\*\* pseudo-random number generator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// Creates a generator whose whole output sequence is determined by `seed`.
    pub fn seed_from_u64(seed: u64) -> Self {
        let mut sm = seed;
        let s = [splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm)];
        Self { s }
    }

    /// Creates a generator from a fresh, non-reproducible seed; see
    /// [`entropy_seed`].
    pub fn from_entropy() -> Self {
        Self::seed_from_u64(entropy_seed())
    }

    /// Returns the next 64 uniformly distributed bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Returns a uniformly distributed `f64` in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        // 2^-53
        const SCALE: f64 = 1.0 / (1u64 << 53) as f64;
        (self.next_u64() >> 11) as f64 * SCALE
    }
}

/// Process-wide counter so that generators created in the same clock tick
/// still get distinct seeds.
static SEED_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Returns a seed that differs between calls and between processes.
///
/// It mixes a process-wide atomic counter (distinct for every call in this
/// process), the wall-clock time in nanoseconds and the process id through
/// SplitMix64. Not reproducible and not cryptographic: pass an explicit seed
/// when reproducibility is needed.
pub fn entropy_seed() -> u64 {
    let count = SEED_COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let mut state = nanos ^ (u64::from(std::process::id()) << 32);
    let a = splitmix64(&mut state);
    let mut state = a ^ count.wrapping_mul(0xD1B5_4A32_D192_ED03);
    splitmix64(&mut state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_values() {
        // Reference outputs of SplitMix64 seeded with 1234567.
        let mut s = 1_234_567u64;
        assert_eq!(splitmix64(&mut s), 6_457_827_717_110_365_317);
        assert_eq!(splitmix64(&mut s), 3_203_168_211_198_807_973);
    }

    #[test]
    fn same_seed_same_stream() {
        let mut a = Rng::seed_from_u64(42);
        let mut b = Rng::seed_from_u64(42);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
    }

    #[test]
    fn zero_seed_is_usable_and_seeds_differ() {
        let mut a = Rng::seed_from_u64(0);
        let mut b = Rng::seed_from_u64(1);
        let xs: Vec<u64> = (0..8).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..8).map(|_| b.next_u64()).collect();
        assert!(xs.iter().any(|&x| x != 0));
        assert_ne!(xs, ys);
    }

    #[test]
    fn f64_in_unit_interval_with_plausible_mean() {
        let mut r = Rng::seed_from_u64(7);
        let n = 100_000;
        let mut sum = 0.0;
        for _ in 0..n {
            let x = r.next_f64();
            assert!((0.0..1.0).contains(&x));
            sum += x;
        }
        let mean = sum / f64::from(n);
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
    }

    #[test]
    fn entropy_seeds_differ() {
        let a = entropy_seed();
        let b = entropy_seed();
        assert_ne!(a, b);
    }
}
