//! Stop-string matching over incrementally decoded text.
//!
//! [`StopMatcher`] sits between the detokeniser and the client stream. Text
//! that cannot be the start of a stop string is released immediately; a
//! trailing piece that could still grow into a stop string is held back
//! until it either completes a match (generation stops, the stop string is
//! never emitted) or diverges (it is released).
//!
//! # Match rule
//!
//! Generation stops at the match that *completes first* in the text stream
//! (earliest end position); when several stop strings end at the same
//! position, the longest one (earliest start) wins. This rule depends only on
//! the concatenated text, never on how it was split into pushes, and it stops
//! as soon as any stop string is complete.
//! All cuts are at `char` boundaries.

/// Result of [`StopMatcher::push`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text that may be sent to the client now.
    pub emit: String,
    /// A stop string matched; `emit` ends right before it and generation
    /// should end. Later pushes emit nothing.
    pub stopped: bool,
}

/// Incremental stop-string matcher for one sequence.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Length in bytes of the longest stop string.
    max_len: usize,
    /// Text received but not yet emitted: always a proper prefix of some
    /// stop string between calls, and never contains a complete stop string.
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// Creates a matcher for `stops`; empty strings are ignored, duplicates
    /// are harmless. With no stop strings every push is emitted unchanged.
    pub fn new(stops: Vec<String>) -> Self {
        let mut stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        stops.sort();
        stops.dedup();
        let max_len = stops.iter().map(String::len).max().unwrap_or(0);
        Self { stops, max_len, held: String::new(), stopped: false }
    }

    /// Whether a stop string has matched.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// The text currently held back as a possible stop-string prefix.
    pub fn held(&self) -> &str {
        &self.held
    }

    /// Feeds newly decoded text and returns what may be emitted now.
    ///
    /// Text that cannot be the start of a stop string is released; a trailing
    /// possible prefix of a stop string is held back. On a match, `stopped`
    /// is set and `emit` ends right before the stop string, which is never
    /// emitted; everything after it (and any later push) is discarded.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.stopped {
            return StopOutcome { emit: String::new(), stopped: true };
        }
        if self.stops.is_empty() {
            return StopOutcome { emit: text.to_owned(), stopped: false };
        }
        self.held.push_str(text);

        if let Some(start) = self.first_match() {
            self.held.truncate(start);
            self.stopped = true;
            return StopOutcome { emit: std::mem::take(&mut self.held), stopped: true };
        }

        let cut = self.hold_from();
        let rest = self.held.split_off(cut);
        let emit = std::mem::replace(&mut self.held, rest);
        StopOutcome { emit, stopped: false }
    }

    /// Ends the stream: returns whatever was held back (empty after a stop).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Start of the match completing first in `held` (earliest end, then
    /// longest), if any.
    fn first_match(&self) -> Option<usize> {
        self.stops.iter().filter_map(|s| self.held.find(s.as_str()).map(|pos| (pos + s.len(), pos))).min().map(|(_, start)| start)
    }

    /// Smallest char boundary `i` such that `held[i..]` is a prefix of some
    /// stop string (`held.len()` when there is none). Assumes `held` holds no
    /// complete stop string, so any future match starts at or after `i`.
    fn hold_from(&self) -> usize {
        let len = self.held.len();
        let earliest = len.saturating_sub(self.max_len.saturating_sub(1));
        (earliest..len)
            .filter(|&i| self.held.is_char_boundary(i))
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn m(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(stops.iter().map(|s| s.to_string()).collect())
    }

    fn out(emit: &str, stopped: bool) -> StopOutcome {
        StopOutcome { emit: emit.to_string(), stopped }
    }

    #[test]
    fn no_stops_passes_through() {
        let mut s = m(&["", ""]);
        assert_eq!(s.push("hello"), out("hello", false));
        assert_eq!(s.finish(), "");
    }

    #[test]
    fn holds_prefix_and_releases_on_divergence() {
        let mut s = m(&["</s>"]);
        assert_eq!(s.push("abc<"), out("abc", false));
        assert_eq!(s.held(), "<");
        assert_eq!(s.push("/x"), out("</x", false));
        assert_eq!(s.push("<"), out("", false));
        assert_eq!(s.finish(), "<");
    }

    #[test]
    fn split_across_pushes() {
        let mut s = m(&["STOP"]);
        assert_eq!(s.push("aS"), out("a", false));
        assert_eq!(s.push("T"), out("", false));
        assert_eq!(s.push("O"), out("", false));
        assert_eq!(s.push("Px"), out("", true));
        assert!(s.is_stopped());
        assert_eq!(s.push("more"), out("", true));
        assert_eq!(s.finish(), "");
    }

    #[test]
    fn overlapping_candidates() {
        let mut s = m(&["aab"]);
        assert_eq!(s.push("a"), out("", false));
        assert_eq!(s.push("a"), out("", false));
        assert_eq!(s.push("a"), out("a", false));
        assert_eq!(s.push("b"), out("", true));

        let mut s = m(&["aab"]);
        assert_eq!(s.push("xaaab!"), out("xa", true));
    }

    #[test]
    fn earliest_completing_match_wins() {
        // "bc" completes before "abcd" could.
        let mut s = m(&["abcd", "bc"]);
        assert_eq!(s.push("zabc"), out("za", true));
        // Same end: the longer (earlier-starting) stop wins.
        let mut s = m(&["b", "ab"]);
        assert_eq!(s.push("xab"), out("x", true));
    }

    #[test]
    fn multibyte_never_split() {
        let mut s = m(&["é!"]);
        assert_eq!(s.push("café"), out("caf", false));
        assert_eq!(s.push("?"), out("é?", false));
        let mut s = m(&["日本"]);
        assert_eq!(s.push("日"), out("", false));
        assert_eq!(s.push("本語"), out("", true));
        // Stop string sharing a leading byte with other chars is not held.
        let mut s = m(&["é"]);
        assert_eq!(s.push("è"), out("è", false));
    }

    /// Reference: the text up to the start of the first-completing match.
    fn reference(text: &str, stops: &[String]) -> (String, bool) {
        for end in (0..=text.len()).filter(|&e| text.is_char_boundary(e)) {
            let head = &text[..end];
            if let Some(s) = stops.iter().filter(|s| !s.is_empty() && head.ends_with(s.as_str())).max_by_key(|s| s.len()) {
                return (text[..end - s.len()].to_string(), true);
            }
        }
        (text.to_string(), false)
    }

    fn split_at_chars(text: &str, cuts: &[usize]) -> Vec<String> {
        let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        let mut points: Vec<usize> = cuts.iter().filter(|_| !bounds.is_empty()).map(|c| bounds[c % bounds.len()]).collect();
        points.push(0);
        points.push(text.len());
        points.sort_unstable();
        points.dedup();
        points.windows(2).map(|w| text[w[0]..w[1]].to_string()).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn chunked_output_matches_reference(
            text in "[ab€c]{0,40}",
            stops in prop::collection::vec("[ab€c]{0,4}", 0..4),
            cuts in prop::collection::vec(any::<usize>(), 0..12),
            // Empty pushes are allowed too.
            empty_at in any::<usize>(),
        ) {
            let (expected, expected_stop) = reference(&text, &stops);
            let mut chunks = split_at_chars(&text, &cuts);
            let at = empty_at % (chunks.len() + 1);
            chunks.insert(at, String::new());

            let mut s = StopMatcher::new(stops.clone());
            let mut got = String::new();
            let mut stopped = false;
            for c in &chunks {
                let o = s.push(c);
                prop_assert!(!stopped || o.emit.is_empty(), "emitted after stop");
                stopped |= o.stopped;
                got.push_str(&o.emit);
            }
            let tail = s.finish();
            if stopped {
                prop_assert_eq!(&tail, "");
            }
            got.push_str(&tail);
            prop_assert_eq!(stopped, expected_stop);
            prop_assert_eq!(got, expected);
        }
    }
}
