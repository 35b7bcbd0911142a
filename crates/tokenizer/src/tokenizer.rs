//! The byte-level BPE tokenizer (`tokenizer.ggml.model = "gpt2"`), a port of llama.cpp's
//! `llm_tokenizer_bpe` and `tokenizer_st_partition`.
//!
//! Encoding goes in three steps:
//! 1. Special tokens (control, user-defined and unknown types) are cut out of the raw text,
//!    longest token first, each token splitting every remaining text fragment at all its
//!    occurrences. With `parse_special = false` only user-defined tokens are cut (llama.cpp and
//!    Hugging Face do the same).
//! 2. Each remaining fragment is pre-tokenized into words (module `pretok`).
//! 3. Each word, as bytes, is merged by BPE: the adjacent pair with the lowest merge rank (ties:
//!    the leftmost) is merged until no pair has a rank. A final piece that is not a token falls
//!    back to one token per byte.
//!
//! Merging works on "piece ids" rather than strings: every string that can occur during a merge
//! (each byte's character, each side and result of each merge) gets an id, equal to the token id
//! when the string is a token and above the vocabulary otherwise. The merge table maps a pair of
//! piece ids to its rank and result, so merging allocates nothing.

use std::cmp::Reverse;
use std::collections::hash_map::Entry;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use bulkhead_gguf::GgufFile;

use crate::TokenizerError;
use crate::bytelevel::ByteLevel;
use crate::error::{optional, required};
use crate::pretok::{self, PreTokenizer};

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_UNK: &str = "tokenizer.ggml.unknown_token_id";
const KEY_PAD: &str = "tokenizer.ggml.padding_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";

/// llama.cpp's default BOS and EOS id for a `gpt2` vocabulary whose GGUF does not name them.
const GPT2_DEFAULT_BOS_EOS: u32 = 11;

/// Special tokens that llama.cpp looks up by text when the GGUF does not give their id. The
/// token found is forced to the control type. `eog`: the token ends generation.
struct AutoSpecial {
    key: &'static str,
    names: &'static [&'static str],
    eog: bool,
}

const AUTO_SPECIALS: &[AutoSpecial] = &[
    AutoSpecial {
        key: "tokenizer.ggml.eot_token_id",
        names: &[
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "<|end_of_text|>",
            "<EOT>",
            "_<EOT>",
            "<｜end▁of▁sentence｜>",
            "<end_of_utterance>",
        ],
        eog: true,
    },
    AutoSpecial { key: "tokenizer.ggml.eom_token_id", names: &["<|eom_id|>"], eog: true },
    AutoSpecial {
        key: "tokenizer.ggml.fim_pre_token_id",
        names: &["<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>"],
        eog: false,
    },
    AutoSpecial {
        key: "tokenizer.ggml.fim_suf_token_id",
        names: &["<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>"],
        eog: false,
    },
    AutoSpecial {
        key: "tokenizer.ggml.fim_mid_token_id",
        names: &["<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>"],
        eog: false,
    },
    AutoSpecial { key: "tokenizer.ggml.fim_pad_token_id", names: &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"], eog: true },
    AutoSpecial {
        key: "tokenizer.ggml.fim_rep_token_id",
        names: &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"],
        eog: true,
    },
    AutoSpecial { key: "tokenizer.ggml.fim_sep_token_id", names: &["<|file_sep|>"], eog: true },
];

/// Tokens that end generation by their text alone (llama.cpp's `special_eog_ids` list); they are
/// forced to the control type.
const EOG_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// What kind of token an id is (`tokenizer.ggml.token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// Type 0 or any value outside 1..=6.
    Undefined,
    /// Type 1: ordinary text, byte-level encoded.
    Normal,
    /// Type 2: the unknown token.
    Unknown,
    /// Type 3: control tokens such as `<|im_start|>`; matched in text only with `parse_special`.
    Control,
    /// Type 4: added tokens, always matched in text before BPE.
    UserDefined,
    /// Type 5: reserved, never produced.
    Unused,
    /// Type 6: a raw byte, `<0xXX>`.
    Byte,
}

impl TokenType {
    fn from_code(code: i64) -> Self {
        match code {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Undefined,
        }
    }

