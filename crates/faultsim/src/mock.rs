//! A CPU-only mock model whose every output depends on every KV slot it reads.
//!
//! - The KV a position holds is a deterministic function of the sequence's tokens up to
//!   and including it: the "hidden state" at position `p` is a fold of every slot of
//!   positions `0..p` (read back through [`KvPool::read`]) and token `p`, and that state
//!   expands to the K and V values of every layer and head.
//! - A step's output token is the fold of every slot it reads: the prompt's last step
//!   (the first token) reads positions `0..n`, each decode step `0..=p`.
//!
//! So a foreign, stale, poisoned or missing slot anywhere in a sequence changes the
//! token, and through the next state every later one. Refused and missing reads are also
//! counted ([`PrefillModel::read_faults`]), and before each decode step the pool's own
//! read checks run ([`KvPool::check_reads`]: generations, canaries, the auditor). The
//! reference is the same code run alone on a fresh private pool ([`reference`]).
//!
//! The fold is position-major, so a prompt computed in chunks of any size folds to the
//! same state as one computed whole. Values are integers in `-1023..=1023`, exact in f16,
//! never the poison NaN.

use bulkhead_kv::{KvChecks, KvError, KvLayout, KvPool, PoolConfig, RequestId, SequenceKv};
use bulkhead_protocol::decode::{DecodeStart, LocalStart, Retired};
use bulkhead_protocol::driver::decode::{DecodeEngine, GenEvent, Growing, Verification, make_room};
use bulkhead_protocol::driver::prefill::{Chunk, First, PrefillCompute};
use bulkhead_protocol::{FinishReason, Sampling};
use half::f16;

use crate::model::{DecodeModel, Expected, ModelFault, Models, PrefillModel, Shape};

/// Token ids of the mock: `0..VOCAB`.
pub const VOCAB: u32 = 50_000;
/// Fold of nothing: the state before position 0.
const START: u64 = 0x6275_6c6b_6865_6164;
/// Folded in place of a slot that a read refused, that was not written, or that failed
/// the pool's read checks.
const REFUSED: u64 = 0xdead_0001;
const MISSING: u64 = 0xdead_0002;
const CHECK_FAILED: u64 = 0xdead_0003;

/// The mock's end-of-generation tokens (about 1 in 97).
pub fn is_eog(token: u32) -> bool {
    token.is_multiple_of(97)
}

fn mix(h: u64, x: u64) -> u64 {
    // SplitMix64's finaliser over an asymmetric combination of state and input.
    let mut z = h.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17) ^ x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn token_of(state: u64) -> u32 {
    (state % u64::from(VOCAB)) as u32
}

fn fold_halves(mut acc: u64, xs: &[f16]) -> u64 {
    for c in xs.chunks(4) {
        let w = c.iter().enumerate().fold(0u64, |w, (i, x)| w | u64::from(x.to_bits()) << (16 * i));
        acc = mix(acc, w);
    }
    acc
}

/// Folds every slot of positions `from..to` of `seq` into `acc`, position by position,
/// reading each page once per layer through [`KvPool::read`]. A refused read or a slot
/// past the watermark folds a marker instead and counts in `faults`.
fn fold(pool: &KvPool, seq: &SequenceKv, from: usize, to: usize, mut acc: u64, faults: &mut u64) -> u64 {
    let l = *pool.layout();
    let (ps, hd) = (l.page_size, l.head_dim);
    let mut views = Vec::with_capacity(l.layers);
    let mut pos = from;
    while pos < to {
        let Ok((lease, first_slot)) = seq.locate_page(pos) else {
            *faults += 1;
            acc = mix(acc, MISSING);
            pos += 1;
            continue;
        };
        let end = (pos - first_slot + ps).min(to);
        views.clear();
        views.extend((0..l.layers).map(|layer| pool.read(lease, layer).ok()));
        for slot in first_slot..first_slot + (end - pos) {
            for v in &views {
                match v {
                    Some(r) if slot < r.len() => {
                        for h in 0..l.kv_heads {
                            acc = fold_halves(acc, &r.k_head(h)[slot * hd..(slot + 1) * hd]);
                            acc = fold_halves(acc, &r.v_head(h)[slot * hd..(slot + 1) * hd]);
                        }
                    }
                    Some(_) => {
                        *faults += 1;
                        acc = mix(acc, MISSING);
                    }
                    None => {
                        *faults += 1;
                        acc = mix(acc, REFUSED);
                    }
                }
            }
        }
        pos = end;
    }
    acc
}

