//! Speculation's second proposer: a smaller model of the same tokenizer drafts the next
//! tokens of each sequence, greedily, in its own KV pool.
//!
//! The draft model's KV is a sequence's like any other (leased from its own pool, one
//! layout per pool), so the same rules hold for it: it is written only at positions of the
//! sequence's own tokens, rolled back to what the target emitted once a step's verification
//! is settled ([`DraftModel::settle`]: a rejected draft's KV is un-written before anything
//! reads it, I2 amended), and given back when the sequence leaves the loop. Drafts are only
//! ever proposals: the target's step verifies each one with its usual draw, so a wrong or
//! failed draft costs time, never a token.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use bulkhead_kv::{KvError, KvPool, PoolConfig, RequestId, SequenceKv};
use bulkhead_model::{Llama, ModelError, SeqInput};
use bulkhead_tokenizer::Tokenizer;

use crate::sampling::argmax;
use crate::speculate::{MAX_SPECULATIVE_BATCH, MAX_SPECULATIVE_TOKENS};

/// Why a draft model cannot draft for a target.
#[derive(Debug, thiserror::Error)]
pub enum DraftError {
    /// Vocabularies of different sizes: a draft's ids would mean other tokens.
    #[error("the draft model's vocabulary has {draft} tokens, the target's {target}: a draft needs the target's tokenizer")]
    VocabularySize { draft: usize, target: usize },
    /// One id stands for another token in each model.
    #[error("token {id} is {draft:?} in the draft model and {target:?} in the target: a draft needs the target's tokenizer")]
    Token { id: u32, draft: String, target: String },
    /// The logits of the model differ from its vocabulary (a broken file).
    #[error("the draft model computes {logits} logits for a vocabulary of {vocab} tokens")]
    Logits { logits: usize, vocab: usize },
    /// Its pool cannot hold one sequence of the longest request (I5).
    #[error("the draft model's KV pool holds {capacity} tokens, fewer than one request of {context}")]
    Capacity { capacity: usize, context: usize },
    #[error(transparent)]
    Kv(#[from] KvError),
}

/// One sequence's KV in the draft model, and the token at each of its positions.
struct DraftSeq {
    kv: SequenceKv,
    /// `fed[i]` is the token whose KV is at position `i` (`fed.len() == kv.len()`).
    fed: Vec<u32>,
}

impl DraftSeq {
    /// Keep only the positions whose tokens begin `context` (at most `keep`): the rest,
    /// drafts the target did not emit, are un-written ([`SequenceKv::roll_back`]).
    fn roll_back_to(&mut self, pool: &mut KvPool, context: &[u32], keep: usize) -> Result<(), KvError> {
        let common = self.fed.iter().zip(context).take_while(|(a, b)| a == b).count().min(keep);
        if common < self.fed.len() {
            self.kv.roll_back(pool, common)?;
            self.fed.truncate(common);
        }
        Ok(())
    }
}

/// A draft model and its KV pool, beside a target's decode loop.
pub struct DraftModel {
    model: Arc<Llama>,
    pool: KvPool,
    seqs: BTreeMap<RequestId, DraftSeq>,
    /// Most catch-up tokens (a prompt the draft has not read, or a long accepted run) fed
    /// per step over all sequences; a longer catch-up is spread over steps.
    catch_up: usize,
    logits: Vec<f32>,
    /// Seconds of the last [`DraftModel::propose`] and how many rounds it ran.
    last: (f64, usize),
}

impl DraftModel {
    /// A draft model for a target of `target`'s tokenizer, with a pool of `pages` pages of
    /// `page_size` tokens (checked the way the pool is). Refused when the tokenizers differ
    /// (the first differing token is named) or the pool cannot hold one request of
    /// `context` tokens.
    pub fn new(
        model: Arc<Llama>,
        tokenizer: &Tokenizer,
        target: &Tokenizer,
        page_size: usize,
        tokens: usize,
        context: usize,
        checks: bulkhead_kv::KvChecks,
    ) -> Result<Self, DraftError> {
        same_tokenizer(tokenizer, target)?;
        if model.config.vocab != tokenizer.vocab_size() {
            return Err(DraftError::Logits { logits: model.config.vocab, vocab: tokenizer.vocab_size() });
        }
        let layout = model.kv_layout(page_size);
        let pool = KvPool::new(PoolConfig { layout, pages: layout.pages_for_tokens(tokens.max(1)), checks })?;
        if pool.capacity_tokens() < context {
            return Err(DraftError::Capacity { capacity: pool.capacity_tokens(), context });
        }
        model.reserve_attention(context, page_size);
        Ok(DraftModel { model, pool, seqs: BTreeMap::new(), catch_up: crate::DEFAULT_PREFILL_CHUNK, logits: Vec::new(), last: (0.0, 0) })
    }

    /// Tokens a draft pool should hold for requests of `context` tokens: enough for every
    /// sequence that may draft at once.
    pub fn pool_tokens(context: usize) -> usize {
        context.saturating_mul(MAX_SPECULATIVE_BATCH)
    }

