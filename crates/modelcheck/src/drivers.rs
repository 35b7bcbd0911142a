//! What the model checker plugs into the production driver core
//! ([`bulkhead_protocol::driver`]): the mock model on both sides, and which of the driver
//! core's sabotage policies ([`bulkhead_protocol::driver::sabotage`]) each broken
//! [`Variant`] plants. The transports are in [`crate::world`].

use std::collections::BTreeMap;

use bulkhead_fingerprint::Fingerprint;
use bulkhead_kv::{KvError, KvPool, RequestId, SequenceKv};
use bulkhead_protocol::FinishReason;
use bulkhead_protocol::decode::{DecodeStart, LocalStart, Retired};
use bulkhead_protocol::driver::decode::{DecodeEngine, GenEvent, Growing, Verification, make_room};
use bulkhead_protocol::driver::prefill::{Chunk, First, PrefillCompute};
use bulkhead_protocol::driver::sabotage::{DecodeSabotage, PrefillSabotage};

use crate::config::{LAYOUT, Variant};
use crate::world::{FIRST_TOKEN, Prop, Values};

/// The mock prefill model: position `p` of request `r` holds [`Values::of`]`(r, p)` in
/// every layer, head and element; the first token is [`FIRST_TOKEN`].
#[derive(Debug)]
pub struct MockPrefill<'v> {
    values: &'v Values,
    /// The requests of the last pass that computed more than one job's chunk.
    pub batched: Vec<RequestId>,
}

impl<'v> MockPrefill<'v> {
    /// The mock over `values`.
    pub fn new(values: &'v Values) -> Self {
        MockPrefill { values, batched: Vec::new() }
    }
}

impl PrefillCompute for MockPrefill<'_> {
    type Error = KvError;
    fn compute(&mut self, pool: &mut KvPool, chunks: &mut [Chunk<'_>]) -> Result<Vec<Option<First>>, KvError> {
        if chunks.len() > 1 {
            self.batched = chunks.iter().map(|c| c.seq.owner()).collect();
        }
        let mut firsts = Vec::new();
        for c in chunks {
            for pos in c.from..c.to {
                let row = [self.values.of(c.seq.owner(), pos); LAYOUT.kv_heads * LAYOUT.head_dim];
                let (lease, slot) = c.seq.locate(pos)?;
                for layer in 0..LAYOUT.layers {
                    pool.write(lease, layer, slot, &row, &row)?;
                }
            }
            c.seq.commit(pool, c.to - c.from)?;
            firsts.push((c.to == c.tokens.len()).then_some((FIRST_TOKEN, None)));
        }
        Ok(firsts)
    }
}

/// One sequence in the mock decode loop.
#[derive(Debug, Fingerprint)]
pub struct Running {
    /// Its pages.
    pub seq: SequenceKv,
    /// When it joined the loop (the newest is retracted first).
    order: u64,
    max_tokens: u32,
    /// Tokens generated, an earlier attempt's included (each is [`FIRST_TOKEN`]).
    generated: u32,
}

impl Growing for Running {
    fn kv(&mut self) -> &mut SequenceKv {
        &mut self.seq
    }
    fn kv_ref(&self) -> &SequenceKv {
        &self.seq
    }
    fn decoding(&self) -> bool {
        true
    }
    fn order(&self) -> u64 {
        self.order
    }
}

/// The mock decode loop. It steps one request at a time (the checker chooses which, by
/// setting [`MockDecode::focus`]): write the KV of its last token at the next position
/// (and of drafts after it, when speculating), commit, verify and roll back, and attend
/// over every position through `KvPool::read`, checking each holds the request's own
/// value. What it sees goes into [`MockDecode::seen`] for the properties.
#[derive(Debug)]
pub struct MockDecode {
    /// The worker's pool.
    pub pool: KvPool,
    /// Sequences in the loop.
    pub running: BTreeMap<RequestId, Running>,
    /// The request the next step is for.
    pub focus: Option<RequestId>,
    /// Requests started.
    pub started: Vec<Started>,
    /// Property violations observed by reads and releases.
    pub seen: Vec<(Prop, String)>,
    /// Attend over every reserved slot instead of the written ones (the broken
    /// [`Variant::ReadPastWatermark`]).
    pub read_past_watermark: bool,
    /// Free a victim's pages for a growing sequence but keep the victim in the loop (the
    /// broken [`Variant::KeepRetractedRunning`]).
    keep_retracted_running: bool,
    /// Most drafts a step feeds ([`Config::speculative_tokens`](crate::config::Config)).
    drafts: usize,
    /// Leave rejected drafts' KV in place (the broken [`Variant::KeepRejectedDrafts`]).
    keep_rejected_drafts: bool,
    next_order: u64,
    /// Sequences retracted so far.
    pub retractions: u64,
    values: Values,
    /// Finished sequences go to the driver (the decode-side cache) instead of the pool.
    keep_finished: bool,
    retired: Vec<Retired>,
}