/// The pool's checks before attending to `seq`'s committed positions; a failure folds a
/// marker and counts.
fn check_reads(pool: &KvPool, seq: &mut SequenceKv, acc: u64, faults: &mut u64) -> u64 {
    match pool.check_reads(seq) {
        Ok(()) => acc,
        Err(_) => {
            *faults += 1;
            mix(acc, CHECK_FAILED)
        }
    }
}

/// Writes the KV of position `pos` (every layer) for the hidden state `state`.
fn write_position(pool: &mut KvPool, seq: &SequenceKv, pos: usize, state: u64) -> Result<(), KvError> {
    let l = *pool.layout();
    let row = l.kv_heads * l.head_dim;
    let value = |i: usize| ((mix(state, i as u64) >> 33) % 2047) as f32 - 1023.0;
    let (lease, slot) = seq.locate(pos)?;
    let (mut k, mut v) = (vec![0.0; row], vec![0.0; row]);
    for layer in 0..l.layers {
        for i in 0..row {
            k[i] = value((2 * layer) * row + i);
            v[i] = value((2 * layer + 1) * row + i);
        }
        pool.write(lease, layer, slot, &k, &v)?;
    }
    Ok(())
}

fn token_word(token: u32, pos: usize) -> u64 {
    u64::from(token) | (pos as u64) << 32
}

/// Computes and commits prompt positions `from..to` of `seq`; after the last one, returns
/// the first generated token.
fn prefill(
    pool: &mut KvPool,
    seq: &mut SequenceKv,
    tokens: &[u32],
    from: usize,
    to: usize,
    faults: &mut u64,
) -> Result<Option<u32>, KvError> {
    let mut acc = check_reads(pool, seq, START, faults);
    acc = fold(pool, seq, 0, from, acc, faults);
    for (pos, &t) in tokens.iter().enumerate().take(to).skip(from) {
        write_position(pool, seq, pos, mix(acc, token_word(t, pos)))?;
        acc = fold(pool, seq, pos, pos + 1, acc, faults);
    }
    seq.commit(pool, to - from)?;
    Ok((to == tokens.len()).then(|| token_of(acc)))
}

/// One generating sequence, stepped as the engine steps one.
#[derive(Debug)]
struct Gen {
    kv: SequenceKv,
    /// When it joined the loop (the newest is retracted first).
    order: u64,
    /// Prompt tokens the client sent (the verified prompt ends with `resumed` generated
    /// tokens).
    prompt_tokens: u32,
    /// Every token generated, an earlier attempt's included.
    history: Vec<u32>,
    max_tokens: u32,
    /// The last token, to be fed at the next step; None once finished.
    next: Option<u32>,
}

impl Growing for Gen {
    fn kv(&mut self) -> &mut SequenceKv {
        &mut self.kv
    }
    fn kv_ref(&self) -> &SequenceKv {
        &self.kv
    }
    fn decoding(&self) -> bool {
        self.next.is_some()
    }
    fn order(&self) -> u64 {
        self.order
    }
}

impl Gen {
    /// A sequence over `kv` whose prompt ends with `resume` (tokens an earlier attempt
    /// generated), with `max_tokens` left to generate.
    fn new(kv: SequenceKv, order: u64, max_tokens: u32, resume: &[u32]) -> Self {
        let prompt_tokens = (kv.len() - resume.len()) as u32;
        Gen { kv, order, prompt_tokens, history: resume.to_vec(), max_tokens: max_tokens + resume.len() as u32, next: None }
    }

