//! The checks of a finished schedule: each request's one terminal outcome and its output
//! against the reference, every pool back to full with its invariants holding, every role
//! idle; and the counts ([`Tally`]) that show the faults and checks really ran.

use std::fmt::Write as _;

use bulkhead_kv::{KvPool, PoolStats, PrefixCache};
use bulkhead_protocol::decode::DecodeStats;
use bulkhead_protocol::driver::decode::DecodeEngine;
use bulkhead_protocol::gateway::ClientOutput;
use bulkhead_protocol::{RejectReason, WorkerId};

use super::Sim;
use crate::model::{DecodeModel, Models, PrefillModel};
use crate::net::End;

/// Counts over schedules, the evidence that the faults and checks really ran (I6).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Requests planned.
    pub requests: u64,
    /// Finished (each one compared with the reference).
    pub finished: u64,
    /// Rejected (any reason).
    pub rejected: u64,
    /// Failed while running (any reason).
    pub failed: u64,
    /// Answered "no worker available".
    pub unavailable: u64,
    /// Turned away for now (HTTP 429): the gateway's queue was full or they waited too long.
    pub busy: u64,
    /// Sequences a decode loop retracted to let others grow (resumed or not).
    pub retractions: u64,
    /// Requests the gateway sent again after losing their prefill worker.
    pub retried: u64,
    /// Prefill workers that rejoined under a new id after losing a KV connection.
    pub rejoins: u64,
    /// The client left before an outcome.
    pub client_gone: u64,
    /// Faults that found a target: cuts, bad bytes, crashes.
    pub faults: u64,
    /// KV chunks verified by decode workers.
    pub chunks_verified: u64,
    /// Decode pages quarantined until their writer was fenced.
    pub pages_quarantined: u64,
    /// Chunks that arrived for a request no longer receiving.
    pub late_chunks: u64,
    /// Transfers that timed out.
    pub transfer_timeouts: u64,
    /// Slots checked by the KV auditor.
    pub audited_slots: u64,
    /// Keepalives prefill roles sent.
    pub keepalives: u64,
    /// Prompt tokens prefill workers took from their prefix caches.
    pub cache_hit_tokens: u64,
    /// Pages prefix caches evicted.
    pub cache_evictions: u64,
    /// Finished requests whose usage counted cached tokens (each checked against the
    /// prompts of its own tenant).
    pub cached_finished: u64,
    /// Prompt tokens decode workers held in their caches and did not receive.
    pub decode_held_tokens: u64,
    /// Requests moved off a lost decode worker (each then checked like any other).
    pub migrated: u64,
    /// Gateways killed (schedules with two gateways).
    pub gateways_lost: u64,
    /// Pages decode workers' caches evicted.
    pub decode_cache_evictions: u64,
    /// Requests whose rest of the prompt a decode worker computed itself.
    pub local_prefills: u64,
}

impl std::ops::AddAssign for Tally {
    fn add_assign(&mut self, o: Tally) {
        self.requests += o.requests;
        self.finished += o.finished;
        self.rejected += o.rejected;
        self.failed += o.failed;
        self.unavailable += o.unavailable;
        self.busy += o.busy;
        self.retractions += o.retractions;
        self.retried += o.retried;
        self.rejoins += o.rejoins;
        self.client_gone += o.client_gone;
        self.faults += o.faults;
        self.chunks_verified += o.chunks_verified;
        self.pages_quarantined += o.pages_quarantined;
        self.late_chunks += o.late_chunks;
        self.transfer_timeouts += o.transfer_timeouts;
        self.audited_slots += o.audited_slots;
        self.keepalives += o.keepalives;
        self.cache_hit_tokens += o.cache_hit_tokens;
        self.cache_evictions += o.cache_evictions;
        self.cached_finished += o.cached_finished;
        self.decode_held_tokens += o.decode_held_tokens;
        self.migrated += o.migrated;
        self.decode_cache_evictions += o.decode_cache_evictions;
        self.local_prefills += o.local_prefills;
        self.gateways_lost += o.gateways_lost;
    }
}

