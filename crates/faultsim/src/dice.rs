//! [`Dice`]: every random choice of a schedule, drawn from one seeded generator.

use bulkhead_engine::Rng;

/// The schedule's only source of randomness: a seed determines every draw, in order.
#[derive(Debug, Clone)]
pub struct Dice(Rng);

impl Dice {
    /// Dice whose every draw follows from `seed`.
    pub fn new(seed: u64) -> Self {
        Dice(Rng::seed_from_u64(seed))
    }

    /// Uniform in `0..n` (0 when `n` is 0). The modulo bias is below 2^-40 for the small
    /// `n` a schedule uses, and it is deterministic, which is what matters here.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.0.next_u64() % n }
    }

    /// Uniform in `lo..=hi` (`lo` when `hi < lo`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo).saturating_add(1))
    }

    /// True with probability `per_mille / 1000`.
    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }

    /// One element, uniformly; `None` if `items` is empty.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        items.get(self.below(items.len() as u64) as usize)
    }

    /// 64 random bits.
    pub fn bits(&mut self) -> u64 {
        self.0.next_u64()
    }
}