    /// Takes a generated token as the engine does (`Engine::on_token`): an
    /// end-of-generation token ends the request unshown, any other is shown, and the
    /// request ends at `max_tokens`. Pushes the events; true when finished.
    fn on_token(&mut self, token: u32, events: &mut Vec<GenEvent>) -> bool {
        let req = self.kv.owner();
        self.history.push(token);
        let finish = if is_eog(token) {
            Some(FinishReason::Stop)
        } else {
            events.push(GenEvent::Token { req, token, text: format!("{token} "), logprobs: None });
            (self.history.len() as u32 >= self.max_tokens).then_some(FinishReason::Length)
        };
        match finish {
            Some(finish) => {
                events.push(GenEvent::Finished {
                    req,
                    finish,
                    text: String::new(),
                    prompt_tokens: self.prompt_tokens,
                    completion_tokens: self.history.len() as u32,
                });
                true
            }
            None => {
                self.next = Some(token);
                false
            }
        }
    }

    /// Feeds the last token at the next position and takes the token read off every slot.
    /// A sequence with no slot for it (the pool is held elsewhere) waits.
    ///
    /// Speculating (`spec`), it also feeds up to `spec.drafts` drafts in the positions after,
    /// as the engine does: in slots it holds, or leases while `spec.may_lease`. The mock has
    /// no proposer: each draft is the token the row before gives (what a perfect one would
    /// propose) or, by a coin of the sequence and position, another one, so rejections fall
    /// at every position. Verification and the roll-back are the driver core's, as in the
    /// engine; `spec.keep_rejected` skips the roll-back (a planted bug).
    fn step(&mut self, pool: &mut KvPool, faults: &mut u64, events: &mut Vec<GenEvent>, spec: Spec) -> Result<bool, KvError> {
        let pos = self.kv.len();
        if self.kv.reserved_tokens() <= pos {
            return Ok(false);
        }
        let Some(token) = self.next.take() else { return Ok(true) };
        let room = (self.max_tokens as usize).saturating_sub(self.history.len() + 1);
        let k = spec.drafts.min(room);
        if k > 0 && spec.may_lease && self.kv.reserved_tokens() < pos + 1 + k {
            let _ = self.kv.reserve(pool, pos + 1 + k);
        }
        let k = k.min(self.kv.reserved_tokens() - pos - 1);
        // Row j feeds `fed[j]` at position pos + j and reads every slot up to it.
        let mut acc = fold(pool, &self.kv, 0, pos, START, faults);
        let (mut fed, mut rows) = (vec![token], Vec::with_capacity(k + 1));
        for j in 0..=k {
            write_position(pool, &self.kv, pos + j, mix(acc, token_word(fed[j], pos + j)))?;
            acc = fold(pool, &self.kv, pos + j, pos + j + 1, acc, faults);
            rows.push(acc);
            if j < k {
                let right = token_of(acc);
                let coin = mix(self.kv.owner().0, (pos + j) as u64) % 3;
                fed.push(if coin == 0 { (right + 1) % VOCAB } else { right });
            }
        }
        self.kv.commit(pool, k + 1)?;
        let checked = check_reads(pool, &mut self.kv, 0, faults);
        let mut verify = Verification::new(fed.split_off(1));
        let mut done = false;
        while let Some(row) = verify.next_row() {
            // A failed read check spoils every row, as it would the one row of a step.
            let t = token_of(if checked == 0 { rows[row] } else { mix(rows[row], checked) });
            done = self.on_token(t, events);
            verify.emitted(t, done);
        }
        if !spec.keep_rejected {
            verify.settle(pool, &mut self.kv)?;
        }
        Ok(done)
    }
}

/// How a mock decode step speculates.
#[derive(Clone, Copy, Debug, Default)]
struct Spec {
    /// Most drafts per sequence and step (0: none).
    drafts: usize,
    /// Whether a page may be leased for drafts (every decoding sequence could still grow).
    may_lease: bool,
    /// The planted bug: rejected drafts' KV is left in place.
    keep_rejected: bool,
}

/// Drafts per step of the mock's decode loop: speculation runs in every schedule.
const MOCK_DRAFTS: usize = 3;

/// The mock's prefill compute.
#[derive(Debug)]
pub struct MockPrefill {
    faults: u64,
}