    /// The draft model's pool, for statistics.
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// Seconds the last proposal took, and its rounds of the draft model.
    pub(crate) fn last_cost(&self) -> (f64, usize) {
        self.last
    }

    /// Draft up to `want.k` tokens after each `want.context` (a sequence's tokens, the
    /// last one not yet fed to the target), into `out` (one list per want, in order; empty
    /// where nothing could be drafted this step). A sequence whose catch-up exceeds this
    /// step's share drafts nothing until it has caught up.
    pub(crate) fn propose(&mut self, wants: &[Want<'_>], out: &mut Vec<Vec<u32>>) {
        let started = Instant::now();
        out.clear();
        out.resize_with(wants.len(), Vec::new);
        // Round 0 feeds what each sequence's draft KV lacks and drafts one token; each
        // further round feeds the last draft and drafts the next.
        let mut feeding: Vec<(usize, Vec<u32>)> = Vec::new();
        let mut budget = self.catch_up;
        for (w, want) in wants.iter().enumerate() {
            let Some(missing) = self.sync(want, wants) else { continue };
            if missing.len() > budget {
                // Catch up by a chunk without drafting.
                let chunk = missing[..budget].to_vec();
                budget = 0;
                if !chunk.is_empty() {
                    let _ = self.run(&mut [(want.id, chunk)], 0);
                }
                continue;
            }
            budget -= missing.len();
            feeding.push((w, missing));
        }
        let mut rounds = 0;
        while !feeding.is_empty() {
            let mut batch: Vec<(RequestId, Vec<u32>)> = feeding.iter().map(|(w, t)| (wants[*w].id, t.clone())).collect();
            let Some(picks) = self.run(&mut batch, 1) else { break };
            rounds += 1;
            feeding = feeding
                .into_iter()
                .zip(picks)
                .filter_map(|((w, _), pick)| {
                    let pick = pick?;
                    out[w].push(pick);
                    // The k-th draft is not fed: nothing verifies a draft after it.
                    (out[w].len() < wants[w].k).then(|| (w, vec![pick]))
                })
                .collect();
        }
        self.last = (started.elapsed().as_secs_f64(), rounds);
    }

    /// Roll `want`'s draft KV back to what it shares with its context and lease what this
    /// step writes; the tokens it still has to feed, or `None` where it cannot draft now
    /// (no pages, even after evicting the draft KV of sequences not drafting).
    fn sync(&mut self, want: &Want<'_>, wants: &[Want<'_>]) -> Option<Vec<u32>> {
        let context = want.context;
        if context.is_empty() || want.k == 0 {
            return None;
        }
        let mut s = match self.seqs.remove(&want.id) {
            Some(s) => s,
            None => DraftSeq { kv: SequenceKv::new(want.id), fed: Vec::new() },
        };
        // The last token is fed again where the draft KV already holds it: its logits draft.
        if s.roll_back_to(&mut self.pool, context, context.len() - 1).is_err() {
            self.forget_seq(s);
            return None;
        }
        // Positions written this step: the context and every draft fed after it.
        let need = context.len() + want.k.min(MAX_SPECULATIVE_TOKENS) - 1;
        if s.kv.reserve(&mut self.pool, need).is_err() {
            // Sequences not drafting now give their draft KV back; they catch up later.
            let idle: Vec<RequestId> = self.seqs.keys().filter(|id| !wants.iter().any(|w| w.id == **id)).copied().collect();
            for id in idle {
                self.forget(id);
            }
            if s.kv.reserve(&mut self.pool, need).is_err() {
                self.forget_seq(s);
                return None;
            }
        }
        let missing = context[s.fed.len()..].to_vec();
        self.seqs.insert(want.id, s);
        Some(missing)
    }

    /// One forward call of the draft model over `batch` (each sequence's tokens at its next
    /// positions), asking `rows` (0 or 1) logit rows each; the greedy pick of each, or
    /// `None` for the whole call where it failed (its sequences are given back: they catch
    /// up from scratch).
    fn run(&mut self, batch: &mut [(RequestId, Vec<u32>)], rows: usize) -> Option<Vec<Option<u32>>> {
        let mut taken: Vec<DraftSeq> = batch.iter().filter_map(|(id, _)| self.seqs.remove(id)).collect();
        if taken.len() != batch.len() {
            for s in taken {
                self.forget_seq(s);
            }
            return None;
        }
        let mut logits = std::mem::take(&mut self.logits);
        let ran = {
            let mut inputs: Vec<SeqInput<'_>> =
                taken.iter_mut().zip(batch.iter()).map(|(s, (_, t))| SeqInput { kv: &mut s.kv, tokens: t, logit_rows: rows }).collect();
            self.model.forward_into(&mut self.pool, &mut inputs, &mut logits)
        };
        let picks = match ran {
            Ok(()) => {
                let vocab = self.model.config.vocab;
                let picks = (0..batch.len())
                    .map(|i| if rows == 0 { None } else { logits.chunks_exact(vocab).nth(i).and_then(argmax).map(|(t, _)| t) })
                    .collect();
                for (mut s, (id, t)) in taken.into_iter().zip(batch.iter()) {
                    s.fed.extend_from_slice(t);
                    self.seqs.insert(*id, s);
                }
                Some(picks)
            }
            Err(e) => {
                // A draft never fails its request: its sequences start their draft KV over.
                let read_check = matches!(e, ModelError::ReadCheck { .. });
                tracing::warn!(error = %e, read_check, "the draft model's step failed; its sequences draft again from scratch");
                for s in taken {
                    self.forget_seq(s);
                }
                None
            }
        };
        self.logits = logits;
        picks
    }