/// A request the mock decode loop started.
#[derive(Clone, Copy, Debug)]
pub struct Started {
    /// Its attempt.
    pub req: RequestId,
    /// Prompt tokens it started with (verified, or computed here).
    pub prompt: usize,
    /// Its sequence's committed length.
    pub committed: usize,
    /// Tokens held in shared (cached) pages.
    pub shared: usize,
    /// Prompt tokens the loop computed itself (`add_local`); 0 for a verified transfer.
    pub computed: usize,
}

impl MockDecode {
    /// An empty loop over `pool`.
    pub fn new(pool: KvPool, variant: Variant, drafts: usize, values: Values) -> Self {
        MockDecode {
            pool,
            running: BTreeMap::new(),
            focus: None,
            started: Vec::new(),
            seen: Vec::new(),
            read_past_watermark: variant == Variant::ReadPastWatermark,
            keep_retracted_running: variant == Variant::KeepRetractedRunning,
            drafts,
            keep_rejected_drafts: variant == Variant::KeepRejectedDrafts,
            next_order: 0,
            retractions: 0,
            values,
            keep_finished: false,
            retired: Vec::new(),
        }
    }

    /// KV on demand before a step: every running sequence whose next position has no
    /// slot grows by a page, the newest retracted to make room ([`make_room`], as the
    /// engine does). Retracted sequences leave the loop with `Retracted`.
    fn grow(&mut self) -> Result<Vec<GenEvent>, KvError> {
        if self.keep_retracted_running {
            return Ok(self.grow_keeping_victims());
        }
        let mut seqs: Vec<Running> = std::mem::take(&mut self.running).into_values().collect();
        let retracted = make_room(&mut self.pool, &mut seqs);
        self.running = seqs.into_iter().map(|r| (r.seq.owner(), r)).collect();
        let mut events = Vec::new();
        for r in retracted? {
            self.retractions += 1;
            events.push(GenEvent::Retracted { req: r.seq.owner(), tokens: vec![FIRST_TOKEN; r.generated as usize] });
        }
        Ok(events)
    }

    /// The broken retraction: the victim's pages are taken back through the pool (which
    /// gives each a new generation) and handed to the grower, but the victim stays in the
    /// loop on its old leases.
    fn grow_keeping_victims(&mut self) -> Vec<GenEvent> {
        let needs: Vec<RequestId> = self.running.iter().filter(|(_, r)| r.seq.reserved_tokens() <= r.seq.len()).map(|(q, _)| *q).collect();
        for req in needs {
            let victim =
                self.running.iter().filter(|(q, r)| **q != req && !r.seq.pages().is_empty()).max_by_key(|(_, r)| r.order).map(|(q, _)| *q);
            let Some(r) = self.running.get_mut(&req) else { continue };
            let want = r.seq.len() + 1;
            if r.seq.reserve(&mut self.pool, want).is_ok() {
                continue;
            }
            if let Some(v) = victim {
                for q in self.pool.revoke_owner(v) {
                    let _ = self.pool.release_quarantined(q);
                }
                self.retractions += 1;
                if let Some(r) = self.running.get_mut(&req) {
                    let _ = r.seq.reserve(&mut self.pool, want);
                }
            }
        }
        Vec::new()
    }

    /// Attention, as the engine does it: every position, every layer, read through
    /// `KvPool::read` with the sequence's own lease.
    fn read_all(&mut self, req: RequestId, seq: &SequenceKv) {
        let positions = if self.read_past_watermark { seq.reserved_tokens() } else { seq.len() };
        if let Err(why) = read_positions(&self.pool, &self.values, req, seq, positions) {
            self.seen.push((Prop::ReadIsolation, why));
        }
    }

