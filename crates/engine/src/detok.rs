//! Streaming UTF-8 assembly of token byte pieces.
//!
//! A byte-level BPE token decodes to raw bytes that may end in the middle of
//! a multi-byte UTF-8 character. [`Utf8Stream`] concatenates the pieces and
//! releases only complete characters, holding back an incomplete trailing
//! sequence (at most 3 bytes) until the next piece arrives.

/// Incremental, lossy UTF-8 decoder.
///
/// Invalid byte sequences become U+FFFD exactly as
/// [`String::from_utf8_lossy`] would replace them in the concatenated input
/// (one replacement per maximal invalid subpart); the output never depends on
/// how the bytes were split into pieces. Never panics.
#[derive(Debug, Clone, Default)]
pub struct Utf8Stream {
    /// Incomplete trailing sequence carried to the next push (≤ 3 bytes).
    pending: Vec<u8>,
    /// Reusable buffer for `pending` + the new piece.
    scratch: Vec<u8>,
}

impl Utf8Stream {
    /// Creates an empty stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of bytes held back as an incomplete character (0..=3).
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Feeds the next byte piece; returns all text that is now complete.
    ///
    /// An incomplete trailing sequence that could still become a valid
    /// character is held back; invalid sequences are replaced by U+FFFD.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        let mut out = String::with_capacity(bytes.len() + self.pending.len());
        if self.pending.is_empty() {
            decode(bytes, &mut out, &mut self.pending);
        } else {
            self.scratch.clear();
            self.scratch.append(&mut self.pending);
            self.scratch.extend_from_slice(bytes);
            decode(&self.scratch, &mut out, &mut self.pending);
        }
        debug_assert!(self.pending.len() <= 3);
        out
    }

    /// Ends the stream: flushes held-back bytes, an incomplete sequence
    /// becoming one U+FFFD. The stream is empty (reusable) afterwards.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// Lossily decodes `input` into `out`, leaving an incomplete trailing
/// sequence (one that more bytes could complete) in `pending`.
fn decode(mut input: &[u8], out: &mut String, pending: &mut Vec<u8>) {
    loop {
        match std::str::from_utf8(input) {
            Ok(s) => {
                out.push_str(s);
                return;
            }
            Err(e) => {
                let (valid, rest) = input.split_at(e.valid_up_to());
                // `valid` is valid UTF-8 by construction: this borrows.
                out.push_str(&String::from_utf8_lossy(valid));
                match e.error_len() {
                    Some(n) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        input = &rest[n..];
                    }
                    None => {
                        pending.extend_from_slice(rest);
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn split_bytes<'a>(bytes: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        points.push(0);
        points.push(bytes.len());
        points.sort_unstable();
        // Keep duplicates: empty pieces are valid input too.
        points.windows(2).map(|w| &bytes[w[0]..w[1]]).collect()
    }

    fn run(pieces: &[&[u8]]) -> String {
        let mut d = Utf8Stream::new();
        let mut out = String::new();
        for p in pieces {
            out.push_str(&d.push(p));
            assert!(d.pending_len() <= 3);
        }
        out.push_str(&d.finish());
        out
    }

    #[test]
    fn holds_incomplete_char() {
        let euro = "€".as_bytes(); // E2 82 AC
        let mut d = Utf8Stream::new();
        assert_eq!(d.push(b"a"), "a");
        assert_eq!(d.push(&euro[..1]), "");
        assert_eq!(d.push(&euro[1..2]), "");
        assert_eq!(d.pending_len(), 2);
        assert_eq!(d.push(&[euro[2], b'b']), "€b");
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn invalid_bytes_become_replacement() {
        let mut d = Utf8Stream::new();
        assert_eq!(d.push(&[0xFF, b'a', 0x80]), "\u{FFFD}a\u{FFFD}");
        // Incomplete then broken by an ASCII byte.
        assert_eq!(d.push(&[0xE2, 0x82]), "");
        assert_eq!(d.push(b"z"), "\u{FFFD}z");
        // Incomplete at the end of the stream.
        assert_eq!(d.push(&[0xF0, 0x9F]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
        assert_eq!(d.finish(), "");
        // Surrogates and overlongs.
        assert_eq!(run(&[&[0xED, 0xA0], &[0x80]]), "\u{FFFD}\u{FFFD}\u{FFFD}");
        assert_eq!(run(&[&[0xC0], &[0xAF]]), "\u{FFFD}\u{FFFD}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn valid_text_round_trips(
            text in any::<String>(),
            cuts in prop::collection::vec(any::<usize>(), 0..16),
        ) {
            let pieces = split_bytes(text.as_bytes(), &cuts);
            prop_assert_eq!(run(&pieces), text);
        }

        #[test]
        fn arbitrary_bytes_match_one_shot_lossy(
            bytes in prop::collection::vec(
                prop_oneof![any::<u8>(), 0x80u8..0xC0, 0xC0u8..0xF8], 0..64),
            cuts in prop::collection::vec(any::<usize>(), 0..16),
        ) {
            let pieces = split_bytes(&bytes, &cuts);
            prop_assert_eq!(run(&pieces), String::from_utf8_lossy(&bytes).into_owned());
        }
    }
}
