//! The properties observed on the real pools and roles: the checks run after every step
//! (I1 single lease, I4 no late writes, the tenant fence) and the end-state predicates
//! the model's properties and examples read.

use std::collections::BTreeMap;

use bulkhead_kv::{KvPool, RequestId};
use bulkhead_protocol::gateway::gateway_of;
use bulkhead_protocol::{Message, RejectReason};

use super::{Envelope, Node, Outcome, Prop, World, request};

/// A live handle on a decode page: a lease or a quarantine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Handle {
    page: u32,
    generation: u64,
    owner: RequestId,
    quarantined: bool,
}

/// A way a chunk for a decode page may still arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct WriteRef {
    page: u32,
    generation: u64,
    req: RequestId,
    via: &'static str,
}

impl World<'_> {
    // ---------------------------------------------------------------- state checks

    /// Checks on the state as it stands (I1 single lease, I4 no late writes), recorded
    /// as violations. Run after every step.
    pub fn check_state(&mut self) {
        let handles = self.handles();
        let refs = self.write_refs();
        let stats = self.dec.engine().pool.stats();
        let mut problems: Vec<(Prop, String)> = Vec::new();
        for p in &self.prefills {
            let refused = p.pool.stats().fence_failures;
            if refused > 0 {
                problems.push((Prop::CacheFence, format!("prefill {} looked up {refused} cached page(s) of another tenant", p.id)));
            }
        }
        if stats.fence_failures > 0 {
            problems.push((Prop::CacheFence, format!("decode looked up {} cached page(s) of another tenant", stats.fence_failures)));
        }
        // I10: every shared page a holder counts is one of the pool's live shared leases.
        let shared = self.shared_handles();
        if shared != stats.shared_leases {
            problems.push((Prop::SingleLease, format!("holders count {shared} shared decode pages, the pool {}", stats.shared_leases)));
        }
        let mut by_page: BTreeMap<u32, &Handle> = BTreeMap::new();
        for h in &handles {
            if let Some(other) = by_page.insert(h.page, h) {
                problems.push((Prop::SingleLease, format!("page {} held twice: {other:?} and {h:?}", h.page)));
            }
        }
        let leased = handles.iter().filter(|h| !h.quarantined).count();
        let quarantined = handles.len() - leased;
        if (stats.leased_pages, stats.quarantined_pages) != (leased, quarantined) {
            problems.push((
                Prop::SingleLease,
                format!(
                    "pool has {} leased / {} quarantined pages, holders have {leased} / {quarantined}",
                    stats.leased_pages, stats.quarantined_pages
                ),
            ));
        }
        for r in &refs {
            match by_page.get(&r.page) {
                Some(h) if h.owner != r.req => problems.push((
                    Prop::SingleLease,
                    format!("page {} is leased to {} while {} may still write it ({})", r.page, h.owner, r.req, r.via),
                )),
                Some(h) if h.generation == r.generation => {}
                _ => problems.push((
                    Prop::NoLateWrites,
                    format!("page {} generation {} left its lease while {} may still write it ({})", r.page, r.generation, r.req, r.via),
                )),
            }
        }
        for (p, why) in problems {
            self.violate(p, why);
        }
    }

    /// Every live handle on a decode page: the decode role's reservations and quarantines,
    /// and the decode loop's sequences.
    fn handles(&self) -> Vec<Handle> {
        let role = self.dec.role().held_pages().into_iter().map(|h| (h.tag, h.quarantined));
        let running = self.dec.engine().running.values().flat_map(|r| r.seq.pages()).filter(|p| !p.is_shared()).map(|l| (**l, false));
        role.chain(running)
            .map(|(tag, quarantined)| Handle { page: tag.page().0, generation: tag.generation().0, owner: tag.owner(), quarantined })
            .collect()
    }

    /// Shared (cached, read-only) decode pages the role's reservations and the decode
    /// loop's sequences hold.
    fn shared_handles(&self) -> usize {
        let role = self.dec.role().shared_pages();
        let running: usize = self.dec.engine().running.values().map(|r| r.seq.pages().iter().filter(|p| p.is_shared()).count()).sum();
        role + running
    }

    /// Every way a chunk for a decode page may still arrive: a `Prefill` on its way to a
    /// live prefill worker that has not fenced it yet, a job in a prefill queue or
    /// running, a chunk on the wire.
    fn write_refs(&self) -> Vec<WriteRef> {
        let mut out = Vec::new();
        for (&(from, to), q) in &self.net {
            for env in q {
                let Envelope::Msg(m) = env else { continue };
                match (m, from, to) {
                    // A job its prefill worker already fenced (a decode worker gave it up
                    // first) is refused when it arrives.
                    (Message::Prefill { req, .. }, _, Node::Prefill(w))
                        if self.prefills.iter().any(|p| p.id == w && p.driver.role().tombstoned(*req)) => {}
                    (Message::Prefill { req, pages, .. }, _, Node::Prefill(_)) => {
                        for p in pages {
                            out.push(WriteRef { page: p.page.0, generation: p.generation.0, req: *req, via: "Prefill on the wire" });
                        }
                    }
                    (Message::KvChunk { req, header, .. }, _, Node::Decode) => {
                        out.push(WriteRef { page: header.page.0, generation: header.generation.0, req: *req, via: "chunk on the wire" });
                    }
                    _ => {}
                }
            }
        }
        for p in &self.prefills {
            for j in p.driver.targets() {
                for r in &j.pages {
                    out.push(WriteRef { page: r.page.0, generation: r.generation.0, req: j.req, via: "prefill job" });
                }
            }
        }
        out
    }

    /// Whether the world is at its clean end: every request submitted and ended for its
    /// client (one terminal outcome, or the client left), nothing on the wire, every role
    /// idle, every pool full.
    pub fn is_clean(&self) -> bool {
        self.requests_ended()
            && self.net.is_empty()
            && self.live_gateways().all(|g| g.in_flight() == 0)
            && self.dec.is_idle()
            && self.prefills.iter().all(|p| p.driver.is_idle())
            && full(&self.dec.engine().pool)
            && self.prefills.iter().all(|p| full(&p.pool))
    }

    /// Every request submitted and ended for its client.
    pub fn requests_ended(&self) -> bool {
        self.ghosts.values().all(|g| g.submitted && (g.client_gone || !g.outcomes.is_empty()))
    }

    /// Whether some prefill worker's cache shared a page and some evicted one.
    pub fn cache_hit_and_eviction(&self) -> bool {
        let decode = self.dec.role().cache_stats();
        let stats = || self.prefills.iter().filter_map(|p| p.driver.cache()).map(|c| c.stats()).chain(decode);
        stats().any(|s| s.hit_tokens > 0) && stats().any(|s| s.evicted_pages > 0)
    }

    /// Requests whose rest the decode worker computed itself so far.
    pub fn local_prefills(&self) -> u64 {
        self.dec.role().stats().local_prefills
    }

    /// Whether some prefill step interleaved the chunks of two jobs.
    pub fn batched(&self) -> bool {
        self.ghosts.values().any(|g| g.batched)
    }

    /// Sequences the decode loop retracted so far.
    pub fn retractions(&self) -> u64 {
        self.dec.engine().retractions
    }

    /// Capacity refusals by the decode worker so far.
    pub fn capacity_refusals(&self) -> u64 {
        self.dec.role().stats().rejected_capacity
    }

    /// Whether a gateway died and the world still ended clean with every request of the
    /// gateways alive finished.
    pub fn survived_gateway_loss(&self) -> bool {
        !self.dead.is_empty()
            && self.is_clean()
            && self
                .ghosts
                .iter()
                .filter(|(req, _)| !self.dead.contains(&gateway_of(**req).0))
                .all(|(_, g)| g.outcomes == [Outcome::Finished])
    }

    /// Every request that fits finished, every one that does not was rejected.
    pub fn all_served(&self) -> bool {
        self.ghosts.iter().all(|(req, g)| {
            let over = request(self.cfg, *req).is_some_and(|r| self.cfg.over_capacity(r));
            g.outcomes == [if over { Outcome::Rejected(RejectReason::ContextLength) } else { Outcome::Finished }]
        })
    }
}

/// Nothing leased, quarantined or read: every page free, or cached with no reader.
pub(super) fn full(pool: &KvPool) -> bool {
    let s = pool.stats();
    s.free_pages + s.cached_pages == s.total_pages && s.shared_leases == 0
}