    /// Whether the token is cut out of raw text before BPE (control, user-defined, unknown).
    fn is_special(self) -> bool {
        matches!(self, TokenType::Control | TokenType::UserDefined | TokenType::Unknown)
    }
}

/// Multiply-shift hasher for the merge table's packed `(left, right)` keys: the keys come from
/// the model file, not from requests, so a fast unkeyed hash is safe here.
#[derive(Default)]
struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (v ^ (v >> 29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type MergeMap = HashMap<u64, Merge, BuildHasherDefault<PairHasher>>;

#[derive(Debug, Clone, Copy)]
struct Merge {
    rank: u32,
    result: u32,
}

fn pair_key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

/// One symbol of a word during merging: a run of the word's bytes.
#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: u32,
    len: u32,
    piece: u32,
    prev: i32,
    next: i32,
}

/// A candidate merge: ordered by rank, then by the left symbol's position (llama.cpp's
/// `llm_bigram_bpe::comparator`).
type Bigram = Reverse<(u32, u32, u32, u32, u32, u32)>; // (rank, left, right, left piece, right piece, result)

/// Buffers reused across the words of one `encode` call.
#[derive(Default)]
struct Scratch {
    ranges: Vec<(usize, usize)>,
    tmp: Vec<(usize, usize)>,
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Bigram>,
    word: String,
}

/// A piece of the input after special tokens are cut out.
#[derive(Debug, Clone, Copy)]
enum Fragment {
    Text(usize, usize),
    Token(u32),
}

/// A byte-level BPE tokenizer read from a GGUF file; see the module docs for the algorithm.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    texts: Vec<String>,
    types: Vec<TokenType>,
    token_to_id: HashMap<String, u32>,
    /// `token_bytes`: token `i` is `bytes[offsets[i]..offsets[i + 1]]`.
    bytes: Vec<u8>,
    offsets: Vec<usize>,
    /// Token for a byte when its piece is not a token (`<0xXX>`), if any.
    byte_token: [Option<u32>; 256],
    /// Special tokens in matching order: longest text first, then lowest id.
    specials: Vec<u32>,
    kind: Kind,
    bos: Option<u32>,
    eos: u32,
    unk: Option<u32>,
    pad: Option<u32>,
    eog: Vec<u32>,
    add_bos: bool,
}

/// How plain text becomes tokens: the tokenizer model the GGUF names.
#[derive(Debug, Clone)]
enum Kind {
    /// `gpt2`: byte-level BPE by merge rank.
    Bpe(Bpe),
    /// `llama`: SentencePiece by token score ([`crate::spm`]).
    Spm(crate::spm::Spm),
}

/// What byte-level BPE needs beyond the vocabulary.
#[derive(Debug, Clone)]
struct Bpe {
    byte_level: ByteLevel,
    /// Piece id of each byte's character.
    byte_piece: [u32; 256],
    merges: MergeMap,
    pre: PreTokenizer,
    ignore_merges: bool,
}

impl Bpe {
    /// The merges (on piece ids) and the pre-tokenizer; also the default of `add_bos`.
    fn from_gguf(gguf: &GgufFile, token_to_id: &HashMap<String, u32>, n_vocab: u32) -> Result<(Bpe, bool), TokenizerError> {
        let pre_name = optional(KEY_PRE, gguf.get_str(KEY_PRE))?;
        let spec = pretok::spec_for(pre_name)?;
        let pre = PreTokenizer::new(pre_name.unwrap_or("default"), &spec)?;
        let merge_strs = required(KEY_MERGES, gguf.get_str_array(KEY_MERGES))?;
        let byte_level = ByteLevel::new();
        let mut pieces = Pieces { token_to_id, extra: HashMap::new(), next: n_vocab };
        let mut byte_piece = [0u32; 256];
        let mut buf = [0u8; 4];
        for (b, slot) in (0u8..=255).zip(byte_piece.iter_mut()) {
            *slot = pieces.id(byte_level.char_of(b).encode_utf8(&mut buf));
        }
        let mut merges = MergeMap::with_capacity_and_hasher(merge_strs.len(), Default::default());
        let mut joined = String::new();
        for (rank, m) in merge_strs.iter().enumerate() {
            // llama.cpp splits at the first space after the first byte.
            let Some(sp) = m.as_bytes().iter().skip(1).position(|&b| b == b' ').map(|p| p + 1) else {
                continue;
            };
            let rank = u32::try_from(rank).map_err(|_| TokenizerError::InvalidValue { key: KEY_MERGES, why: "too many merges".into() })?;
            let (left, right) = (&m[..sp], &m[sp + 1..]);
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            let key = pair_key(pieces.id(left), pieces.id(right));
            let result = pieces.id(&joined);
            // The first occurrence of a pair keeps its rank, like llama.cpp's `emplace`.
            merges.entry(key).or_insert(Merge { rank, result });
        }
        Ok((Bpe { byte_level, byte_piece, merges, pre, ignore_merges: spec.ignore_merges }, spec.add_bos))
    }
}

