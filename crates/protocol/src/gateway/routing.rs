//! Where queued requests go: the next tenant's head request, to a decode worker that may
//! have room (cache affinity first, then round robin) and a prefill worker (longest cached
//! prefix unless loads are out of balance), within the prefill window.

use std::collections::VecDeque;

use bulkhead_kv::{PageKey, RequestId};

use super::tenants::Usage;
use super::{GatewayAction, GatewayRole, InFlight, Phase, Route, attempt_id};
use crate::admission::{Generate, admit};
use crate::msg::*;

/// Prefill loads (requests routed and not yet streaming) further apart than this are out
/// of balance: the least loaded worker wins over cache affinity (after SGLang's router,
/// scaled to a few workers).
pub const BALANCE_ABS_THRESHOLD: usize = 2;

impl GatewayRole {
    /// Send queued requests on while a decode worker may have room: the tenant of least
    /// recent use per weight goes next, and each queue is first come, first served (a head that does not fit holds
    /// the others back, so a long prompt is not overtaken for ever by short ones).
    pub(super) fn dispatch(&mut self, out: &mut Vec<GatewayAction>) {
        while let Some(tenant) = self.next_tenant() {
            let Some(&req) = self.queues.get(&tenant).and_then(VecDeque::front) else { return };
            let Some(route) = self.pick(req) else { return };
            if !self.prefill_has_room(req, route.prefill) {
                // It waits here, in its tenant's turn, not in the prefill worker's queue
                // behind another tenant's burst; the next prompt to end frees the window.
                return;
            }
            self.last_served = Some(tenant);
            let tokens = self.inflight.get(&req).map_or(0, |f| f.sub.tokens.len() + f.resume.len()) as u64;
            let now_ms = self.now_ms;
            let usage = self.usage.entry(tenant).or_default();
            *usage = Usage { tokens: usage.at(now_ms).saturating_add(tokens), at_ms: now_ms };
            self.unqueue(req);
            // Admitted against the context served when it arrived, perhaps while a role had no
            // worker; a worker that joined since may serve less (the served context is the
            // smallest any worker accepts): check again before anything is reserved (I3, I5).
            let refused = self
                .inflight
                .get(&req)
                .filter(|f| self.cfg.settings.admission_check && f.resume.is_empty())
                .and_then(|f| admit(f.sub.tokens.len(), Generate::Tokens(f.sub.max_tokens as usize), self.max_context).err());
            if let Some(refusal) = refused {
                self.end(&req);
                self.stats.rejected_at_gateway += 1;
                out.push(Self::reject(req, refusal.reason(), refusal.to_string()));
                continue;
            }
            let Some(f) = self.inflight.get_mut(&req) else { continue };
            f.phase = Phase::Reserving;
            f.route = Some(route);
            let resumed = f.resume.len() as u32;
            let msg = Message::Reserve {
                req: attempt_id(req, f.attempt),
                prompt_tokens: f.sub.tokens.len() as u32 + resumed,
                max_tokens: f.sub.max_tokens.saturating_sub(resumed),
                prefill: route.prefill,
                sampling: f.sub.sampling.clone(),
                stop: f.sub.stop.clone(),
                resume: f.resume.clone(),
                prompt: f.sub.tokens.clone(),
                trace: f.sub.trace.clone(),
                cache: f.sub.cache,
            };
            out.push(GatewayAction::ToWorker { to: route.decode, msg });
        }
    }

