//! GPT-2's byte-level alphabet: every byte is written as one printable character, so that a
//! vocabulary of strings can hold arbitrary bytes (`bytes_to_unicode` in GPT-2's encoder.py,
//! `unicode_byte_to_utf8` in llama.cpp).

/// The byte <-> character tables.
#[derive(Debug, Clone)]
pub(crate) struct ByteLevel {
    to_char: [char; 256],
    /// Indexed by code point; only code points below 324 are used by the alphabet.
    from_char: [Option<u8>; 324],
}

impl ByteLevel {
    /// Build the tables: printable Latin-1 bytes stand for themselves, the other 68 bytes take
    /// the code points 256.. in byte order.
    pub(crate) fn new() -> Self {
        let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        let mut to_char = ['\0'; 256];
        let mut from_char = [None; 324];
        let mut next = 256u32;
        for (b, slot) in (0u8..=255).zip(to_char.iter_mut()) {
            let cp = if printable(u32::from(b)) {
                u32::from(b)
            } else {
                next += 1;
                next - 1
            };
            // Every code point here is below 324, far from the surrogate range.
            *slot = char::from_u32(cp).unwrap_or('\u{fffd}');
            from_char[cp as usize] = Some(b);
        }
        assert_eq!(next, 324, "byte-level alphabet: 68 bytes are remapped above 255");
        ByteLevel { to_char, from_char }
    }

    /// The character that stands for byte `b`.
    pub(crate) fn char_of(&self, b: u8) -> char {
        self.to_char[usize::from(b)]
    }

    /// The byte a character stands for, if it is in the alphabet.
    pub(crate) fn byte_of(&self, c: char) -> Option<u8> {
        self.from_char.get(c as usize).copied().flatten()
    }

    /// Decode a vocabulary string to the bytes it stands for. Characters outside the alphabet
    /// (which a well-formed byte-level vocabulary does not contain) are kept as their UTF-8.
    pub(crate) fn decode_into(&self, s: &str, out: &mut Vec<u8>) {
        for c in s.chars() {
            match self.byte_of(c) {
                Some(b) => out.push(b),
                None => {
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
            }
        }
    }

    /// Encode bytes as a vocabulary string, appending to `out`.
    pub(crate) fn encode_into(&self, bytes: &[u8], out: &mut String) {
        out.extend(bytes.iter().map(|&b| self.char_of(b)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_round_trips_through_its_character() {
        let bl = ByteLevel::new();
        for b in 0u8..=255 {
            assert_eq!(bl.byte_of(bl.char_of(b)), Some(b));
        }
    }

    #[test]
    fn space_and_newline_take_gpt2_characters() {
        let bl = ByteLevel::new();
        assert_eq!(bl.char_of(b' '), 'Ġ');
        assert_eq!(bl.char_of(b'\n'), 'Ċ');
        assert_eq!(bl.char_of(b'a'), 'a');
    }
}
