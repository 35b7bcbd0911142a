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
    /// A draft model ([`crate::draft::DraftModel`], given with
    /// [`crate::Engine::set_draft_model`]) drafts greedily, up to `tokens` per sequence per
    /// step.
    Draft {
        /// Most drafts per step (1..=[`MAX_SPECULATIVE_TOKENS`]).
        tokens: usize,
    },
}

impl Speculation {
    /// Most drafts per sequence per step (0 when off).
    pub fn tokens(self) -> usize {
        match self {
            Speculation::Off => 0,
            Speculation::Ngram { tokens } | Speculation::Draft { tokens } => tokens.min(MAX_SPECULATIVE_TOKENS),
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

/// A sequence's recent luck with proposals: an estimate of the chance that its next draft
/// is accepted, given the one before was (a decaying count of accepted drafts over drafts
/// that had their chance: every accepted one, and the first rejected one of a step).
#[derive(Clone, Copy, Debug)]
pub struct Luck {
    accepted: f64,
    tried: f64,
    /// Steps left in a pause of proposals.
    wait: u32,
    /// Pauses in a row (each twice as long as the last, at most [`MAX_BACKOFF`] steps).
    pauses: u32,
}

/// Longest pause in proposals, in steps.
const MAX_BACKOFF: u32 = 32;
/// Weight of the past in the acceptance estimate, per verification.
const DECAY: f64 = 0.8;

impl Default for Luck {
    /// A prior of 0.6 worth two drafts: enough to try two drafts at batch 1.
    fn default() -> Self {
        Luck { accepted: 1.2, tried: 2.0, wait: 0, pauses: 0 }
    }
}

impl Luck {
    /// The estimated chance that a draft is accepted once the ones before it were.
    pub fn acceptance(&self) -> f64 {
        self.accepted / self.tried
    }

    /// How many drafts to feed this step, at most `max`, when `k` drafted rows cost
    /// `cost(k)` each, in tokens of the sequence's share of a step: draft `j` is expected to
    /// add `p^j` tokens, and the count with the largest expected gain over its cost wins.
    /// Where none gains, one draft is fed as a probe and proposals pause (2, 4, … 32
    /// steps), so the estimate can recover without making every step pay.
    pub fn drafts(&mut self, max: usize, cost: impl Fn(usize) -> f64) -> usize {
        if self.wait > 0 {
            self.wait -= 1;
            return 0;
        }
        let p = self.acceptance();
        let (mut best, mut best_gain, mut tokens, mut pj) = (0, 0.0, 0.0, 1.0);
        for k in 1..=max {
            pj *= p;
            tokens += pj;
            let gain = tokens - k as f64 * cost(k);
            if gain > best_gain {
                (best, best_gain) = (k, gain);
            }
        }
        if best == 0 && max > 0 {
            self.pauses += 1;
            self.wait = (1u32 << self.pauses.min(5)).min(MAX_BACKOFF);
            return 1;
        }
        self.pauses = 0;
        best
    }

    /// A verification accepted `accepted` of `drafted` drafts.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        let tried = accepted + usize::from(accepted < drafted);
        self.accepted = DECAY * self.accepted + accepted as f64;
        self.tried = DECAY * self.tried + tried as f64;
        // A probe that hit ends its pause.
        if accepted > 0 {
            self.wait = 0;
        }
    }
}

/// What drafted rows cost, learnt from the steps themselves: the seconds of a step with
/// one row per sequence, by how many sequences decode, and the seconds `d` drafted rows in
/// all add to it. The first extra row costs more than the next ones where a one-row step
/// has a faster path (batch 1), hence a figure per count. Only steps that decode and
/// prefill nothing are counted.
#[derive(Clone, Debug)]
pub struct StepCost {
    base: [f64; MAX_SPECULATIVE_BATCH + 1],
    extra: [[f64; MAX_SPECULATIVE_TOKENS + 1]; MAX_SPECULATIVE_BATCH + 1],
    /// Seconds of one round of a draft model, by how many sequences decode.
    draft: [f64; MAX_SPECULATIVE_BATCH + 1],
}

/// Weight of the past in the step-cost estimates.
const COST_DECAY: f64 = 0.9;
/// A drafted row's cost against a one-row step's, before any step measured it (about what
/// SmolLM2 shows on two Zen 4 cores, where a model this small is far from the memory wall;
/// larger models cost less per row).
const DEFAULT_ROW_COST: f64 = 0.3;

impl Default for StepCost {
    fn default() -> Self {
        StepCost {
            base: [0.0; MAX_SPECULATIVE_BATCH + 1],
            extra: [[0.0; MAX_SPECULATIVE_TOKENS + 1]; MAX_SPECULATIVE_BATCH + 1],
            draft: [0.0; MAX_SPECULATIVE_BATCH + 1],
        }
    }
}

impl StepCost {
    /// A decode-only step of `batch` sequences feeding `drafted` drafts in all took
    /// `seconds`.
    pub fn observe(&mut self, batch: usize, drafted: usize, seconds: f64) {
        let ewma = |old: f64, new: f64| if old == 0.0 { new } else { COST_DECAY * old + (1.0 - COST_DECAY) * new };
        let Some(&base) = self.base.get(batch) else { return };
        if drafted == 0 {
            self.base[batch] = ewma(base, seconds);
        } else if base > 0.0 {
            let e = &mut self.extra[batch][drafted.min(MAX_SPECULATIVE_TOKENS)];
            *e = ewma(*e, (seconds - base).max(1e-9));
        }
    }

    /// A draft model's proposal at `batch` ran `rounds` forward calls in `seconds`.
    pub fn observe_draft(&mut self, batch: usize, rounds: usize, seconds: f64) {
        if let Some(d) = self.draft.get_mut(batch)
            && rounds > 0
        {
            let round = seconds / rounds as f64;
            *d = if *d == 0.0 { round } else { COST_DECAY * *d + (1.0 - COST_DECAY) * round };
        }
    }

    /// Each of `k` drafted rows' cost at `batch`, in tokens of a sequence's share of a step:
    /// the row in the step, and with a draft model the round that drafted it (shared by the
    /// sequences that draft, about one step's share each).
    pub fn row_cost(&self, batch: usize, k: usize) -> f64 {
        let default = DEFAULT_ROW_COST * batch as f64;
        let (Some(&base), Some(extra)) = (self.base.get(batch), self.extra.get(batch)) else { return default };
        let row = match extra.get(k.min(MAX_SPECULATIVE_TOKENS)) {
            Some(&e) if base > 0.0 && e > 0.0 => e / k as f64 * batch as f64 / base,
            _ => default,
        };
        let draft = self.draft.get(batch).copied().unwrap_or(0.0);
        if base > 0.0 { row + draft / base } else { row }
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
    fn drafts_are_fed_while_their_expected_yield_beats_their_cost() {
        let mut l = Luck::default();
        // p = 0.6: 0.6 and 0.36 beat 0.3, 0.216 does not.
        assert_eq!(l.drafts(4, |_| 0.3), 2);
        assert_eq!(l.drafts(1, |_| 0.3), 1, "never past the limit");
        for _ in 0..10 {
            l.record(4, 4);
        }
        assert!(l.acceptance() > 0.95);
        assert_eq!(l.drafts(4, |_| 0.3), 4);
        // A first row dearer than the next ones: four drafts pay where one would not.
        assert_eq!(l.drafts(4, |k| if k == 1 { 1.2 } else { 0.4 }), 4);
        assert_eq!(l.drafts(4, |_| 1.0), 1, "a probe where nothing pays");
    }

    #[test]
    fn where_nothing_pays_one_probe_then_longer_pauses() {
        let mut l = Luck::default();
        for _ in 0..10 {
            l.record(2, 0);
        }
        assert_eq!(l.drafts(4, |_| 0.3), 1);
        assert_eq!((0..3).map(|_| l.drafts(4, |_| 0.3)).collect::<Vec<_>>(), [0, 0, 1]);
        assert_eq!((0..5).filter(|_| l.drafts(4, |_| 0.3) == 0).count(), 4);
        for _ in 0..10 {
            l.record(1, 1);
        }
        assert!(l.drafts(4, |_| 0.3) >= 2, "accepted probes bring drafts back");
    }

    #[test]
    fn a_drafted_row_costs_what_the_steps_showed() {
        let mut c = StepCost::default();
        assert_eq!(c.row_cost(2, 1), 0.6, "the default before any step");
        c.observe(1, 0, 0.005);
        c.observe(1, 4, 0.010);
        c.observe(1, 1, 0.008);
        assert!((c.row_cost(1, 4) - 0.25).abs() < 1e-9, "{}", c.row_cost(1, 4));
        assert!((c.row_cost(1, 1) - 0.6).abs() < 1e-9, "{}", c.row_cost(1, 1));
        assert_eq!(c.row_cost(1, 2), 0.3, "not measured: the default");
        c.observe(4, 0, 0.008);
        c.observe(4, 2, 0.0105);
        assert!((c.row_cost(4, 2) - 0.625).abs() < 1e-9, "{}", c.row_cost(4, 2));
        c.observe(9, 0, 1.0);
        // A draft model's round adds its share of a step to every drafted row.
        c.observe_draft(4, 2, 0.004);
        assert!((c.row_cost(4, 2) - 0.875).abs() < 1e-9, "{}", c.row_cost(4, 2));
    }
}
