//! The vocabulary: a donor model's real tokenizer (tokens, merges or scores, token types,
//! special tokens, chat template) fitted to the shape's vocabulary size. A larger shape gets
//! the donor's tokens and then never-occurring `<|synth_pad_N|>` tokens of the unused type
//! (as llama.cpp's converter pads a vocabulary with `[PADn]`); a smaller one keeps the first
//! tokens and the merges among them. Either way both Bulkhead's tokenizer and llama.cpp's
//! load it, and text tokenises as the donor's would (up to the cut).

use std::collections::HashSet;

use bulkhead_gguf::{GgufFile, Value};

use crate::SynthError;

const TOKENS: &str = "tokenizer.ggml.tokens";
const SCORES: &str = "tokenizer.ggml.scores";
const TYPES: &str = "tokenizer.ggml.token_type";
const MERGES: &str = "tokenizer.ggml.merges";
/// GGUF's token type of a reserved token that is never produced.
const UNUSED: i32 = 5;

/// The text of padding token `id`.
pub fn pad_token(id: usize) -> String {
    format!("<|synth_pad_{id}|>")
}

fn donor_err(why: String) -> SynthError {
    SynthError::Donor { why }
}

/// Every `tokenizer.*` metadata entry of `donor`, fitted to `vocab` tokens. Errors when the
/// donor has no token list, when its arrays disagree in length, or when a special token
/// (`tokenizer.ggml.*_token_id`) would be cut off.
pub fn fit(donor: &GgufFile, vocab: usize) -> Result<Vec<(String, Value)>, SynthError> {
    let tokens = donor.get_str_array(TOKENS).map_err(|e| donor_err(format!("no usable vocabulary: {e}")))?;
    let have = tokens.len();
    let kept: HashSet<&str> = tokens.iter().take(vocab).copied().collect();
    let mut out = Vec::new();
    for (key, value) in donor.metadata().iter().filter(|(k, _)| k.starts_with("tokenizer.")) {
        let value = match key.as_str() {
            TOKENS => {
                let mut v: Vec<Value> = tokens.iter().take(vocab).map(|t| Value::String((*t).to_string())).collect();
                v.extend((have..vocab).map(|id| Value::String(pad_token(id))));
                Value::Array(v)
            }
            SCORES | TYPES => {
                let Value::Array(items) = value else {
                    return Err(donor_err(format!("`{key}` is a {}, not an array", value.type_name())));
                };
                if items.len() != have {
                    return Err(donor_err(format!("`{key}` has {} entries for {have} tokens", items.len())));
                }
                let pad = match (key.as_str(), items.first()) {
                    (SCORES, Some(Value::F64(_))) => Value::F64(-1000.0),
                    (SCORES, _) => Value::F32(-1000.0),
                    (_, Some(Value::U32(_))) => Value::U32(UNUSED as u32),
                    _ => Value::I32(UNUSED),
                };
                let mut v: Vec<Value> = items.iter().take(vocab).cloned().collect();
                v.resize(vocab, pad);
                Value::Array(v)
            }
            MERGES if vocab < have => {
                let merges = donor.get_str_array(MERGES)?;
                let keep = |m: &&&str| {
                    // Split as llama.cpp does: at the first space after the first byte.
                    let Some(sp) = m.as_bytes().iter().skip(1).position(|&b| b == b' ').map(|p| p + 1) else {
                        return false;
                    };
                    let (l, r) = (&m[..sp], &m[sp + 1..]);
                    kept.contains(l) && kept.contains(r) && kept.contains(format!("{l}{r}").as_str())
                };
                Value::Array(merges.iter().filter(keep).map(|m| Value::String((*m).to_string())).collect())
            }
            k if k.ends_with("_token_id") => {
                if value.as_u64().is_some_and(|id| id >= vocab as u64) {
                    return Err(donor_err(format!(
                        "`{k}` is token {}, outside the shape's {vocab}-token vocabulary",
                        value.as_u64().unwrap_or_default()
                    )));
                }
                value.clone()
            }
            _ => value.clone(),
        };
        out.push((key.clone(), value));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use bulkhead_gguf::GgufWriter;

    use super::*;

    fn donor() -> GgufFile {
        let tokens = ["<s>", "a", "b", "c", "ab", "abc", "bc"];
        let mut w = GgufWriter::new();
        w.meta("tokenizer.ggml.model", Value::String("gpt2".into()))
            .meta(TOKENS, Value::Array(tokens.iter().map(|t| Value::String(t.to_string())).collect()))
            .meta(
                TYPES,
                Value::Array(vec![Value::I32(3), Value::I32(1), Value::I32(1), Value::I32(1), Value::I32(1), Value::I32(1), Value::I32(1)]),
            )
            .meta(MERGES, Value::Array(["a b", "ab c", "b c"].iter().map(|m| Value::String(m.to_string())).collect()))
            .meta("tokenizer.ggml.eos_token_id", Value::U32(0))
            .meta("tokenizer.chat_template", Value::String("{{ x }}".into()))
            .meta("general.name", Value::String("donor".into()));
        GgufFile::parse(w.to_bytes()).unwrap()
    }

    fn get<'a>(m: &'a [(String, Value)], k: &str) -> &'a Value {
        &m.iter().find(|(key, _)| key == k).unwrap().1
    }

    fn strings(v: &Value) -> Vec<String> {
        let Value::Array(items) = v else { panic!("{v:?}") };
        items.iter().map(|s| if let Value::String(s) = s { s.clone() } else { panic!("{s:?}") }).collect()
    }

    #[test]
    fn a_larger_vocabulary_is_padded_with_unused_tokens() {
        let m = fit(&donor(), 10).unwrap();
        let t = strings(get(&m, TOKENS));
        assert_eq!(t[..7], ["<s>", "a", "b", "c", "ab", "abc", "bc"]);
        assert_eq!(t[7..], [pad_token(7), pad_token(8), pad_token(9)]);
        let Value::Array(types) = get(&m, TYPES) else { panic!() };
        assert_eq!(types.len(), 10);
        assert_eq!(types[9], Value::I32(UNUSED));
        assert_eq!(strings(get(&m, MERGES)).len(), 3);
        assert_eq!(get(&m, "tokenizer.chat_template"), &Value::String("{{ x }}".into()));
        assert!(m.iter().all(|(k, _)| k.starts_with("tokenizer.")), "only the tokenizer is copied");
    }

    #[test]
    fn a_smaller_vocabulary_keeps_the_merges_among_its_tokens() {
        let m = fit(&donor(), 5).unwrap();
        assert_eq!(strings(get(&m, TOKENS)), ["<s>", "a", "b", "c", "ab"]);
        // "ab c" makes "abc" and "b c" makes "bc", both cut off.
        assert_eq!(strings(get(&m, MERGES)), ["a b"]);
        let e = fit(&donor(), 0).unwrap_err().to_string();
        assert!(e.contains("eos_token_id"), "{e}");
    }
}