impl PrefillCompute for MockPrefill {
    type Error = ModelFault;
    fn compute(&mut self, pool: &mut KvPool, chunks: &mut [Chunk<'_>]) -> Result<Vec<Option<First>>, ModelFault> {
        chunks.iter_mut().map(|c| Ok(prefill(pool, c.seq, c.tokens, c.from, c.to, &mut self.faults)?.map(|t| (t, None)))).collect()
    }
}

impl PrefillModel for MockPrefill {
    fn read_faults(&self) -> u64 {
        self.faults
    }
}

/// The mock's decode loop, with KV on demand ([`make_room`]).
#[derive(Debug)]
pub struct MockDecode {
    pool: KvPool,
    seqs: Vec<Gen>,
    next_order: u64,
    faults: u64,
    retractions: u64,
    /// Finished sequences go to the driver (the decode-side cache) instead of the pool.
    keep_finished: bool,
    retired: Vec<Retired>,
    /// The planted bug of [`Sabotage::KeepRejectedDrafts`](crate::Sabotage).
    keep_rejected: bool,
}

impl MockDecode {
    /// A request joins the loop once `first` has its prompt in place and its first token
    /// (as the engine: something to generate, and a prompt longer than what it resumes).
    fn join(
        &mut self,
        mut kv: SequenceKv,
        max_tokens: u32,
        resume: &[u32],
        first: impl FnOnce(&mut KvPool, &mut SequenceKv) -> Result<u32, ModelFault>,
    ) -> Result<Vec<GenEvent>, ModelFault> {
        let picked = if max_tokens == 0 { Err(ModelFault("0 max tokens".into())) } else { first(&mut self.pool, &mut kv) };
        let checked = match picked {
            Ok(t) if resume.len() < kv.len() => Ok(t),
            Ok(_) => Err(ModelFault(format!("{max_tokens} max tokens, {} resumed of {} prompt tokens", resume.len(), kv.len()))),
            Err(e) => Err(e),
        };
        let first_token = match checked {
            Ok(t) => t,
            Err(e) => {
                kv.release(&mut self.pool).map_err(|u| u.error)?;
                return Err(e);
            }
        };
        self.next_order += 1;
        let mut g = Gen::new(kv, self.next_order, max_tokens, resume);
        let mut events = Vec::new();
        if g.on_token(first_token, &mut events) {
            self.finished(g)?;
        } else {
            self.seqs.push(g);
        }
        Ok(events)
    }

    /// A finished sequence: to the driver for the decode-side cache, or back to the pool.
    fn finished(&mut self, g: Gen) -> Result<(), ModelFault> {
        if self.keep_finished {
            self.retired.push(Retired { seq: g.kv, generated: g.history });
            return Ok(());
        }
        g.kv.release(&mut self.pool).map_err(|u| u.error)?;
        Ok(())
    }
}

impl DecodeEngine for MockDecode {
    type Error = ModelFault;
    fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }
    fn add_verified(&mut self, start: DecodeStart) -> Result<Vec<GenEvent>, ModelFault> {
        let kv = start.seq.into_sequence();
        self.join(kv, start.max_tokens, &start.resume, |_, _| Ok(start.first_token))
    }

    /// The rest of the prompt computed here, as a prefill worker computes it (so the same
    /// tokens follow), in one go rather than over the next steps.
    fn add_local(&mut self, start: LocalStart) -> Result<Vec<GenEvent>, ModelFault> {
        let kv = start.seq.into_sequence();
        let tokens = start.tokens;
        self.join(kv, start.max_tokens, &start.resume, |pool, kv| {
            let from = kv.len();
            let mut faults = 0;
            let first = prefill(pool, kv, &tokens, from, tokens.len(), &mut faults)?;
            first.ok_or_else(|| ModelFault(format!("no first token after computing {from}..{}", tokens.len())))
        })
    }

    fn step(&mut self) -> Result<Vec<GenEvent>, ModelFault> {
        let mut events = Vec::new();
        for g in make_room(&mut self.pool, &mut self.seqs)? {
            self.retractions += 1;
            events.push(GenEvent::Retracted { req: g.kv.owner(), tokens: g.history });
        }
        let mut done = Vec::new();
        let decoding = self.seqs.iter().filter(|g| g.next.is_some()).count();
        for (i, g) in self.seqs.iter_mut().enumerate() {
            let may_lease = self.pool.stats().free_pages > decoding;
            let spec = Spec { drafts: MOCK_DRAFTS, may_lease, keep_rejected: self.keep_rejected };
            if g.step(&mut self.pool, &mut self.faults, &mut events, spec)? {
                done.push(i);
            }
        }
        for i in done.into_iter().rev() {
            let g = self.seqs.remove(i);
            self.finished(g)?;
        }
        Ok(events)
    }

