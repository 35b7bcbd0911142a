//! The SentencePiece tokenizer (`tokenizer.ggml.model = "llama"`), as llama.cpp runs it
//! (`llm_tokenizer_spm`): Gemma's, Llama 2's, Mistral's.
//!
//! A text fragment (special tokens already cut out) gets a leading space when the model says
//! `add_space_prefix` and the fragment starts the text or follows a special token; then its
//! spaces become U+2581 (`▁`). It is split into UTF-8 characters, and the adjacent pair whose
//! concatenation is the vocabulary token of highest score (ties: the leftmost) is merged,
//! again and again. Each final symbol is its token if it is one; otherwise (only a single
//! character can be left unmerged: every merge makes a token) it becomes one `<0xXX>`
//! token per byte (byte fallback).

use std::collections::BinaryHeap;

use bulkhead_gguf::{GgufFile, Value};

use crate::TokenizerError;
use crate::error::{optional, required};
use crate::tokenizer::Tokenizer;

const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";

/// What SentencePiece needs beyond the vocabulary.
#[derive(Debug, Clone)]
pub struct Spm {
    scores: Vec<f32>,
    add_space_prefix: bool,
}

/// A run of the text during merging.
#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: isize,
    next: isize,
}

/// A candidate merge: the higher score first, then the leftmost (llama.cpp's
/// `llm_bigram_spm::comparator`).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

impl Spm {
    /// The scores (one per token) and `add_space_prefix` (llama.cpp's default: true).
    pub(crate) fn from_gguf(gguf: &GgufFile, n_vocab: usize) -> Result<Spm, TokenizerError> {
        let raw = required(KEY_SCORES, gguf.get_array(KEY_SCORES))?;
        if raw.len() != n_vocab {
            return Err(TokenizerError::InvalidValue { key: KEY_SCORES, why: format!("{} scores for {n_vocab} tokens", raw.len()) });
        }
        let scores = raw
            .iter()
            .map(|v| match v {
                Value::F32(x) => Ok(*x),
                Value::F64(x) => Ok(*x as f32),
                _ => Err(TokenizerError::InvalidValue { key: KEY_SCORES, why: "not an array of floats".into() }),
            })
            .collect::<Result<_, _>>()?;
        let add_space_prefix = optional(KEY_SPACE_PREFIX, gguf.get_bool(KEY_SPACE_PREFIX))?.unwrap_or(true);
        Ok(Spm { scores, add_space_prefix })
    }

    /// Encode one fragment of plain text; `after_special`: it starts the text or follows a
    /// special token.
    pub(crate) fn encode(&self, tok: &Tokenizer, fragment: &str, after_special: bool, out: &mut Vec<u32>) {
        let mut text = String::with_capacity(fragment.len() + 3);
        if self.add_space_prefix && after_special {
            text.push(' ');
        }
        text.push_str(fragment);
        let text = text.replace(' ', "\u{2581}");
        if text.is_empty() {
            return;
        }
        let mut syms: Vec<Symbol> = Vec::with_capacity(text.len());
        let mut at = 0;
        for (i, ch) in text.char_indices() {
            let n = syms.len() as isize;
            syms.push(Symbol { start: i, len: ch.len_utf8(), prev: n - 1, next: n + 1 });
            at = i + ch.len_utf8();
        }
        if let Some(last) = syms.last_mut() {
            last.next = -1;
        }
        debug_assert_eq!(at, text.len());
        let mut heap = BinaryHeap::new();
        let try_add = |syms: &[Symbol], heap: &mut BinaryHeap<Bigram>, left: isize, right: isize| {
            if left < 0 || right < 0 {
                return;
            }
            let (l, r) = (syms[left as usize], syms[right as usize]);
            let piece = &text[l.start..l.start + l.len + r.len];
            if let Some(id) = tok.token_to_id(piece) {
                heap.push(Bigram { score: self.scores[id as usize], left: left as usize, right: right as usize, len: piece.len() });
            }
        };
        for i in 1..syms.len() {
            try_add(&syms, &mut heap, i as isize - 1, i as isize);
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (syms[b.left], syms[b.right]);
            // Stale: either side merged since this candidate was queued.
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
                continue;
            }
            syms[b.left].len += r.len;
            syms[b.right].len = 0;
            syms[b.left].next = r.next;
            if r.next >= 0 {
                syms[r.next as usize].prev = b.left as isize;
            }
            let prev = syms[b.left].prev;
            let next = syms[b.left].next;
            try_add(&syms, &mut heap, prev, b.left as isize);
            try_add(&syms, &mut heap, b.left as isize, next);
        }
        let mut i = 0isize;
        while i >= 0 {
            let s = syms[i as usize];
            let piece = &text[s.start..s.start + s.len];
            match tok.token_to_id(piece) {
                Some(id) => out.push(id),
                None => out.extend(piece.bytes().filter_map(|b| tok.byte_fallback(b))),
            }
            i = s.next;
        }
    }
}
