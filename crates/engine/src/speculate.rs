//! Speculative decoding's proposals: n-gram prompt lookup, and when to propose at all.
//!
//! A decode step at small batch reads every weight to compute a handful of rows; feeding a
//! sequence's likely next tokens beside its last one costs little more and, where they are
//! right, emits several tokens for one read of the weights. The guesses come from the
//! sequence itself (its prompt and what it generated): where its last few tokens occurred
//! before, what followed them then is proposed now. Copying tasks (edits, quotes, code
//! refactors, later turns that repeat earlier ones) are where this pays. Verification and
//! the roll-back of rejected drafts are the driver core's
//! ([`bulkhead_protocol::driver::decode::Verification`]).

use std::sync::atomic::{AtomicU64, Ordering};

/// Longest suffix looked up; longer matches are tried first.
const MAX_NGRAM: usize = 4;
/// Shortest suffix looked up: a single token repeats too often to predict what follows.
const MIN_NGRAM: usize = 2;
/// Most positions searched back for a match, so that a step's proposals cost microseconds
/// even at long contexts.
const LOOKBACK: usize = 16_384;

/// Most drafts a step may feed per sequence (`--speculative-tokens`).
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

/// Whether and how the decode loop speculates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Speculation {
    /// One token per sequence per step.
    Off,
    /// N-gram prompt lookup, up to `tokens` drafts per sequence per step.
    Ngram {
        /// Most drafts per step (1..=[`MAX_SPECULATIVE_TOKENS`]).
        tokens: usize,
    },
}

impl Speculation {
    /// Most drafts per sequence per step (0 when off).
    pub fn tokens(self) -> usize {
        match self {
            Speculation::Off => 0,
            Speculation::Ngram { tokens } => tokens.min(MAX_SPECULATIVE_TOKENS),
        }
    }
}

/// Proposals stop for the whole step once this many sequences decode: past it a step is
/// no longer bound by reading the weights, and drafted rows cost compute the batch needs
/// (measured: BENCHMARKS.md, speculative decoding).
pub const MAX_SPECULATIVE_BATCH: usize = 4;

/// Up to `k` tokens that followed the latest earlier occurrence of `context`'s last
/// `MAX_NGRAM`..=`MIN_NGRAM` tokens (longest first), into `out` (cleared first).
pub fn propose(context: &[u32], k: usize, out: &mut Vec<u32>) {
    out.clear();
    let len = context.len();
    if k == 0 {
        return;
    }
    for n in (MIN_NGRAM..=MAX_NGRAM.min(len.saturating_sub(1))).rev() {
        let suffix = &context[len - n..];
        // Latest start first: recent text predicts best. A match must end before the
        // suffix starts, so that something follows it.
        let earliest = (len - n).saturating_sub(LOOKBACK);
        if let Some(start) = (earliest..len - n).rev().find(|&i| &context[i..i + n] == suffix) {
            let from = start + n;
            out.extend_from_slice(&context[from..(from + k).min(len)]);
            return;
        }
    }
}

/// A sequence's recent luck with proposals, which sets how many drafts it feeds: after a
/// verification that accepted every draft, twice as many (up to the limit); after one that
/// stopped early, one more than it accepted. After drafts that were all rejected twice in a
/// row it stops proposing for a while (doubling, at most [`MAX_BACKOFF`] steps), so that
/// free-form text, where lookups rarely match, pays almost nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct Luck {
    misses: u32,
    wait: u32,
    /// Drafts to feed next (0: not set yet, the limit).
    len: usize,
}

/// Longest pause in proposals after misses, in steps.
const MAX_BACKOFF: u32 = 32;

impl Luck {
    /// How many drafts to propose this step, at most `max` (0 during a pause, which it
    /// counts down).
    pub fn drafts(&mut self, max: usize) -> usize {
        if self.wait > 0 {
            self.wait -= 1;
            return 0;
        }
        if self.len == 0 { max } else { self.len.min(max) }
    }

    /// A verification accepted `accepted` of `drafted` drafts.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.len = if accepted >= drafted { drafted.saturating_mul(2) } else { accepted + 1 };
        if accepted > 0 {
            self.misses = 0;
            return;
        }
        self.misses += 1;
        if self.misses >= 2 {
            self.wait = (1u32 << (self.misses - 1).min(5)).min(MAX_BACKOFF);
        }
    }
}