    fn abort(&mut self, req: RequestId) {
        if let Some(i) = self.seqs.iter().position(|g| g.kv.owner() == req) {
            let g = self.seqs.remove(i);
            // A live sequence's leases are valid; if not, they stay leased and the
            // end-of-schedule pool check reports them.
            let _ = g.kv.release(&mut self.pool);
        }
    }

    fn active(&self) -> usize {
        self.seqs.len()
    }

    fn keep_finished(&mut self) {
        self.keep_finished = true;
    }

    fn take_retired(&mut self) -> Vec<Retired> {
        std::mem::take(&mut self.retired)
    }

    // A local prompt is computed as it joins (`add_local`).
    fn lend_computed(&mut self, req: RequestId, f: &mut dyn FnMut(&mut KvPool, &mut SequenceKv)) -> bool {
        let Some(g) = self.seqs.iter_mut().find(|g| g.kv.owner() == req) else { return false };
        f(&mut self.pool, &mut g.kv);
        true
    }
}

impl DecodeModel for MockDecode {
    fn pool(&self) -> &KvPool {
        &self.pool
    }
    fn retractions(&self) -> u64 {
        self.retractions
    }
    fn read_faults(&self) -> u64 {
        self.faults
    }
    fn keep_rejected_drafts(&mut self) {
        self.keep_rejected = true;
    }
}

/// What `prompt` produces on the mock, run alone on a fresh private pool of `layout`.
pub fn reference(layout: KvLayout, prompt: &[u32], max_tokens: u32) -> Result<Expected, ModelFault> {
    let total = prompt.len() + max_tokens as usize;
    let mut pool = KvPool::new(PoolConfig { layout, pages: layout.pages_for_tokens(total).max(1), checks: KvChecks::all() })?;
    let mut kv = SequenceKv::new(RequestId(0));
    kv.reserve(&mut pool, total)?;
    let mut faults = 0;
    let Some(first) = prefill(&mut pool, &mut kv, prompt, 0, prompt.len(), &mut faults)? else {
        return Err(ModelFault("an empty prompt has no reference".into()));
    };
    let mut g = Gen::new(kv, 0, max_tokens, &[]);
    let mut events = Vec::new();
    let mut done = g.on_token(first, &mut events);
    while !done {
        done = g.step(&mut pool, &mut faults, &mut events, Spec::default())?;
    }
    if faults > 0 {
        return Err(ModelFault(format!("{faults} faulty reads on a private pool")));
    }
    Expected::from_events(&events).ok_or_else(|| ModelFault("the reference did not finish".into()))
}

/// The mock model family: small random layouts, small pools.
#[derive(Debug, Clone, Copy, Default)]
pub struct MockModels;

impl Models for MockModels {
    type Prefill = MockPrefill;
    type Decode = MockDecode;

    fn shape(&self) -> Shape {
        let layouts = [(1, 1, 2, 2), (2, 1, 2, 4), (2, 2, 1, 3), (3, 1, 4, 8), (1, 2, 2, 1)]
            .map(|(layers, kv_heads, head_dim, page_size)| KvLayout { layers, kv_heads, head_dim, page_size })
            .to_vec();
        Shape {
            layouts,
            vocab: VOCAB,
            model_context: 64,
            max_requests: 8,
            max_prompt: 40,
            max_generate: 12,
            decode_pages: (3, 40),
            prefill_pages: (2, 24),
        }
    }

    fn prefill(&self) -> MockPrefill {
        MockPrefill { faults: 0 }
    }

    fn decode(&self, pool: KvPool, _max_context: usize) -> MockDecode {
        let retired = Vec::new();
        MockDecode { pool, seqs: Vec::new(), next_order: 0, faults: 0, retractions: 0, keep_finished: false, retired, keep_rejected: false }
    }