fn push_bigram(bpe: &Bpe, syms: &[Symbol], heap: &mut BinaryHeap<Bigram>, left: i32, right: i32) {
    if left < 0 || right < 0 {
        return;
    }
    let (lp, rp) = (syms[left as usize].piece, syms[right as usize].piece);
    if let Some(m) = bpe.merges.get(&pair_key(lp, rp)) {
        heap.push(Reverse((m.rank, left as u32, right as u32, lp, rp, m.result)));
    }
}

/// Builds the piece table: the token id of a string, or a new id above the vocabulary.
struct Pieces<'a> {
    token_to_id: &'a HashMap<String, u32>,
    extra: HashMap<String, u32>,
    next: u32,
}

impl Pieces<'_> {
    fn id(&mut self, s: &str) -> u32 {
        if let Some(&id) = self.token_to_id.get(s) {
            return id;
        }
        match self.extra.entry(s.to_string()) {
            Entry::Occupied(e) => *e.get(),
            Entry::Vacant(e) => {
                let id = self.next;
                self.next += 1;
                *e.insert(id)
            }
        }
    }
}

impl Tokenizer {
    /// Build the tokenizer from a GGUF file's `tokenizer.*` metadata.
    ///
    /// Requires `tokenizer.ggml.model` (`gpt2`: byte-level BPE, which needs
    /// `tokenizer.ggml.merges`; `llama`: SentencePiece, which needs `tokenizer.ggml.scores`)
    /// and `tokenizer.ggml.tokens`; for BPE `tokenizer.ggml.pre` selects the pre-tokenizer
    /// (absent means llama.cpp's "default"). Token types, special-token ids and
    /// `add_bos_token` are optional, with llama.cpp's defaults. Every failure names the
    /// offending key.
    // Long on purpose (~125 lines): the keys depend on each other (the model type decides
    // which are required and what their defaults are), and each failure names its key;
    // read in one place, the order of the checks is the order of the errors.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        let model = required(KEY_MODEL, gguf.get_str(KEY_MODEL))?;
        if model != "gpt2" && model != "llama" {
            return Err(TokenizerError::UnsupportedModel { value: model.to_string() });
        }

        let raw_tokens = required(KEY_TOKENS, gguf.get_str_array(KEY_TOKENS))?;
        if raw_tokens.is_empty() {
            return Err(TokenizerError::InvalidValue { key: KEY_TOKENS, why: "the vocabulary is empty".into() });
        }
        let n_vocab = u32::try_from(raw_tokens.len())
            .ok()
            .filter(|&n| n < i32::MAX as u32)
            .ok_or_else(|| TokenizerError::InvalidValue { key: KEY_TOKENS, why: format!("{} tokens is too many", raw_tokens.len()) })?;
        let texts: Vec<String> =
            raw_tokens.iter().enumerate().map(|(i, t)| if t.is_empty() { format!("[EMPTY_{i}]") } else { (*t).to_string() }).collect();
        let mut token_to_id = HashMap::with_capacity(texts.len());
        for (id, t) in (0..n_vocab).zip(&texts) {
            if let Some(prev) = token_to_id.insert(t.clone(), id) {
                return Err(TokenizerError::InvalidValue {
                    key: KEY_TOKENS,
                    why: format!("tokens {prev} and {id} have the same text {t:?}"),
                });
            }
        }

        let mut types = match optional(KEY_TOKEN_TYPE, gguf.get_int_array(KEY_TOKEN_TYPE))? {
            None => vec![TokenType::Normal; texts.len()],
            Some(codes) if codes.len() == texts.len() => codes.into_iter().map(TokenType::from_code).collect(),
            Some(codes) => {
                return Err(TokenizerError::InvalidValue {
                    key: KEY_TOKEN_TYPE,
                    why: format!("{} entries for {} tokens", codes.len(), texts.len()),
                });
            }
        };