    /// A request joins the loop with its prompt in place and its first token picked (by its
    /// prefill, or here); a one-token request ends at once. A resumed one continues the
    /// count of the attempt it resumes.
    fn start(&mut self, req: RequestId, seq: SequenceKv, prompt: usize, computed: usize, max_tokens: u32, resumed: u32) -> Vec<GenEvent> {
        self.started.push(Started { req, prompt, committed: seq.len(), shared: seq.shared_tokens(), computed });
        self.read_all(req, &seq);
        self.next_order += 1;
        let r = Running { seq, order: self.next_order, max_tokens: max_tokens + resumed, generated: resumed + 1 };
        if r.generated < r.max_tokens {
            self.running.insert(req, r);
            return Vec::new();
        }
        vec![self.finish(req, r)]
    }

    /// The request is done: its pages go back, and the gateway hears `Finished`.
    fn finish(&mut self, req: RequestId, r: Running) -> GenEvent {
        let prompt_tokens = (r.seq.len() as u32).saturating_sub(r.generated - 1);
        if self.keep_finished {
            self.retired.push(Retired { seq: r.seq, generated: vec![FIRST_TOKEN; r.generated as usize] });
        } else if let Err(u) = r.seq.release(&mut self.pool) {
            self.seen.push((Prop::SingleLease, format!("releasing finished {req}: {u}")));
        }
        GenEvent::Finished { req, finish: FinishReason::Length, text: String::new(), prompt_tokens, completion_tokens: r.generated }
    }
}

impl DecodeEngine for MockDecode {
    type Error = KvError;

    fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }

    fn add_verified(&mut self, ds: DecodeStart) -> Result<Vec<GenEvent>, KvError> {
        let verified = ds.seq.prompt_tokens();
        Ok(self.start(ds.req, ds.seq.into_sequence(), verified, 0, ds.max_tokens, ds.resume.len() as u32))
    }

    fn add_local(&mut self, ls: LocalStart) -> Result<Vec<GenEvent>, KvError> {
        let (req, prompt) = (ls.req, ls.seq.prompt_tokens());
        let mut seq = ls.seq.into_sequence();
        // The rest of the prompt, computed here: each position written in every layer
        // through the sequence's own lease, then committed (which checks the watermarks).
        let from = seq.len();
        for pos in from..prompt {
            let row = [self.values.of(req, pos); LAYOUT.kv_heads * LAYOUT.head_dim];
            let written = seq
                .locate(pos)
                .and_then(|(lease, slot)| (0..LAYOUT.layers).try_for_each(|layer| self.pool.write(lease, layer, slot, &row, &row)));
            if let Err(e) = written {
                self.seen.push((Prop::ReadIsolation, format!("{req} cannot compute its own prompt position {pos}: {e}")));
            }
        }
        if let Err(e) = seq.commit(&self.pool, prompt - from) {
            self.seen.push((Prop::ReadIsolation, format!("{req} cannot commit its own prompt {from}..{prompt}: {e}")));
        }
        Ok(self.start(req, seq, prompt, prompt - from, ls.max_tokens, ls.resume.len() as u32))
    }

    fn step(&mut self) -> Result<Vec<GenEvent>, KvError> {
        let Some(req) = self.focus.take() else { return Ok(Vec::new()) };
        let mut events = self.grow()?;
        let Some(mut r) = self.running.remove(&req) else { return Ok(events) };
        if r.seq.reserved_tokens() <= r.seq.len() {
            // No page to grow into while reservations hold the pool: wait.
            self.running.insert(req, r);
            return Ok(events);
        }
        // Feed the last token, and drafts in the slots the sequence holds: write their KV
        // at the next positions, commit them, verify, roll the rejected ones back, attend.
        let pos = r.seq.len();
        let room = (r.max_tokens - r.generated - 1) as usize;
        let k = self.drafts.min(r.seq.reserved_tokens() - pos - 1).min(room);
        // The step accepts `a` of its drafts, a different number at each position. An
        // accepted draft's KV is the request's own value there; a rejected one's is not.
        let a = (req.0 as usize + pos / LAYOUT.page_size) % (k + 1);
        let mut drafts = Vec::with_capacity(k);
        for p in pos..=pos + k {
            let own = self.values.of(req, p);
            let (value, token) = if p <= pos + a { (own, FIRST_TOKEN) } else { (-1.0 - own, FIRST_TOKEN + 1) };
            if p > pos {
                drafts.push(token);
            }
            let row = [value; LAYOUT.kv_heads * LAYOUT.head_dim];
            let written = r
                .seq
                .locate(p)
                .and_then(|(lease, slot)| (0..LAYOUT.layers).try_for_each(|layer| self.pool.write(lease, layer, slot, &row, &row)));
            if let Err(e) = written {
                self.seen.push((Prop::ReadIsolation, format!("{req} cannot write its own position {p}: {e}")));
            }
        }
        if let Err(e) = r.seq.commit(&self.pool, k + 1) {
            self.seen.push((Prop::ReadIsolation, format!("{req} cannot commit its own positions {pos}..={}: {e}", pos + k)));
        }
        // Every row picks the request's token; the one after the last accepted draft
        // differs from its draft, which ends verification.
        let mut verify = Verification::new(drafts);
        let mut emitted = 0;
        while verify.next_row().is_some() {
            emitted += 1;
            verify.emitted(FIRST_TOKEN, r.generated + emitted >= r.max_tokens);
        }
        if !self.keep_rejected_drafts
            && let Err(e) = verify.settle(&mut self.pool, &mut r.seq)
        {
            self.seen.push((Prop::ReadIsolation, format!("{req} cannot roll back its rejected drafts: {e}")));
        }
        r.generated += emitted - 1;
        self.read_all(req, &r.seq);
        r.generated += 1;
        if r.generated < r.max_tokens {
            self.running.insert(req, r);
        } else {
            events.push(self.finish(req, r));
        }
        Ok(events)
    }

    fn abort(&mut self, req: RequestId) {
        if let Some(r) = self.running.remove(&req)
            && let Err(u) = r.seq.release(&mut self.pool)
        {
            self.seen.push((Prop::SingleLease, format!("releasing stopped {req}: {u}")));
        }
    }

    fn active(&self) -> usize {
        self.running.len()
    }

    fn keep_finished(&mut self) {
        self.keep_finished = true;
    }

    fn take_retired(&mut self) -> Vec<Retired> {
        std::mem::take(&mut self.retired)
    }

    // A local prompt is computed as it joins (`add_local`).
    fn lend_computed(&mut self, req: RequestId, f: &mut dyn FnMut(&mut KvPool, &mut SequenceKv)) -> bool {
        let Some(r) = self.running.get_mut(&req) else { return false };
        f(&mut self.pool, &mut r.seq);
        true
    }
}

