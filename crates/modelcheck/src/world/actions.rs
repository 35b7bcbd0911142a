//! What the checker may do next in a world ([`World::enabled`]) and doing it
//! ([`World::apply`]): deliveries, losses, duplicates and reorderings on the network,
//! client submissions and aborts, steps, ticks, crashes and gateway losses.

use bulkhead_kv::RequestId;
use bulkhead_protocol::cache::CacheSecret;
use bulkhead_protocol::decode::DecodeEvent;
use bulkhead_protocol::gateway::{GatewayEvent, Phase, Submission, TenantId, client_of};
use bulkhead_protocol::prefill::PrefillEvent;
use bulkhead_protocol::{GatewayId, Message, Sampling, TraceContext};

use super::wire::DecodeWire;
use super::{Action, DECODE, Envelope, Node, Prop, World, request};
use crate::config::{TICK_MS, Variant};

impl World<'_> {
    // ---------------------------------------------------------------- enabled actions

    /// Every action the checker may take next, in a deterministic order.
    pub fn enabled(&self) -> Vec<Action> {
        if let Some(a) = self.ignorable() {
            return vec![a];
        }
        let mut out = Vec::new();
        if let Some((&req, _)) = self.ghosts.iter().find(|(_, g)| !g.submitted) {
            out.push(Action::Submit(req));
        }
        if self.budget.client_aborts > 0 {
            for (&req, g) in &self.ghosts {
                if g.submitted && !g.client_gone && g.outcomes.is_empty() {
                    out.push(Action::ClientGone(req));
                }
            }
        }
        for (&(from, to), q) in &self.net {
            let Some(head) = q.front() else { continue };
            out.push(Action::Deliver(from, to));
            let head_is_msg = matches!(head, Envelope::Msg(_));
            if head_is_msg && self.budget.duplicate > 0 {
                out.push(Action::Duplicate(from, to));
            }
            if head_is_msg && self.budget.lose > 0 {
                out.push(Action::Lose(from, to));
            }
            if head_is_msg && self.budget.reorder > 0 && matches!(q.get(1), Some(Envelope::Msg(_))) {
                out.push(Action::Reorder(from, to));
            }
        }
        for p in &self.prefills {
            if p.driver.has_work() {
                out.push(Action::PrefillStep(p.id));
            }
        }
        for &req in self.dec.engine().running.keys() {
            out.push(Action::DecodeStep(req));
        }
        // A tick with nothing waiting only moves the clock; leaving it out loses no
        // behaviour (a later useful tick is the same choice).
        if self.budget.decode_ticks > 0 && self.dec.role().pending() > 0 {
            out.push(Action::DecodeTick);
        }
        if self.budget.gateway_ticks > 0 && self.live_gateways().any(|g| g.in_flight() > 0) {
            out.push(Action::GatewayTick);
        }
        // A gateway dies while it has something in flight (dying idle only ends the
        // checker's world early), and never the last one.
        if self.budget.gateway_losses > 0 && self.dead.len() + 1 < self.gws.len() {
            for (g, gw) in self.gws.iter().enumerate() {
                if !self.dead.contains(&(g as u8)) && gw.in_flight() > 0 {
                    out.push(Action::LoseGateway(g as u8));
                }
            }
        }
        // A keepalive re-arms only reservations waiting for that prefill; one sent while
        // none waits changes nothing the properties see but the network.
        if self.budget.prefill_ticks > 0 {
            for p in &self.prefills {
                if self.dec.role().awaits(p.id) {
                    out.push(Action::PrefillTick(p.id));
                }
            }
        }
        if self.budget.close_overtakes > 0 {
            for (&(from, to), q) in &self.net {
                if matches!(from, Node::Prefill(_)) && to == Node::Decode && q.iter().skip(1).any(|e| matches!(e, Envelope::Closed)) {
                    out.push(Action::CloseOvertakes(from));
                }
            }
        }
        if self.budget.prefill_crashes > 0 {
            for p in &self.prefills {
                let involved = p.driver.has_work()
                    || p.driver.role().busy()
                    || self.net.keys().any(|(a, b)| *a == Node::Prefill(p.id) || *b == Node::Prefill(p.id));
                if involved {
                    out.push(Action::CrashPrefill(p.id));
                }
            }
        }
        out
    }

    /// Partial-order reduction. A message at the head of a connection that its receiver
    /// will ignore whenever it arrives changes nothing but that connection, which no other
    /// action reads before it is delivered; delivering it commutes with every other action
    /// and is invisible to every property, so from such a state exploring only that
    /// delivery loses no behaviour (an ample set of one action; the model is acyclic).
    /// Losing or duplicating such a message leads to the same world with less fault budget
    /// left, whose behaviours are a subset. A message is ignored for ever when:
    ///
    /// - to the gateway: the gateway no longer tracks its request (`on_worker` drops it),
    ///   and requests are never submitted twice;
    /// - to the decode worker from a prefill worker: a `Done`/`Fenced` for a request neither
    ///   pending nor fencing; with exactly-once delivery no `Reserve` for it can follow (its
    ///   `Prefill` was sent after `Reserved`). Chunks are never taken this way, even late
    ///   ones: a chunk on the wire is what the I4 and single-lease properties look at, so
    ///   delivering one is visible to them;
    /// - to the decode worker from the gateway: an `Abort`/`Cancel` for a request neither
    ///   pending, fencing nor decoding (its `Reserve` came before it on the same connection);
    /// - to the decode worker from the gateway: `PrefillUnreachable` for a prefill worker
    ///   that connected to it (see `DecodeRole`: such a prefill is fenced by its close);
    /// - to a prefill worker: an `Abort` for a request it has no job for, with no `Prefill`
    ///   for it on the wire to it and none to come (the gateway sends `Prefill` only from
    ///   `Reserving`).
    fn ignorable(&self) -> Option<Action> {
        use bulkhead_protocol::decode::RequestState;
        if self.cfg.variant == Variant::RetryAfterReject {
            return None;
        }
        let exactly_once = self.cfg.faults.duplicate == 0 && self.cfg.faults.reorder == 0;
        for (&(from, to), q) in &self.net {
            let Some(Envelope::Msg(m)) = q.front() else { continue };
            // A prefill that connected here is fenced by its connection's close, never by
            // the gateway's word: the decode role ignores the news for good.
            if let Message::PrefillUnreachable { worker } | Message::PeerLeft { worker } = m
                && to == Node::Decode
                && self.dec.role().has_connected(*worker)
            {
                return Some(Action::Deliver(from, to));
            }
            let Some(req) = m.req() else { continue };
            if !self.ghosts.get(&client_of(req)).is_some_and(|g| g.submitted) {
                continue;
            }
            let at_decode = self.dec.role().state_of(req);
            let pending_or_fencing = matches!(at_decode, Some(RequestState::Pending | RequestState::Fencing));
            let ignored = match (from, to, m) {
                (_, Node::Gateway(g), _) => self.dead.contains(&g) || self.gws[usize::from(g)].phase_of(req).is_none(),
                (Node::Prefill(_), Node::Decode, Message::Done { .. } | Message::Fenced { .. }) => exactly_once && !pending_or_fencing,
                (Node::Gateway(_), Node::Decode, Message::Abort { .. } | Message::Cancel { .. }) => at_decode.is_none(),
                // (A decode worker's abort of a job the prefill does not have is answered
                // with a fence, so it is not ignorable.)
                (Node::Gateway(g), Node::Prefill(w), Message::Abort { .. }) => {
                    let Some(p) = self.prefills.iter().find(|p| p.id == w) else { continue };
                    let has_job = p.driver.role().has_job(req) || p.driver.targets().any(|j| j.req == req);
                    let prefill_on_wire = self
                        .net
                        .get(&(Node::Gateway(g), Node::Prefill(w)))
                        .is_some_and(|q| q.iter().any(|e| matches!(e, Envelope::Msg(Message::Prefill { req: r, .. }) if *r == req)));
                    let prefill_to_come = self.gws[usize::from(g)].phase_of(req) == Some(Phase::Reserving);
                    !has_job && !prefill_on_wire && !prefill_to_come
                }
                _ => false,
            };
            if ignored {
                return Some(Action::Deliver(from, to));
            }
        }
        None
    }

    // ---------------------------------------------------------------- transitions

    /// Take one step. The action must be one of [`World::enabled`].
    pub fn apply(&mut self, a: &Action) {
        match *a {
            Action::Submit(req) => self.submit(req),
            Action::ClientGone(req) => {
                self.budget.client_aborts -= 1;
                self.ghost(req).client_gone = true;
                let g = Self::gateway_index(req);
                let acts = self.gws[g].handle(GatewayEvent::ClientGone { req });
                self.gateway_actions(g, acts);
            }
            Action::Deliver(from, to) => {
                if let Some(env) = self.pop(from, to, 0) {
                    self.deliver(from, to, env);
                }
            }
            Action::Duplicate(from, to) => {
                self.budget.duplicate -= 1;
                if let Some(env) = self.net.get(&(from, to)).and_then(|q| q.front()).cloned() {
                    self.deliver(from, to, env);
                }
            }
            Action::Lose(from, to) => {
                self.budget.lose -= 1;
                self.pop(from, to, 0);
            }
            Action::Reorder(from, to) => {
                self.budget.reorder -= 1;
                if let Some(env) = self.pop(from, to, 1) {
                    self.deliver(from, to, env);
                }
            }
            Action::PrefillStep(id) => self.prefill_step(id),
            Action::DecodeStep(req) => {
                self.dec.engine_mut().focus = Some(req);
                let alive = self.alive();
                let mut link = DecodeWire { cfg: self.cfg, net: &mut self.net, alive: &alive, ghosts: &mut self.ghosts, seen: Vec::new() };
                let stepped = self.dec.step(&mut link);
                let seen = link.seen;
                self.violate_all(seen);
                if let Err(e) = stepped {
                    self.violate(Prop::ReadIsolation, format!("decode step of {req} failed: {e}"));
                }
                self.drain_engine();
            }
            Action::DecodeTick => {
                self.budget.decode_ticks -= 1;
                self.dec_now += self.cfg.decode_tick_ms;
                self.decode_event(DecodeEvent::Tick { now_ms: self.dec_now });
            }
            Action::GatewayTick => {
                self.budget.gateway_ticks -= 1;
                self.gw_now += TICK_MS;
                for g in 0..self.gws.len() {
                    if !self.dead.contains(&(g as u8)) {
                        let acts = self.gws[g].handle(GatewayEvent::Tick { now_ms: self.gw_now });
                        self.gateway_actions(g, acts);
                    }
                }
            }
            Action::LoseGateway(g) => self.lose_gateway(g),
            Action::CrashPrefill(id) => self.crash_prefill(id),
            Action::CloseOvertakes(from) => {
                self.budget.close_overtakes -= 1;
                let Some(q) = self.net.get_mut(&(from, Node::Decode)) else { return };
                let Some(at) = q.iter().position(|e| matches!(e, Envelope::Closed)) else { return };
                // Two-sided: the frames it overtook go with the reader. One-sided: writes
                // already issued cannot be withdrawn, so they land after the close.
                let closed = if self.cfg.variant == Variant::OneSidedWrites { q.remove(at) } else { q.drain(..=at).next_back() };
                if q.is_empty() {
                    self.net.remove(&(from, Node::Decode));
                }
                if let Some(env) = closed {
                    self.deliver(from, Node::Decode, env);
                }
            }
            Action::PrefillTick(id) => {
                self.budget.prefill_ticks -= 1;
                let Some(p) = self.prefills.iter_mut().find(|p| p.id == id) else { return };
                p.now += TICK_MS;
                let now_ms = p.now;
                self.prefill_event(id, PrefillEvent::Tick { now_ms });
            }
        }
    }

    fn pop(&mut self, from: Node, to: Node, index: usize) -> Option<Envelope> {
        let q = self.net.get_mut(&(from, to))?;
        let env = q.remove(index);
        if q.is_empty() {
            self.net.remove(&(from, to));
        }
        env
    }

    pub(super) fn submit(&mut self, req: RequestId) {
        let Some(r) = request(self.cfg, req) else { return };
        self.ghost(req).submitted = true;
        // A cache-scoped tenant's requests share one prompt, and so do the tenants.
        let tokens = match r.tenant {
            Some(_) => (0..r.prompt).map(|t| 100 + t).collect(),
            None => (0..r.prompt).map(|t| req.0 as u32 * 10 + t).collect(),
        };
        let secret = CacheSecret::from_random([7; 32]);
        let g = Self::gateway_index(req);
        let acts = self.gws[g].handle(GatewayEvent::Submit {
            req,
            submission: Submission {
                tokens,
                max_tokens: r.max_tokens,
                max_tokens_set: true,
                sampling: Sampling::default(),
                stop: vec![],
                trace: TraceContext::default(),
                tenant: TenantId(r.tenant.map_or(0, u32::from)),
                cache: r.tenant.map(|t| secret.scope(&format!("tenant-{t}"), None)),
                priority: 0,
            },
        });
        self.gateway_actions(g, acts);
    }

    fn deliver(&mut self, from: Node, to: Node, env: Envelope) {
        match (to, env) {
            (Node::Gateway(g), _) if self.dead.contains(&g) => {}
            (Node::Gateway(g), Envelope::Msg(msg)) => {
                let from = match from {
                    Node::Prefill(w) => w,
                    Node::Gateway(_) | Node::Decode => DECODE,
                };
                let acts = self.gws[usize::from(g)].handle(GatewayEvent::FromWorker { from, msg });
                self.gateway_actions(usize::from(g), acts);
            }
            (Node::Gateway(g), Envelope::Closed) => {
                if let Node::Prefill(id) = from {
                    let acts = self.gws[usize::from(g)].handle(GatewayEvent::WorkerLeft { id });
                    self.gateway_actions(usize::from(g), acts);
                }
            }
            (Node::Decode, env) => {
                let ev = match (from, env) {
                    (Node::Prefill(w), Envelope::Msg(msg)) => DecodeEvent::Prefill { from: w, msg },
                    (Node::Prefill(w), Envelope::Closed) => DecodeEvent::PrefillClosed { from: w },
                    (Node::Gateway(g), Envelope::Msg(msg)) => DecodeEvent::Gateway { from: GatewayId(g), msg },
                    (Node::Gateway(g), Envelope::Closed) => DecodeEvent::GatewayLost { gateway: GatewayId(g) },
                    (Node::Decode, Envelope::Msg(_)) => return,
                    (Node::Decode, Envelope::Closed) => return,
                };
                self.decode_event(ev);
            }
            (Node::Prefill(w), Envelope::Msg(msg)) => {
                let ev = match from {
                    Node::Gateway(g) => PrefillEvent::Gateway { from: GatewayId(g), msg },
                    Node::Decode | Node::Prefill(_) => PrefillEvent::Decode { from: DECODE, msg },
                };
                self.prefill_event(w, ev);
            }
            (Node::Prefill(w), Envelope::Closed) => {
                let ev = match from {
                    Node::Gateway(g) => PrefillEvent::GatewayLost { gateway: GatewayId(g) },
                    Node::Decode | Node::Prefill(_) => PrefillEvent::DecodeLost { decode: DECODE },
                };
                self.prefill_event(w, ev);
            }
        }
    }
}