impl Tally {
    fn add_decode(&mut self, s: &DecodeStats) {
        self.chunks_verified += s.chunks_verified;
        self.pages_quarantined += s.pages_quarantined;
        self.late_chunks += s.late_chunks;
        self.transfer_timeouts += s.timeouts;
    }
}

impl<M: Models> Sim<'_, M> {
    // ------------------------------------------------------------------ verdict

    /// Checks the quiet end state: one terminal outcome per request, the right one, the
    /// reference output for every finished request; every pool full with nothing
    /// quarantined and its invariants holding; no read fault, poisoned read or audit
    /// violation anywhere, dead workers' pools included; every role idle.
    // Long on purpose (~140 lines): a flat list of end-state checks, a few lines each, in the
    // order a failing schedule reports them.
    pub fn verdict(&mut self) {
        let mut bad = Vec::new();
        let served = self.plan.served_context();
        let (pctx, dctx) = (self.plan.prefill.context, self.plan.decode.context);
        for r in &self.plan.requests {
            let Some(c) = self.clients.get(&r.req) else { continue };
            let id = r.req;
            let terminal: Vec<usize> = c.outputs.iter().enumerate().filter(|(_, o)| o.is_terminal()).map(|(i, _)| i).collect();
            match (terminal.as_slice(), c.gone_at) {
                ([], Some(_)) => self.tally.client_gone += 1,
                ([], None) => bad.push(format!("r{id}: no terminal outcome (outputs {:?})", c.outputs)),
                ([t], gone) => {
                    if *t + 1 != c.outputs.len() {
                        bad.push(format!("r{id}: output after its terminal outcome: {:?}", c.outputs));
                    }
                    if gone.is_some_and(|g| *t >= g) {
                        bad.push(format!("r{id}: an outcome after its client left: {:?}", c.outputs));
                    }
                }
                (many, _) => bad.push(format!("r{id}: {} terminal outcomes: {:?}", many.len(), c.outputs)),
            }
            let (prompt, max) = (r.tokens.len(), r.max_tokens as usize);
            let total = prompt + max;
            let workers_fit = prompt >= 1 && max >= 1 && prompt <= pctx && total <= dctx;
            let gateway_fits = !self.plan.gateway_check || total <= served;
            let Some(out) = terminal.first().and_then(|t| c.outputs.get(*t)) else { continue };
            match out {
                ClientOutput::Finished { finish, prompt_tokens, completion_tokens, cached_tokens, .. } => {
                    self.tally.finished += 1;
                    if !(workers_fit && gateway_fits) {
                        bad.push(format!("r{id} ({:?}, prompt {prompt}, max {max}) finished (HTTP 200) though it does not fit", r.kind));
                        continue;
                    }
                    // I7: cached tokens come from a prompt of the same tenant sharing that
                    // prefix, or from an earlier attempt of this very request.
                    if *cached_tokens > 0 {
                        self.tally.cached_finished += 1;
                        let common = |o: &crate::plan::RequestPlan| o.tokens.iter().zip(&r.tokens).take_while(|(a, b)| a == b).count();
                        let same_tenant =
                            self.plan.requests.iter().filter(|o| o.req != r.req && o.tenant == r.tenant).map(common).max().unwrap_or(0);
                        let own = if c.prefills > 1 { prompt } else { 0 };
                        if !self.plan.prefix_cache || *cached_tokens as usize > same_tenant.max(own) {
                            bad.push(format!(
                                "r{id} (tenant {}) reports {cached_tokens} cached tokens; its tenant's prompts share {same_tenant}",
                                r.tenant
                            ));
                        }
                    }
                    let text: String = c
                        .outputs
                        .iter()
                        .map(|o| match o {
                            ClientOutput::Token { text, .. } | ClientOutput::Finished { text, .. } => text.as_str(),
                            _ => "",
                        })
                        .collect();
                    match self.models.reference(self.plan.layout, &r.tokens, r.max_tokens, &r.sampling) {
                        Ok(want) => {
                            let got = (&text, *finish, *completion_tokens, *prompt_tokens as usize);
                            if got != (&want.text, want.finish, want.completion_tokens, prompt) {
                                bad.push(format!(
                                    "r{id}: output differs from the reference: got {got:?}, want {:?}",
                                    (&want.text, want.finish, want.completion_tokens, prompt)
                                ));
                            }
                        }
                        Err(e) => bad.push(format!("r{id}: no reference: {e}")),
                    }
                }
                ClientOutput::Rejected { reason, .. } => {
                    self.tally.rejected += 1;
                    let ok = match reason {
                        RejectReason::ContextLength => total > served || prompt > pctx,
                        RejectReason::Capacity => total <= dctx,
                        RejectReason::Invalid => prompt == 0 || max == 0,
                        RejectReason::Duplicate => false,
                    };
                    if !ok {
                        bad.push(format!("r{id} ({:?}, prompt {prompt}, max {max}) rejected for {reason:?}", r.kind));
                    }
                }
                ClientOutput::Failed { .. } => self.tally.failed += 1,
                ClientOutput::Unavailable { .. } => self.tally.unavailable += 1,
                ClientOutput::Busy { .. } => self.tally.busy += 1,
                // No plan gives a tenant a token budget.
                ClientOutput::OverBudget { detail } => bad.push(format!("r{id}: over a token budget no plan sets: {detail}")),
                ClientOutput::Token { .. } => {}
            }
        }
        for (g, gw) in self.live_gateways() {
            if gw.role.in_flight() != 0 {
                bad.push(format!("{}: {} requests still in flight", End::Gateway(g), gw.role.in_flight()));
            }
        }
        for (w, p) in &self.prefills {
            if !p.driver.is_idle() {
                bad.push(format!("w{}: prefill not idle", w.0));
            }
            check_pool(&mut bad, *w, &p.pool, p.model.read_faults(), false);
        }
        let mut unexplained_decode = false;
        for (w, d) in &self.decodes {
            let r = d.driver.role();
            let busy = (r.pending(), r.fencing(), r.decoding(), d.driver.engine().active());
            if busy != (0, 0, 0, 0) {
                unexplained_decode = true;
                bad.push(format!("w{}: decode not idle (pending, fencing, decoding, active) = {busy:?}", w.0));
            }
            check_pool(&mut bad, *w, d.driver.engine().pool(), d.driver.engine().read_faults(), false);
            check_decode(&mut bad, *w, &d.driver.role().stats());
            self.tally.add_decode(&d.driver.role().stats());
        }
        for r in &self.dead {
            check_pool_stats(&mut bad, r.id, &r.pool, r.read_faults);
            if let Some(s) = &r.decode {
                check_decode(&mut bad, r.id, s);
                self.tally.add_decode(s);
            }
        }
        if let Some(state) = self.wedged.take() {
            let others_quiet = self.timeline.is_empty()
                && self.net.idle()
                && self.live_gateways().all(|(_, g)| g.role.in_flight() == 0)
                && self.prefills.values().all(|p| p.driver.is_idle());
            if !others_quiet || unexplained_decode {
                bad.push(format!("not quiet by t={} (something waits for ever): {state}", self.deadline));
            }
        }
        self.tally.audited_slots += self.prefills.values().map(|p| p.pool.stats().audited_slots).sum::<u64>()
            + self.decodes.values().map(|d| d.driver.engine().pool().stats().audited_slots).sum::<u64>()
            + self.dead.iter().map(|r| r.pool.audited_slots).sum::<u64>();
        self.tally.keepalives += self.prefills.values().map(|p| p.driver.role().stats().keepalives).sum::<u64>()
            + self.dead.iter().map(|r| r.keepalives).sum::<u64>();
        self.tally.retractions += self.decodes.values().map(|d| d.driver.engine().retractions()).sum::<u64>()
            + self.dead.iter().map(|r| r.retractions).sum::<u64>();
        self.tally.retried += self.gws.iter().map(|g| g.role.stats().retried).sum::<u64>();
        self.tally.migrated += self.gws.iter().map(|g| g.role.stats().migrated).sum::<u64>();
        let caches =
            self.prefills.values().filter_map(|p| p.driver.cache()).map(PrefixCache::stats).chain(self.dead.iter().map(|r| r.cache));
        for c in caches {
            self.tally.cache_hit_tokens += c.hit_tokens;
            self.tally.cache_evictions += c.evicted_pages;
        }
        for d in self.decodes.values() {
            self.tally.decode_held_tokens += d.driver.role().stats().held_tokens;
            self.tally.decode_cache_evictions += d.driver.role().cache_stats().map_or(0, |c| c.evicted_pages);
            self.tally.local_prefills += d.driver.role().stats().local_prefills;
        }
        for why in bad {
            self.violate(why);
        }
    }

    /// The state of every role and pool, for a failure report.
    pub(super) fn dump(&self) -> String {
        let mut s = String::new();
        for (g, gw) in self.live_gateways() {
            let _ = write!(s, "{} in flight {}; ", End::Gateway(g), gw.role.in_flight());
        }
        for (w, p) in &self.prefills {
            let _ = write!(
                s,
                "w{} prefill queued {} jobs {:?} pool {:?}; ",
                w.0,
                p.driver.role().queued(),
                p.driver.running().map(|j| j.req).collect::<Vec<_>>(),
                p.pool.stats()
            );
        }
        for (w, d) in &self.decodes {
            let r = d.driver.role();
            let _ = write!(
                s,
                "w{} decode pending {} fencing {} decoding {} pool {:?}; ",
                w.0,
                r.pending(),
                r.fencing(),
                r.decoding(),
                d.driver.engine().pool().stats()
            );
        }
        s
    }
}