    /// After a verification: `id`'s draft KV keeps only the positions of `context` (the
    /// sequence's tokens, the last emitted one not yet fed anywhere); the drafts the target
    /// rejected are un-written now, as the target's are.
    pub(crate) fn settle(&mut self, id: RequestId, context: &[u32]) {
        let Some(s) = self.seqs.get_mut(&id) else { return };
        if s.roll_back_to(&mut self.pool, context, context.len()).is_err() {
            self.forget(id);
        }
    }

    /// Give back the draft KV of every sequence `live` does not name (it left the loop).
    pub(crate) fn retain(&mut self, live: impl Fn(RequestId) -> bool) {
        let gone: Vec<RequestId> = self.seqs.keys().filter(|id| !live(**id)).copied().collect();
        for id in gone {
            self.forget(id);
        }
    }

    fn forget(&mut self, id: RequestId) {
        if let Some(s) = self.seqs.remove(&id) {
            self.forget_seq(s);
        }
    }

    fn forget_seq(&mut self, s: DraftSeq) {
        if let Err(u) = s.kv.release(&mut self.pool) {
            tracing::error!(request = u.seq.owner().0, error = %u, "releasing a draft sequence");
            u.reclaim(&mut self.pool);
        }
    }
}

/// What one sequence asks of the draft model in a step.
pub(crate) struct Want<'a> {
    pub(crate) id: RequestId,
    /// Its tokens so far; the last is fed to the target this step.
    pub(crate) context: &'a [u32],
    /// Most drafts.
    pub(crate) k: usize,
}

/// Refuse a draft model whose ids stand for other tokens than the target's.
fn same_tokenizer(draft: &Tokenizer, target: &Tokenizer) -> Result<(), DraftError> {
    if draft.vocab_size() != target.vocab_size() {
        return Err(DraftError::VocabularySize { draft: draft.vocab_size(), target: target.vocab_size() });
    }
    for id in 0..target.vocab_size() as u32 {
        let (d, t) = (draft.id_to_token(id), target.id_to_token(id));
        if d != t {
            return Err(DraftError::Token { id, draft: d.unwrap_or_default().to_string(), target: t.unwrap_or_default().to_string() });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_kv::KvChecks;

    fn draft_model() -> (DraftModel, Tokenizer) {
        let p = bulkhead_fetch::ensure_default_model(false).expect("default model");
        let m = crate::load_model(&p, 2).expect("load");
        let tok = m.tokenizer;
        (DraftModel::new(Arc::new(m.model), &tok, &tok, 16, 2048, 512, KvChecks::all()).expect("draft model"), tok)
    }

    fn drafts(d: &mut DraftModel, id: u64, context: &[u32], k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        d.propose(&[Want { id: RequestId(id), context, k }], &mut out);
        out.remove(0)
    }

    #[test]
    fn rejected_drafts_leave_the_draft_kv_before_the_next_round_reads_it() {
        let (mut d, tok) = draft_model();
        let prompt = tok.encode("The capital of France is Paris. The capital of Italy is", true);
        let first = drafts(&mut d, 1, &prompt, 4);
        assert_eq!(first.len(), 4);
        // Three drafts were fed to the draft model (the fourth never is).
        assert_eq!(d.seqs[&RequestId(1)].kv.len(), prompt.len() + 3);
        // The target rejected the first draft and emitted another token instead.
        let other = if first[0] == 42 { 43 } else { 42 };
        let context: Vec<u32> = prompt.iter().copied().chain([other]).collect();
        d.settle(RequestId(1), &context);
        let s = &d.seqs[&RequestId(1)];
        assert_eq!((s.kv.len(), s.fed.as_slice()), (prompt.len(), prompt.as_slice()), "rejected drafts kept in the draft KV");
        // The next drafts are what a draft KV that never saw the rejected ones gives.
        let next = drafts(&mut d, 1, &context, 4);
        let (mut fresh, _) = draft_model();
        assert_eq!(next, drafts(&mut fresh, 1, &context, 4));
        // Gone from the loop: its draft KV goes back.
        d.retain(|_| false);
        assert_eq!(d.pool.stats().free_pages, d.pool.total_pages());
        d.pool.check_invariants();
    }
}
