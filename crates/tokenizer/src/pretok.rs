//! Pre-tokenization: splitting text into words before BPE, selected by `tokenizer.ggml.pre`
//! exactly as llama.cpp's `llm_tokenizer_bpe` does.
//!
//! A pre-tokenizer is a sequence of regexes. Each is applied in turn to every piece the previous
//! ones produced; both the matches and the unmatched stretches between them become pieces
//! (llama.cpp's `unicode_regex_split`). A regex's lookahead therefore never sees past the end of
//! the piece it runs on.

use fancy_regex::Regex;

use crate::TokenizerError;

/// GPT-2's split regex (llama.cpp implements it by hand as `unicode_regex_split_custom_gpt2`).
pub(crate) const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's split regex, with the case-insensitive group spelled out as llama.cpp does.
pub(crate) const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's split regex (single digits).
pub(crate) const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Every digit its own piece (run before [`GPT2_REGEX`] by the StarCoder family, SmolLM included).
pub(crate) const DIGIT_REGEX: &str = r"\p{N}";

/// The regex sequence, and the flags, of one `tokenizer.ggml.pre` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PreSpec {
    pub regexes: &'static [&'static str],
    /// A word that is itself a token is emitted whole, without running the merges.
    pub ignore_merges: bool,
    /// Default of `add_bos` before `tokenizer.ggml.add_bos_token` is consulted.
    pub add_bos: bool,
}

const DEFAULT: &[&str] = &[r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", "[0-9][0-9][0-9]"];
const FALCON: &[&str] = &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2_REGEX, "[0-9][0-9][0-9]"];

/// Look up a `tokenizer.ggml.pre` value; `None` (key absent) is llama.cpp's "default".
pub(crate) fn spec_for(pre: Option<&str>) -> Result<PreSpec, TokenizerError> {
    let plain = |regexes| PreSpec { regexes, ignore_merges: false, add_bos: false };
    let spec = match pre.unwrap_or("default") {
        "default" => plain(DEFAULT),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" => {
            PreSpec { regexes: &[LLAMA3_REGEX], ignore_merges: true, add_bos: true }
        }
        "dbrx" | "smaug-bpe" => plain(&[LLAMA3_REGEX]),
        "falcon" => plain(FALCON),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" | "minerva" => {
            plain(&[DIGIT_REGEX, GPT2_REGEX])
        }
        "gpt-2" | "gpt2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v1-en" | "jina-v2-es" | "jina-v2-de" | "jina-v2-code"
        | "roberta-bpe" | "a.x-4.0" | "mellum" | "mpt" | "olmo" | "jais" | "trillion" | "granite-docling" | "exaone4" => {
            plain(&[GPT2_REGEX])
        }
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "megrez" | "stablelm2" | "hunyuan" => plain(&[QWEN2_REGEX]),
        other => return Err(TokenizerError::UnknownPre { value: other.to_string() }),
    };
    Ok(spec)
}

/// Compiled pre-tokenizer regexes.
#[derive(Debug, Clone)]
pub(crate) struct PreTokenizer {
    regexes: Vec<Regex>,
}

impl PreTokenizer {
    /// Compile the regexes of `spec` (once, at load time).
    pub(crate) fn new(name: &str, spec: &PreSpec) -> Result<Self, TokenizerError> {
        let regexes = spec
            .regexes
            .iter()
            .map(|r| {
                fancy_regex::RegexBuilder::new(r)
                    .backtrack_limit(10_000_000)
                    .build()
                    .map_err(|e| TokenizerError::Regex { pre: name.to_string(), source: Box::new(e) })
            })
            .collect::<Result<_, _>>()?;
        Ok(PreTokenizer { regexes })
    }

    /// Split `text` into pieces, written to `out` as byte ranges `(start, end)` that tile `text`
    /// in order. `tmp` is scratch space.
    ///
    /// Should the regex engine give up on a piece (its backtracking limit), the rest of that
    /// piece is kept whole rather than failing the request: BPE still encodes it losslessly.
    pub(crate) fn split(&self, text: &str, out: &mut Vec<(usize, usize)>, tmp: &mut Vec<(usize, usize)>) {
        out.clear();
        if text.is_empty() {
            return;
        }
        out.push((0, text.len()));
        for re in &self.regexes {
            tmp.clear();
            for &(start, end) in out.iter() {
                let piece = &text[start..end];
                let mut last = 0;
                for m in re.find_iter(piece) {
                    let Ok(m) = m else { break };
                    if m.start() > last {
                        tmp.push((start + last, start + m.start()));
                    }
                    if m.end() > m.start() {
                        tmp.push((start + m.start(), start + m.end()));
                    }
                    last = m.end();
                }
                if last < piece.len() {
                    tmp.push((start + last, end));
                }
            }
            std::mem::swap(out, tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces<'a>(pre: &str, text: &'a str) -> Vec<&'a str> {
        let spec = spec_for(Some(pre)).expect("known pre");
        let p = PreTokenizer::new(pre, &spec).expect("regexes compile");
        let (mut out, mut tmp) = (Vec::new(), Vec::new());
        p.split(text, &mut out, &mut tmp);
        out.iter().map(|&(s, e)| &text[s..e]).collect()
    }

    #[test]
    fn smollm_splits_every_digit_and_keeps_the_space_before_a_number_alone() {
        assert_eq!(pieces("smollm", "The year 2026 has"), ["The", " year", " ", "2", "0", "2", "6", " has"]);
    }

    #[test]
    fn gpt2_leaves_one_space_to_the_next_word_and_isolates_a_lone_tab() {
        assert_eq!(pieces("gpt-2", "a   b\tc\n\nd "), ["a", "  ", " b", "\t", "c", "\n", "\n", "d", " "]);
        assert_eq!(pieces("gpt-2", "don't  x"), ["don", "'t", " ", " x"]);
    }

    #[test]
    fn llama3_groups_digits_by_three_and_keeps_newlines_together() {
        assert_eq!(pieces("llama-bpe", "12345 ab\n\n  c"), ["123", "45", " ab", "\n\n", " ", " c"]);
    }

    #[test]
    fn an_unknown_pre_value_is_an_error_naming_it() {
        let e = spec_for(Some("no-such-pre")).expect_err("unknown");
        assert!(e.to_string().contains("no-such-pre") && e.to_string().contains("tokenizer.ggml.pre"), "{e}");
    }

    #[test]
    fn every_known_pre_value_compiles() {
        for pre in ["default", "llama3", "dbrx", "falcon", "smollm", "gpt-2", "qwen2"] {
            let spec = spec_for(Some(pre)).expect("known");
            PreTokenizer::new(pre, &spec).expect("compiles");
        }
    }
}