/// A live pool at the end: back to full, nothing quarantined (unless a known finding
/// holds pages in quarantine), invariants holding, and no faulty read, poisoned read or
/// audit violation on the way.
fn check_pool(bad: &mut Vec<String>, w: WorkerId, pool: &KvPool, read_faults: u64, quarantine_explained: bool) {
    let s = pool.stats();
    // Cached pages nobody reads count as free: the cache gives them up on demand.
    let full = (s.free_pages + s.cached_pages, s.leased_pages, s.quarantined_pages, s.shared_leases) == (s.total_pages, 0, 0, 0);
    let explained = quarantine_explained && s.leased_pages == 0 && s.free_pages + s.quarantined_pages == s.total_pages;
    if !(full || explained) {
        bad.push(format!("w{}: pool not back to full: {s:?}", w.0));
    }
    pool.check_invariants();
    check_pool_stats(bad, w, &s, read_faults);
}

fn check_pool_stats(bad: &mut Vec<String>, w: WorkerId, s: &PoolStats, read_faults: u64) {
    if read_faults > 0 {
        bad.push(format!("w{}: {read_faults} model reads refused, past a watermark or failing the pool's read checks", w.0));
    }
    if s.poisoned_reads > 0 || s.audit_violations > 0 || s.fence_failures > 0 {
        bad.push(format!(
            "w{}: {} poisoned reads, {} audit violations, {} tenant-fence failures",
            w.0, s.poisoned_reads, s.audit_violations, s.fence_failures
        ));
    }
}

/// Over a TCP-like transport every chunk arrives intact and in order, so the verifier
/// never has reason to refuse one; a refusal means a driver or a role misaddressed KV.
fn check_decode(bad: &mut Vec<String>, w: WorkerId, s: &DecodeStats) {
    if s.chunks_refused > 0 || s.coverage_failed > 0 {
        bad.push(format!("w{}: {} chunks refused, {} completion claims refused", w.0, s.chunks_refused, s.coverage_failed));
    }
}