    /// Where `req` goes: a decode worker that may have room (the one holding the longest
    /// cached prefix of the request's scope, else one receiving a prompt with the same first
    /// page, else round robin) and a prefill worker (not
    /// the one it lost, if another exists), chosen by [`Self::pick_prefill`].
    fn pick(&mut self, req: RequestId) -> Option<Route> {
        let decodes: Vec<WorkerId> = self.decodes.iter().copied().filter(|d| !self.full.contains(d)).collect();
        let avoid = self.inflight.get(&req).and_then(|f| f.avoid);
        if decodes.is_empty() {
            return None;
        }
        self.next_pick = self.next_pick.wrapping_add(1);
        // Round robin over the decode workers, each with the prefill workers that can still
        // reach it; the first decode worker some prefill worker reaches. One that holds a
        // cached prefix of this request's scope goes first (the sort is stable: round robin
        // among equals), so a conversation's next turn goes where its last one ended.
        let keys = self.page_keys(req);
        let first = keys.as_ref().and_then(|k| k.first().copied());
        if let Some(f) = self.inflight.get_mut(&req) {
            f.first_key = first;
        }
        // Next, one where a request with the same first page (so of the same scope) is
        // being transferred: its pages will be published there for this one to share.
        let landing = |d: WorkerId| {
            first.is_some()
                && self.inflight.iter().any(|(r, f)| {
                    *r != req
                        && f.first_key == first
                        && matches!(f.phase, Phase::Reserving | Phase::Prefilling)
                        && f.route.is_some_and(|x| x.decode == d)
                })
        };
        let start = self.next_pick % decodes.len();
        let mut order: Vec<(usize, bool, WorkerId)> =
            decodes.iter().cycle().skip(start).take(decodes.len()).map(|&d| (self.hit(d, keys.as_deref()), landing(d), d)).collect();
        order.sort_by_key(|&(hit, landing, _)| std::cmp::Reverse((hit, landing)));
        for (hit, _, decode) in order {
            let reach: Vec<WorkerId> = self.prefills.iter().copied().filter(|p| !self.unreachable.contains(&(*p, decode))).collect();
            let preferred: Vec<WorkerId> = reach.iter().copied().filter(|p| Some(*p) != avoid).collect();
            let prefills = if preferred.is_empty() { reach } else { preferred };
            if !prefills.is_empty() {
                if hit > 0 {
                    self.stats.decode_routed_by_cache += 1;
                }
                return Some(Route { decode, prefill: self.pick_prefill(keys.as_deref(), &prefills) });
            }
        }
        None
    }

    /// Whether prefill worker `p` may be given `req`'s prompt now: its prompts in flight
    /// (reserving or prefilling) and this one stay within the window, or it has none.
    fn prefill_has_room(&self, req: RequestId, p: WorkerId) -> bool {
        let window = self.cfg.settings.prefill_window_tokens;
        if window == 0 {
            return true;
        }
        let tokens = |f: &InFlight| f.sub.tokens.len() + f.resume.len();
        let busy: usize = self
            .inflight
            .values()
            .filter(|f| f.route.is_some_and(|r| r.prefill == p) && matches!(f.phase, Phase::Reserving | Phase::Prefilling))
            .map(tokens)
            .sum();
        busy == 0 || busy + self.inflight.get(&req).map_or(0, tokens) <= window
    }

    /// The page keys of the prompt of `req`'s next attempt (the client's prompt, then what
    /// earlier attempts generated), if it uses the cache.
    fn page_keys(&self, req: RequestId) -> Option<Vec<PageKey>> {
        let (f, shape) = (self.inflight.get(&req)?, self.shape?);
        let scope = f.sub.cache?;
        let tokens: std::borrow::Cow<'_, [u32]> =
            if f.resume.is_empty() { (&f.sub.tokens[..]).into() } else { [&f.sub.tokens[..], &f.resume[..]].concat().into() };
        Some(scope.page_keys(self.cfg.model_digest, &tokens, shape.page_size as usize))
    }

    /// How many of `keys`, from the first, worker `w` reported cached. Keys are scoped by
    /// tenant and salt, so another scope's entries never count.
    fn hit(&self, w: WorkerId, keys: Option<&[PageKey]>) -> usize {
        match (keys, self.cached.get(&w)) {
            (Some(keys), Some(set)) => keys.iter().take_while(|k| set.contains(k)).count(),
            _ => 0,
        }
    }

    /// The prefill worker with the longest cached run of `keys`, ties broken by load, then
    /// round robin; the least loaded one when loads are out of balance.
    fn pick_prefill(&mut self, keys: Option<&[PageKey]>, prefills: &[WorkerId]) -> WorkerId {
        let start = self.next_pick % prefills.len();
        let order = prefills.iter().cycle().skip(start).take(prefills.len()).copied();
        let load = |p: WorkerId| {
            self.inflight
                .values()
                .filter(|f| f.route.is_some_and(|r| r.prefill == p) && matches!(f.phase, Phase::Reserving | Phase::Prefilling))
                .count()
        };
        let loads: Vec<(WorkerId, usize)> = order.map(|p| (p, load(p))).collect();
        let (min, max) = (loads.iter().map(|l| l.1).min().unwrap_or(0), loads.iter().map(|l| l.1).max().unwrap_or(0));
        let least = loads.iter().min_by_key(|l| l.1).map_or(prefills[start], |l| l.0);
        if max - min > BALANCE_ABS_THRESHOLD {
            self.stats.routed_by_load += 1;
            return least;
        }
        if keys.is_none() {
            return least;
        }
        let best = loads.iter().map(|&(p, l)| (self.hit(p, keys), std::cmp::Reverse(l), p)).max_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        match best {
            Some((h, _, p)) if h > 0 => {
                self.stats.routed_by_cache += 1;
                p
            }
            _ => least,
        }
    }
}