/// Reads positions `0..positions` of `seq` through the pool and checks each holds the mock
/// model's value for `req`.
fn read_positions(pool: &KvPool, values: &Values, req: RequestId, seq: &SequenceKv, positions: usize) -> Result<(), String> {
    let hd = LAYOUT.head_dim;
    for pos in 0..positions {
        // A shared (cached) page is read like an own one, through its lease.
        let (lease, slot) = seq.locate_page(pos).map_err(|e| format!("{req} position {pos}: {e}"))?;
        for layer in 0..LAYOUT.layers {
            let r = pool.read(lease, layer).map_err(|e| format!("{req} read of page {} refused: {e}", lease.page()))?;
            if slot >= r.len() {
                return Err(format!("{req} read position {pos} (page {} slot {slot}) past the watermark {}", lease.page(), r.len()));
            }
            let want = values.of(req, pos);
            for head in 0..LAYOUT.kv_heads {
                for x in [&r.k_head(head)[slot * hd..(slot + 1) * hd], &r.v_head(head)[slot * hd..(slot + 1) * hd]] {
                    if x.iter().any(|v| v.to_f32() != want) {
                        return Err(format!(
                            "{req} position {pos} holds {:?}, not its own KV {want}",
                            x.iter().map(|v| v.to_f32()).collect::<Vec<_>>()
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// The prefill side of a [`Variant`]: honest, except under [`Variant::KeepRejectedJob`]
/// (the incident's scheduler) and [`Variant::UnscopedCacheKeys`].
pub fn prefill_policy(variant: Variant) -> PrefillSabotage {
    match variant {
        Variant::KeepRejectedJob => PrefillSabotage::keep_rejected(),
        Variant::UnscopedCacheKeys => PrefillSabotage::unscoped_keys(),
        _ => PrefillSabotage::none(),
    }
}

/// The decode side of a [`Variant`]: honest, except under [`Variant::DropFence`],
/// [`Variant::ReleaseQuarantineOnTick`], [`Variant::OneDecodeScope`] and
/// [`Variant::IgnoreGatewayLoss`].
pub fn decode_policy(variant: Variant) -> DecodeSabotage {
    match variant {
        Variant::DropFence => DecodeSabotage::DropFences,
        Variant::ReleaseQuarantineOnTick => DecodeSabotage::FenceOnTimeout,
        Variant::OneDecodeScope => DecodeSabotage::OneScope(None),
        Variant::IgnoreGatewayLoss => DecodeSabotage::IgnoreGatewayLoss,
        _ => DecodeSabotage::None,
    }
}
