//! Picking one sequence's next token from the model's logits, as its [`Sampling`] says:
//! the log-probabilities it asked for come from the model's own logits; the penalties,
//! `logit_bias`, `min_tokens` and the grammar's mask change a copy of them; `min_p` and the
//! [`Sampler`] (temperature, top-k, top-p, seeded draw) pick from that copy (vLLM's order).
//!
//! A [`Chooser`] belongs to one sequence and follows every token it generates, wherever it
//! was picked: the prefill worker's first token and a retracted request's earlier tokens
//! are [`Chooser::replay`]ed, so the penalties' counts, the grammar's state and the seeded
//! draws carry on as if one sampler had picked them all.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use bulkhead_grammar::{GrammarError, Grammars, Matcher};
use bulkhead_protocol::{Sampling, TokenLogprobs};
use bulkhead_tokenizer::Tokenizer;

use crate::sampling::{Sampler, SamplingError, exp_neg, top_k_into};

/// Why a token could not be picked. It fails the one request, never the worker.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ChooseError {
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Grammar(#[from] GrammarError),
    #[error("the grammar allows no token here")]
    NothingAllowed,
}

/// What choosers over one vocabulary share: the tokenizer (its end-of-generation ids) and
/// the grammar vocabulary, built on the first request that has a grammar.
pub struct Vocabulary {
    tokenizer: Arc<Tokenizer>,
    grammars: OnceLock<Result<Grammars, GrammarError>>,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary").field("vocab", &self.tokenizer.vocab_size()).finish_non_exhaustive()
    }
}

impl Vocabulary {
    /// Choosers over `tokenizer`'s vocabulary.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Vocabulary { tokenizer, grammars: OnceLock::new() }
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The grammar vocabulary (built once, on first use).
    pub fn grammars(&self) -> Result<&Grammars, GrammarError> {
        self.grammars.get_or_init(|| Grammars::new(Arc::clone(&self.tokenizer))).as_ref().map_err(Clone::clone)
    }

    /// A chooser for one sequence under `sampling`; `prompt` is the prompt's tokens when the
    /// repetition penalty needs them (it may be empty otherwise).
    pub fn chooser(&self, sampling: Sampling, prompt: &[u32]) -> Result<Chooser, ChooseError> {
        let matcher = match &sampling.grammar {
            Some(spec) => Some(self.grammars()?.matcher(spec)?),
            None => None,
        };
        let mut ends: Vec<u32> = self.tokenizer.eog_ids().iter().chain(&sampling.stop_token_ids).copied().collect();
        ends.sort_unstable();
        ends.dedup();
        let seen = if sampling.needs_prompt() { prompt.iter().map(|&t| (t, 0)).collect() } else { HashMap::new() };
        Ok(Chooser { sampler: Sampler::new(sampling)?, matcher, seen, generated: 0, ends, scratch: Vec::new(), top: Vec::new() })
    }
}

/// The token picked, and its log-probabilities if the request asked for them.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// The token.
    pub token: u32,
    /// Its log-probability and the most likely alternatives, under the model's logits.
    pub logprobs: Option<TokenLogprobs>,
}

/// One sequence's token picker (see the module docs).
pub struct Chooser {
    sampler: Sampler,
    matcher: Option<Matcher>,
    /// Every token of the prompt (0) or generated so far (how often), for the penalties.
    seen: HashMap<u32, u32>,
    /// Tokens generated so far.
    generated: usize,
    /// End-of-generation and stop tokens, ascending: what `min_tokens` holds back.
    ends: Vec<u32>,
    scratch: Vec<f32>,
    top: Vec<(f32, u32)>,
}

impl std::fmt::Debug for Chooser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chooser").field("params", self.sampler.params()).field("generated", &self.generated).finish_non_exhaustive()
    }
}

impl Chooser {
    /// The request's settings.
    pub fn params(&self) -> &Sampling {
        self.sampler.params()
    }

    /// Whether `token` ends the generation by itself: one of `stop_token_ids`.
    pub fn is_stop_token(&self, token: u32) -> bool {
        self.sampler.params().stop_token_ids.contains(&token)
    }

    /// Whether the grammar is complete: the output must end here.
    pub fn grammar_done(&self) -> bool {
        self.matcher.as_ref().is_some_and(Matcher::is_stopped)
    }

