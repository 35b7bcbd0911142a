//! Running each process's production driver within a transition: the gateway role's
//! actions, the prefill driver's events and steps, the decode driver's events and engine,
//! and what the driver saw at a request's start.

use bulkhead_kv::RequestId;
use bulkhead_protocol::decode::DecodeEvent;
use bulkhead_protocol::driver::prefill::Step;
use bulkhead_protocol::gateway::{ClientOutput, GatewayAction, client_of};
use bulkhead_protocol::prefill::PrefillEvent;
use bulkhead_protocol::{FailReason, Message, RejectReason, WorkerId};

use super::wire::{DecodeWire, PrefillWire, worker_rejected};
use super::{DECODE, Envelope, Node, Outcome, Prop, World, request};
use crate::config::Variant;
use crate::drivers::{MockPrefill, Started};

impl World<'_> {
    // ---------------------------------------------------------------- gateway driver

    pub(super) fn gateway_actions(&mut self, g: usize, acts: Vec<GatewayAction>) {
        for a in acts {
            match a {
                GatewayAction::ToWorker { to, msg } => {
                    if let Message::Reserve { req, .. } = &msg
                        && self.ghosts.get(&client_of(*req)).is_some_and(|g| g.rejected)
                    {
                        self.violate(Prop::RejectionTerminal, format!("Reserve sent for {req} after it was rejected"));
                    }
                    let dest = if to == DECODE { Node::Decode } else { Node::Prefill(to) };
                    self.send(Node::Gateway(g as u8), dest, msg);
                }
                GatewayAction::ToClient { req, out } => self.client_output(req, out),
            }
        }
    }

    fn client_output(&mut self, req: RequestId, out: ClientOutput) {
        let outcome = match out {
            ClientOutput::Token { .. } => return,
            ClientOutput::Finished { .. } => Outcome::Finished,
            ClientOutput::Rejected { reason, .. } => Outcome::Rejected(reason),
            ClientOutput::Failed { reason, .. } => Outcome::Failed(reason),
            ClientOutput::Unavailable { .. } => Outcome::Unavailable,
            ClientOutput::Busy { reason, .. } => Outcome::Busy(reason),
            ClientOutput::OverBudget { .. } => Outcome::OverBudget,
        };
        let over = request(self.cfg, req).is_some_and(|r| self.cfg.over_capacity(r));
        let retry_variant = self.cfg.variant == Variant::RetryAfterReject;
        let g = self.ghost(req);
        g.outcomes.push(outcome);
        if matches!(outcome, Outcome::Rejected(_)) {
            g.rejected = true;
        }
        let outcomes = g.outcomes.clone();
        let retry = retry_variant && matches!(outcome, Outcome::Rejected(_)) && !g.retried;
        if retry {
            g.retried = true;
        }
        if outcomes.len() > 1 {
            self.violate(Prop::OneOutcome, format!("{req} has two terminal outcomes: {outcomes:?}"));
        }
        if over && outcome == Outcome::Finished {
            self.violate(Prop::OneOutcome, format!("{req} is over capacity and finished (HTTP 200)"));
        }
        if over && self.cfg.check_original_error && matches!(outcome, Outcome::Failed(r) if r != FailReason::Timeout) {
            self.violate(Prop::OriginalError, format!("{req} is over capacity and was answered {outcome:?}, not its refusal"));
        }
        if retry {
            // Broken: the driver retries under the same id after the client got the refusal.
            self.submit(req);
        }
    }

    // ---------------------------------------------------------------- prefill driver

    /// Feed one event to a prefill worker's driver; its actions go onto the network.
    pub(super) fn prefill_event(&mut self, w: WorkerId, ev: PrefillEvent) {
        let alive = self.alive();
        let Some(p) = self.prefills.iter_mut().find(|p| p.id == w) else { return };
        let mut link = PrefillWire { me: w, net: &mut self.net, alive: &alive, ghosts: &self.ghosts, seen: Vec::new() };
        p.driver.handle(ev, &mut link);
        let seen = link.seen;
        self.violate_all(seen);
        self.note_refusals(w);
    }

    /// The requests a prefill role refused are rejected from then on (I3), whatever the
    /// driver's policy made of the refusal.
    fn note_refusals(&mut self, w: WorkerId) {
        let Some(p) = self.prefills.iter_mut().find(|p| p.id == w) else { return };
        let refused: Vec<RequestId> = p.driver.policy_mut().refused.drain(..).collect();
        for req in refused.into_iter().map(client_of) {
            if let Some(reason) = self.refusal_of(req) {
                worker_rejected(&mut self.ghosts, req, reason);
            }
        }
    }

    /// Why a prefill worker refuses `req`: over its prompt limit, or nothing (a duplicate).
    fn refusal_of(&self, req: RequestId) -> Option<RejectReason> {
        let r = request(self.cfg, req)?;
        (r.prompt as usize > self.cfg.prefill_max_prompt).then_some(RejectReason::ContextLength)
    }

    /// One step of prefill work, through the production driver: end stopped jobs, take
    /// queued ones while the budget has room, and compute and send the next page of each
    /// running job (up to two), ending those that finished (no message is handled between
    /// a job's last chunk and its `Done`, as in the server). Taking a job and computing its
    /// first page are one step: an abort that would arrive between them has the same
    /// effect on every other role as one arriving just before (`Fenced`, no chunk).
    pub(super) fn prefill_step(&mut self, w: WorkerId) {
        let alive = self.alive();
        let Some(p) = self.prefills.iter_mut().find(|p| p.id == w) else { return };
        let mut link = PrefillWire { me: w, net: &mut self.net, alive: &alive, ghosts: &self.ghosts, seen: Vec::new() };
        let mut model = MockPrefill::new(&self.values);
        let steps = p.driver.step(&mut model, &mut p.pool, &mut link);
        let mut seen = link.seen;
        for req in model.batched {
            self.ghosts.entry(client_of(req)).or_default().batched = true;
        }
        for step in steps {
            if let Step::Computed { req, .. } | Step::Ended { req, .. } = step
                && self.ghosts.get(&client_of(req)).is_some_and(|g| g.rejected)
                && !matches!(step, Step::Ended { outcome: bulkhead_protocol::prefill::JobOutcome::Stopped, .. })
            {
                seen.push((Prop::RejectionTerminal, format!("prefill computes {req} after it was rejected")));
            }
            if let Step::Ended { req, unreleased: Some(e), .. } = &step {
                seen.push((Prop::SingleLease, format!("the prefill could not release the pages of {req}: {e}")));
            }
        }
        self.violate_all(seen);
    }

    pub(super) fn crash_prefill(&mut self, id: WorkerId) {
        let Some(i) = self.prefills.iter().position(|p| p.id == id) else { return };
        self.budget.prefill_crashes -= 1;
        // Its process, pool, queue and job are gone; what it sent is still on the wire and
        // its connections close after it; what was on its way to it is lost. A fresh
        // worker registers under a new id.
        let fresh = WorkerId(self.next_worker);
        self.next_worker += 1;
        let dead = &self.dead;
        let live = self.gws.iter_mut().enumerate().filter(|(g, _)| !dead.contains(&(*g as u8))).map(|(_, gw)| gw);
        self.prefills[i] = Self::start_prefill(self.cfg, live, &mut self.dec, fresh);
        self.net.retain(|(_, to), _| *to != Node::Prefill(id));
        for to in self.alive().gateways.into_iter().map(Node::Gateway).chain([Node::Decode]) {
            self.net.entry((Node::Prefill(id), to)).or_default().push_back(Envelope::Closed);
        }
    }

    /// Gateway `g` dies: what was on its way to it is lost; what it sent still arrives,
    /// then each of its connections closes; its clients are gone with it.
    pub(super) fn lose_gateway(&mut self, g: u8) {
        self.budget.gateway_losses -= 1;
        self.dead.insert(g);
        self.net.retain(|(_, to), _| *to != Node::Gateway(g));
        for to in self.prefills.iter().map(|p| Node::Prefill(p.id)).chain([Node::Decode]) {
            self.net.entry((Node::Gateway(g), to)).or_default().push_back(Envelope::Closed);
        }
        for (req, ghost) in &mut self.ghosts {
            if Self::gateway_index(*req) == usize::from(g) && ghost.outcomes.is_empty() {
                ghost.submitted = true;
                ghost.client_gone = true;
            }
        }
    }

    // ---------------------------------------------------------------- decode driver

    /// Feed one event to the decode driver and record what it did to the ghost state.
    pub(super) fn decode_event(&mut self, ev: DecodeEvent) {
        let before = self.dec.role().stats();
        let (chunk, done) = match &ev {
            DecodeEvent::Prefill { msg: Message::KvChunk { req, header, .. }, .. } => (Some((*req, header.slot_count as usize)), None),
            DecodeEvent::Prefill { msg: Message::Done { req, .. }, .. } => (None, Some(*req)),
            _ => (None, None),
        };
        let alive = self.alive();
        let mut link = DecodeWire { cfg: self.cfg, net: &mut self.net, alive: &alive, ghosts: &mut self.ghosts, seen: Vec::new() };
        self.dec.handle(ev, &mut link);
        let seen = link.seen;
        self.violate_all(seen);
        let after = self.dec.role().stats();
        if let Some((attempt, slots)) = chunk
            && after.chunks_verified > before.chunks_verified
        {
            let req = client_of(attempt);
            let g = self.ghost(req);
            if g.attempt == Some(attempt) {
                g.landed += slots;
            }
            if g.rejected {
                self.violate(Prop::RejectionTerminal, format!("decode accepted a chunk for {req} after it was rejected"));
            }
        }
        if let Some(req) = done
            && after.coverage_failed > before.coverage_failed
            && self.cfg.variant == Variant::TrustDone
        {
            // Broken: "transfer complete" is trusted; the request is started on what is in
            // place (what it held and what landed).
            let (held, landed) = self.ghosts.get(&client_of(req)).map_or((0, 0), |g| (g.held, g.landed));
            self.check_start(req, held + landed, held, 0);
        }
        self.drain_engine();
    }

    /// What the mock decode loop saw: requests it started (checked against their
    /// reservations) and property violations of its reads.
    pub(super) fn drain_engine(&mut self) {
        let started: Vec<Started> = self.dec.engine_mut().started.drain(..).collect();
        for Started { req: attempt, prompt, committed, shared, computed } in started {
            self.check_start(attempt, prompt, shared, computed);
            let req = client_of(attempt);
            if committed != self.ghosts.get(&req).and_then(|g| g.reserved_prompt).unwrap_or(usize::MAX) {
                self.violate(Prop::VerifiedCoverage, format!("{req} started with {committed} committed prompt tokens"));
            }
        }
        let seen: Vec<(Prop, String)> = self.dec.engine_mut().seen.drain(..).collect();
        self.violate_all(seen);
    }

    /// I2 at the moment decode starts attempt `attempt` with `coverage` prompt tokens in
    /// place, `shared` of them in shared (cached) pages and `computed` computed by the decode
    /// loop itself; I10: its shared leases cover what the decode worker said it held, and
    /// beyond that only pages that landed for it (its verified prompt, published at once
    /// for its siblings), and held, landed and computed tokens cover the prompt with no gap
    /// and no overlap (a rest is computed only when the worker said so, and then nothing
    /// lands); I3: a rejected request never reaches decode.
    fn check_start(&mut self, attempt: RequestId, coverage: usize, shared: usize, computed: usize) {
        let req = client_of(attempt);
        let g = self.ghosts.get(&req).cloned().unwrap_or_default();
        if g.attempt != Some(attempt)
            || g.reserved_prompt != Some(coverage)
            || shared < g.held
            || shared > g.held + g.landed
            || g.held + g.landed + computed != coverage
            || (computed > 0) != g.local
        {
            self.violate(
                Prop::VerifiedCoverage,
                format!(
                    "{req} started with {coverage} prompt tokens, {shared} shared, {computed} computed here; reserved {:?}, held {}, landed {}, local {}",
                    g.reserved_prompt, g.held, g.landed, g.local
                ),
            );
        }
        if g.rejected {
            self.violate(Prop::RejectionTerminal, format!("{req} started decoding after it was rejected"));
        }
    }
}