/// Accepted drafts per verification: the histogram's bucket bounds.
pub const ACCEPTED_BOUNDS: [f64; 6] = [0.0, 1.0, 2.0, 4.0, 8.0, 16.0];

/// What speculation did, for the metrics: counters shared with the worker that pushes them.
#[derive(Debug, Default)]
pub struct SpecCounters {
    /// Drafts fed to verification.
    drafted: AtomicU64,
    /// Drafts accepted (emitted as the step's picks).
    accepted: AtomicU64,
    /// Verifications by accepted drafts, per bucket of [`ACCEPTED_BOUNDS`] (not
    /// cumulative; the last is past the last bound).
    by_accepted: [AtomicU64; ACCEPTED_BOUNDS.len() + 1],
}

impl SpecCounters {
    pub(crate) fn record(&self, drafted: usize, accepted: usize) {
        self.drafted.fetch_add(drafted as u64, Ordering::Relaxed);
        self.accepted.fetch_add(accepted as u64, Ordering::Relaxed);
        let bucket = ACCEPTED_BOUNDS.partition_point(|b| *b < accepted as f64);
        self.by_accepted[bucket].fetch_add(1, Ordering::Relaxed);
    }

    /// (drafted, accepted, verifications) so far.
    pub fn totals(&self) -> (u64, u64, u64) {
        let verifications = self.by_accepted.iter().map(|n| n.load(Ordering::Relaxed)).sum();
        (self.drafted.load(Ordering::Relaxed), self.accepted.load(Ordering::Relaxed), verifications)
    }

    /// Verifications per bucket of [`ACCEPTED_BOUNDS`], not cumulative.
    pub fn by_accepted(&self) -> [u64; ACCEPTED_BOUNDS.len() + 1] {
        std::array::from_fn(|i| self.by_accepted[i].load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proposed(context: &[u32], k: usize) -> Vec<u32> {
        let mut out = vec![99];
        propose(context, k, &mut out);
        out
    }

    #[test]
    fn the_latest_longest_match_proposes_what_followed_it() {
        // "2 3" occurred twice before the end: the later one's continuation is proposed.
        assert_eq!(proposed(&[1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 2, 3], 3), vec![7, 8, 6]);
        // The four-token suffix "9 1 2 3" beats the later "2 3".
        assert_eq!(proposed(&[9, 1, 2, 3, 4, 5, 0, 2, 3, 6, 9, 1, 2, 3], 2), vec![4, 5]);
        // Fewer than k tokens follow: only those.
        assert_eq!(proposed(&[5, 6, 7, 5, 6], 4), vec![7, 5, 6]);
    }

    #[test]
    fn nothing_is_proposed_without_a_match_of_two_tokens() {
        assert_eq!(proposed(&[1, 2, 3, 4], 4), Vec::<u32>::new());
        assert_eq!(proposed(&[1, 2, 1], 4), Vec::<u32>::new());
        assert_eq!(proposed(&[], 4), Vec::<u32>::new());
        assert_eq!(proposed(&[1, 2, 1, 2], 0), Vec::<u32>::new());
    }

    #[test]
    fn misses_pause_proposals_longer_each_time_and_a_hit_resumes_them() {
        let mut l = Luck::default();
        assert_eq!(l.drafts(4), 4);
        l.record(4, 0);
        assert_eq!(l.drafts(4), 1);
        l.record(1, 0);
        assert_eq!((0..3).map(|_| l.drafts(4)).collect::<Vec<_>>(), [0, 0, 1]);
        l.record(1, 0);
        assert_eq!((0..5).filter(|_| l.drafts(4) == 0).count(), 4);
        l.record(1, 1);
        l.record(2, 0);
        assert_eq!(l.drafts(4), 1);
    }

    #[test]
    fn drafts_double_while_all_are_accepted_and_fall_to_what_was() {
        let mut l = Luck::default();
        l.record(4, 1);
        assert_eq!(l.drafts(4), 2);
        l.record(2, 2);
        assert_eq!(l.drafts(4), 4);
        l.record(4, 4);
        assert_eq!(l.drafts(4), 4, "never past the limit");
        assert_eq!(l.drafts(16), 8);
    }
}