        let (kind, default_bos, default_eos, default_unk, default_add_bos) = if model == "llama" {
            let spm = crate::spm::Spm::from_gguf(gguf, texts.len())?;
            // llama.cpp's SentencePiece defaults: unk 0, bos 1, eos 2, a BOS added.
            (Kind::Spm(spm), Some(1), Some(2), Some(0), true)
        } else {
            let (bpe, add_bos) = Bpe::from_gguf(gguf, &token_to_id, n_vocab)?;
            let default_id = (GPT2_DEFAULT_BOS_EOS < n_vocab).then_some(GPT2_DEFAULT_BOS_EOS);
            (Kind::Bpe(bpe), default_id, default_id, None, add_bos)
        };
        let byte_level = ByteLevel::new();

        // Special ids from the file, checked against the vocabulary.
        let id_key = |key: &'static str| -> Result<Option<u32>, TokenizerError> {
            match optional(key, gguf.get_u64(key))? {
                None => Ok(None),
                Some(id) if id < u64::from(n_vocab) => Ok(Some(id as u32)),
                Some(id) => Err(TokenizerError::InvalidValue { key, why: format!("token id {id} is outside the vocabulary of {n_vocab}") }),
            }
        };
        let in_vocab = |id: Option<u32>| id.filter(|&i| i < n_vocab);
        let bos = id_key(KEY_BOS)?.or(in_vocab(default_bos));
        let eos = id_key(KEY_EOS)?.or(in_vocab(default_eos)).ok_or(TokenizerError::MissingKey { key: KEY_EOS })?;
        let unk = id_key(KEY_UNK)?.or(in_vocab(default_unk));
        let pad = id_key(KEY_PAD)?;
        let add_bos = optional(KEY_ADD_BOS, gguf.get_bool(KEY_ADD_BOS))?.unwrap_or(default_add_bos);
        let spm = matches!(kind, Kind::Spm(_));

        // End-of-generation set, and the type overrides llama.cpp applies on the way.
        let mut eog = Vec::new();
        for auto in AUTO_SPECIALS {
            let found = match id_key(auto.key)? {
                Some(id) => Some(id),
                None => {
                    let id = (0..n_vocab).find(|&id| auto.names.contains(&texts[id as usize].as_str()));
                    if let Some(id) = id {
                        types[id as usize] = TokenType::Control;
                    }
                    id
                }
            };
            if let (Some(id), true) = (found, auto.eog) {
                eog.push(id);
            }
        }
        for (id, t) in (0..n_vocab).zip(&texts) {
            if EOG_NAMES.contains(&t.as_str()) {
                eog.push(id);
                types[id as usize] = TokenType::Control;
            }
            if matches!(t.as_str(), "<|channel|>" | "<|message|>" | "<|start|>" | "<|constrain|>") {
                types[id as usize] = TokenType::UserDefined;
            }
        }
        eog.push(eos);
        eog.sort_unstable();
        eog.dedup();
        // o200k_harmony: with `<|return|>` and `<|call|>`, `<|end|>` does not end generation.
        let eog_has = |name: &str| eog.iter().any(|&id| texts[id as usize] == name);
        let harmony_end =
            (eog_has("<|return|>") && eog_has("<|call|>")).then(|| eog.iter().position(|&id| texts[id as usize] == "<|end|>")).flatten();
        if let Some(end) = harmony_end {
            types[eog[end] as usize] = TokenType::UserDefined;
            eog.remove(end);
        }

        let mut specials: Vec<u32> = (0..n_vocab).filter(|&id| types[id as usize].is_special()).collect();
        specials.sort_by_key(|&id| (Reverse(texts[id as usize].len()), id));

        // Bytes each token stands for.
        let mut bytes = Vec::new();
        let mut offsets = Vec::with_capacity(texts.len() + 1);
        offsets.push(0);
        for (t, &ty) in texts.iter().zip(&types) {
            match ty {
                _ if ty.is_special() => bytes.extend_from_slice(t.as_bytes()),
                TokenType::Byte if parse_byte_token(t).is_some() => bytes.extend(parse_byte_token(t)),
                // SentencePiece writes spaces as U+2581.
                _ if spm => bytes.extend_from_slice(t.replace('\u{2581}', " ").as_bytes()),
                _ => byte_level.decode_into(t, &mut bytes),
            }
            offsets.push(bytes.len());
        }
        let mut byte_token = [None; 256];
        for (b, slot) in (0u8..=255).zip(byte_token.iter_mut()) {
            *slot = token_to_id.get(&format!("<0x{b:02X}>")).copied();
        }

        Ok(Tokenizer { texts, types, token_to_id, bytes, offsets, byte_token, specials, kind, bos, eos, unk, pad, eog, add_bos })
    }

    /// Encode `text` to token ids. With `parse_special`, control tokens such as `<|im_start|>`
    /// written in the text become their ids; user-defined tokens are matched either way. No BOS
    /// is added: prepend [`Tokenizer::bos_id`] when [`Tokenizer::add_bos`] says so.
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut scratch = Scratch::default();
        // SentencePiece: a fragment that starts the text or follows a special token gets
        // the space prefix, where the model asks for one (llama.cpp's `is_prev_special`).
        let mut after_special = true;
        for frag in self.partition(text, parse_special) {
            match (frag, &self.kind) {
                (Fragment::Token(id), _) => {
                    out.push(id);
                    after_special = true;
                }
                (Fragment::Text(s, e), Kind::Bpe(bpe)) => self.encode_plain(bpe, &text[s..e], &mut out, &mut scratch),
                (Fragment::Text(s, e), Kind::Spm(spm)) => {
                    spm.encode(self, &text[s..e], after_special, &mut out);
                    after_special = false;
                }
            }
        }
        out
    }

    /// Cut special tokens out of `text` (llama.cpp's `tokenizer_st_partition`).
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Fragment::Text(0, text.len()));
        let mut next = Vec::new();
        for &id in &self.specials {
            if !parse_special && matches!(self.types[id as usize], TokenType::Control | TokenType::Unknown) {
                continue;
            }
            let needle = self.texts[id as usize].as_str();
            let found = frags.iter().any(|f| matches!(*f, Fragment::Text(s, e) if text[s..e].contains(needle)));
            if !found {
                continue;
            }
            next.clear();
            for &frag in &frags {
                let Fragment::Text(mut s, e) = frag else {
                    next.push(frag);
                    continue;
                };
                while let Some(p) = text[s..e].find(needle) {
                    if p > 0 {
                        next.push(Fragment::Text(s, s + p));
                    }
                    next.push(Fragment::Token(id));
                    s += p + needle.len();
                }
                if s < e {
                    next.push(Fragment::Text(s, e));
                }
            }
            std::mem::swap(&mut frags, &mut next);
        }
        frags
    }

    /// Pre-tokenize and BPE-encode text that holds no special tokens.
    fn encode_plain(&self, bpe: &Bpe, text: &str, out: &mut Vec<u32>, scratch: &mut Scratch) {
        let mut ranges = std::mem::take(&mut scratch.ranges);
        bpe.pre.split(text, &mut ranges, &mut scratch.tmp);
        for &(s, e) in &ranges {
            self.encode_word(bpe, &text.as_bytes()[s..e], out, scratch);
        }
        scratch.ranges = ranges;
    }

    /// BPE-encode one word (llama.cpp's `llm_tokenizer_bpe_session::tokenize`, per word).
    fn encode_word(&self, bpe: &Bpe, word: &[u8], out: &mut Vec<u32>, scratch: &mut Scratch) {
        if word.is_empty() {
            return;
        }
        if bpe.ignore_merges {
            scratch.word.clear();
            bpe.byte_level.encode_into(word, &mut scratch.word);
            if let Some(&id) = self.token_to_id.get(scratch.word.as_str()) {
                out.push(id);
                return;
            }
        }
        let n = word.len();
        let syms = &mut scratch.symbols;
        syms.clear();
        // Word lengths are bounded by the input; i32 indices cover any word under 2 GiB.
        for (i, &b) in word.iter().enumerate() {
            syms.push(Symbol {
                start: i as u32,
                len: 1,
                piece: bpe.byte_piece[usize::from(b)],
                prev: i as i32 - 1,
                next: if i + 1 == n { -1 } else { i as i32 + 1 },
            });
        }
        let heap = &mut scratch.heap;
        heap.clear();
        for i in 1..n {
            push_bigram(bpe, syms, heap, i as i32 - 1, i as i32);
        }
        while let Some(Reverse((_, left, right, lp, rp, result))) = heap.pop() {
            let (l, r) = (syms[left as usize], syms[right as usize]);
            // Stale: either side has merged since this candidate was queued.
            if l.len == 0 || r.len == 0 || l.piece != lp || r.piece != rp {
                continue;
            }
            let merged = &mut syms[left as usize];
            merged.len += r.len;
            merged.piece = result;
            merged.next = r.next;
            let prev = merged.prev;
            syms[right as usize].len = 0;
            if r.next >= 0 {
                syms[r.next as usize].prev = left as i32;
            }
            push_bigram(bpe, syms, heap, prev, left as i32);
            push_bigram(bpe, syms, heap, left as i32, r.next);
        }
        let n_vocab = self.texts.len() as u32;
        let mut i = 0i32;
        while i >= 0 {
            let sym = syms[i as usize];
            if sym.piece < n_vocab {
                out.push(sym.piece);
            } else {
                // Not a token: one token per byte, where the vocabulary has one.
                let span = &word[sym.start as usize..(sym.start + sym.len) as usize];
                for &b in span {
                    let p = bpe.byte_piece[usize::from(b)];
                    if p < n_vocab {
                        out.push(p);
                    } else if let Some(t) = self.byte_token[usize::from(b)] {
                        out.push(t);
                    }
                }
            }
            i = sym.next;
        }
    }

    /// The bytes token `id` stands for: byte-level decoded for ordinary tokens, the literal text
    /// for control, user-defined and unknown tokens. `None` if `id` is not in the vocabulary.
    /// Concatenating these and decoding UTF-8 once a sequence is complete gives streaming output.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        let (&s, &e) = (self.offsets.get(i)?, self.offsets.get(i + 1)?);
        Some(&self.bytes[s..e])
    }

    /// Decode ids to text; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD and
    /// ids outside the vocabulary are skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut buf = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            if let Some(b) = self.token_bytes(id) {
                buf.extend_from_slice(b);
            }
        }
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.texts.len()
    }

    /// The beginning-of-sequence token (`tokenizer.ggml.bos_token_id`, else llama.cpp's
    /// default for `gpt2` vocabularies, 11, when the vocabulary is that large).
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence token (`tokenizer.ggml.eos_token_id`, else llama.cpp's default 11).
    pub fn eos_id(&self) -> u32 {
        self.eos
    }

    /// The unknown token (`tokenizer.ggml.unknown_token_id`), if given.
    pub fn unk_id(&self) -> Option<u32> {
        self.unk
    }

    /// The padding token (`tokenizer.ggml.padding_token_id`), if given.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }

    /// Whether `id` ends generation: EOS, EOT/EOM, FIM pad/repo/separator tokens, and tokens
    /// named like `<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, `<|end|>` (llama.cpp's EOG set).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// All end-of-generation ids, ascending.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// Whether a BOS token should be prepended to a prompt (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The id of the token whose vocabulary text is exactly `text` (byte-level form for ordinary
    /// tokens, e.g. `"Ġthe"`; literal text for special tokens, e.g. `"<|im_end|>"`).
    pub fn token_to_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// The token for byte `b` when a piece has no token of its own: `<0xXX>`, else the
    /// byte's own one-character token, else the unknown token (llama.cpp's `byte_to_token`).
    pub(crate) fn byte_fallback(&self, b: u8) -> Option<u32> {
        self.byte_token[usize::from(b)]
            .or_else(|| char::from_u32(u32::from(b)).filter(|_| b.is_ascii()).and_then(|c| self.token_to_id(c.encode_utf8(&mut [0; 4]))))
            .or(self.unk)
    }

    /// The vocabulary text of token `id`, as stored in the GGUF.
    pub fn id_to_token(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    /// The type of token `id`, after llama.cpp's overrides (end-of-generation and FIM tokens
    /// found by name become control tokens).
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }
}

/// The byte of a `<0xXX>` token.
fn parse_byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}