    /// Follow a token picked elsewhere (by the prefill worker, or before a retraction), as if
    /// this chooser had picked it: its seeded draw is skipped, the penalties count it and
    /// the grammar consumes it.
    pub fn replay(&mut self, token: u32) -> Result<(), ChooseError> {
        self.sampler.skip_draw();
        self.accept(token)
    }

    fn accept(&mut self, token: u32) -> Result<(), ChooseError> {
        self.generated += 1;
        let p = self.sampler.params();
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 || p.needs_prompt() {
            *self.seen.entry(token).or_insert(0) += 1;
        }
        if let Some(m) = self.matcher.as_mut() {
            m.consume(token)?;
        }
        Ok(())
    }

    /// Pick the next token from `logits` (one per vocabulary id) and follow it.
    pub fn choose(&mut self, logits: &[f32]) -> Result<Choice, ChooseError> {
        let logprobs = self.sampler.params().logprobs.map(|n| (n, log_normaliser(logits)));
        let changed = self.adjust(logits)?;
        let token = self.sampler.sample(if changed { &self.scratch } else { logits })?;
        let logprobs = logprobs.map(|(n, norm)| {
            let lp = |id: u32| logits.get(id as usize).map_or(f32::NEG_INFINITY, |&l| (f64::from(l) - norm) as f32);
            let top = if n == 0 {
                Vec::new()
            } else {
                top_k_into(logits, usize::from(n), &mut self.top);
                self.top.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                self.top.iter().map(|&(_, id)| (id, lp(id))).collect()
            };
            TokenLogprobs { logprob: lp(token), top }
        });
        self.accept(token)?;
        Ok(Choice { token, logprobs })
    }

    /// Write the changed logits into `scratch`, if anything changes them; whether it did.
    fn adjust(&mut self, logits: &[f32]) -> Result<bool, ChooseError> {
        let p = self.sampler.params();
        let hold_ends = self.generated < p.min_tokens as usize && !self.ends.is_empty();
        let min_p = p.min_p > 0.0 && !p.is_greedy();
        let penalties = p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 || p.needs_prompt();
        if !(penalties || hold_ends || min_p || !p.logit_bias.is_empty() || self.matcher.is_some()) {
            return Ok(false);
        }
        let s = &mut self.scratch;
        s.clear();
        s.extend_from_slice(logits);
        if penalties {
            let (rep, freq, pres) = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty);
            for (&tok, &count) in &self.seen {
                let Some(l) = s.get_mut(tok as usize) else { continue };
                if rep != 1.0 {
                    *l = if *l > 0.0 { *l / rep } else { *l * rep };
                }
                if count > 0 {
                    *l -= freq * count as f32 + pres;
                }
            }
        }
        for &(tok, bias) in &p.logit_bias {
            if let Some(l) = s.get_mut(tok as usize) {
                *l += bias;
            }
        }
        if hold_ends {
            for &t in &self.ends {
                if let Some(l) = s.get_mut(t as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if let Some(m) = self.matcher.as_mut() {
            let mask = m.mask()?;
            if mask.count() == 0 {
                return Err(ChooseError::NothingAllowed);
            }
            mask.apply(s);
        }
        if min_p {
            // p_i / p_max < min_p  <=>  l_i < l_max + T ln(min_p).
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let cut = max + p.temperature * p.min_p.ln();
            for l in s.iter_mut() {
                if *l < cut {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        Ok(true)
    }
}

/// `ln Σ exp(l)` over the finite logits, in f64: a token's log-probability is its logit
/// minus this.
fn log_normaliser(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().filter(|l| l.is_finite()).fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return f64::INFINITY;
    }
    // exp_neg is the sampler's vectorising exp, accurate to about 1 ulp on [-87, 0]; what
    // falls below is negligible against the maximum's 1.
    let sum: f64 = logits.iter().map(|&l| if l.is_finite() && l - max >= -87.0 { f64::from(exp_neg(l - max)) } else { 0.0 }).sum();
    f64::from(max) + sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn softmax_log(logits: &[f32], id: usize) -> f64 {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let z: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
        logits[id] as f64 - max - z.ln()
    }

    #[test]
    fn the_normaliser_agrees_with_a_direct_log_softmax() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let norm = log_normaliser(&logits);
        for id in [0, 5, 999, 512] {
            let ours = logits[id] as f64 - norm;
            assert!((ours - softmax_log(&logits, id)).abs() < 1e-5, "{id}: {ours}");
        }
    }
}