    /// The mock picks no tokens: its output does not depend on `sampling`.
    fn reference(&self, layout: KvLayout, prompt: &[u32], max_tokens: u32, _: &Sampling) -> Result<Expected, ModelFault> {
        reference(layout, prompt, max_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAYOUT: KvLayout = KvLayout { layers: 2, kv_heads: 1, head_dim: 2, page_size: 4 };

    fn pool(pages: usize) -> KvPool {
        KvPool::new(PoolConfig { layout: LAYOUT, pages, checks: KvChecks::all() }).unwrap()
    }

    #[test]
    fn a_prompt_computed_in_chunks_gives_the_same_first_token_as_whole() {
        let tokens: Vec<u32> = (0..11).map(|i| 1000 + i * 7).collect();
        let mut whole = None;
        for chunk in [11, 1, 3, 4, 5] {
            let mut p = pool(8);
            let mut seq = SequenceKv::new(RequestId(1));
            seq.reserve(&mut p, tokens.len()).unwrap();
            let (mut faults, mut from, mut first) = (0, 0, None);
            while from < tokens.len() {
                let to = (from + chunk).min(tokens.len());
                first = prefill(&mut p, &mut seq, &tokens, from, to, &mut faults).unwrap();
                from = to;
            }
            assert_eq!(faults, 0);
            assert!(first.is_some());
            assert_eq!(*whole.get_or_insert(first), first, "chunk {chunk}");
            seq.release(&mut p).unwrap();
        }
    }

    /// The property the harness rests on: the output depends on every slot. Overwrite one
    /// prompt slot with another request's KV (through a fresh lease of the same page) and
    /// the first token changes.
    #[test]
    fn one_foreign_slot_changes_the_first_token() {
        let tokens: Vec<u32> = (0..6).map(|i| 40 + i).collect();
        let first = |foreign_at: Option<usize>| {
            let mut p = pool(8);
            let mut seq = SequenceKv::new(RequestId(1));
            seq.reserve(&mut p, 6).unwrap();
            let mut faults = 0;
            prefill(&mut p, &mut seq, &tokens, 0, 6, &mut faults).unwrap();
            let Some(pos) = foreign_at else {
                let acc = fold(&p, &seq, 0, 6, START, &mut faults);
                return token_of(acc);
            };
            // Rebuild the sequence with `pos` written for another prompt.
            let mut other = SequenceKv::new(RequestId(2));
            other.reserve(&mut p, 6).unwrap();
            let mut acc = START;
            for (q, &t) in tokens.iter().enumerate() {
                let t = if q == pos { 9_999 } else { t };
                write_position(&mut p, &other, q, mix(acc, token_word(t, q))).unwrap();
                acc = fold(&p, &other, q, q + 1, acc, &mut faults);
            }
            assert_eq!(faults, 0);
            token_of(acc)
        };
        let clean = first(None);
        for pos in 0..6 {
            assert_ne!(first(Some(pos)), clean, "a foreign slot at position {pos} went unnoticed");
        }
    }

    #[test]
    fn a_slot_read_past_the_watermark_counts_as_a_fault_and_changes_the_fold() {
        let mut p = pool(4);
        let mut seq = SequenceKv::new(RequestId(1));
        seq.reserve(&mut p, 8).unwrap();
        let mut faults = 0;
        prefill(&mut p, &mut seq, &[5, 6, 7], 0, 3, &mut faults).unwrap();
        let three = fold(&p, &seq, 0, 3, START, &mut faults);
        assert_eq!(faults, 0);
        let four = fold(&p, &seq, 0, 4, START, &mut faults);
        assert_eq!(faults, LAYOUT.layers as u64, "position 3 was never written, in any layer");
        assert_eq!(four, mix(mix(three, MISSING), MISSING));
        assert_ne!(four, three);
    }

    #[test]
    fn the_reference_is_deterministic_and_depends_on_the_prompt() {
        let a = reference(LAYOUT, &[1, 2, 3, 4, 5], 8).unwrap();
        assert_eq!(a, reference(LAYOUT, &[1, 2, 3, 4, 5], 8).unwrap());
        assert_ne!(a, reference(LAYOUT, &[1, 2, 3, 4, 6], 8).unwrap());
        assert!(a.completion_tokens >= 1 && a.completion_tokens <= 8);
    }
}
