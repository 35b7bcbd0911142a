//! The stateright [`Model`]: states are histories of actions, replayed on the production
//! code; the checker deduplicates them by the fingerprint of the replayed world.

use std::collections::BTreeMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use bulkhead_fingerprint::Fingerprinter;
use stateright::{Model, Property};

use crate::config::Config;
use crate::world::{Action, Prop, World};

/// The KV handoff protocol, on the production state machines, under one configuration.
#[derive(Clone, Debug)]
pub struct HandoffModel {
    cfg: Arc<Config>,
}

impl HandoffModel {
    /// The model of a configuration.
    pub fn new(cfg: Config) -> Self {
        HandoffModel { cfg: Arc::new(cfg) }
    }

    /// Its configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    fn capture(&self, history: Vec<Action>) -> State {
        // Violations are reported in the state whose step caused them, not in every state
        // after it: stateright keeps the last violating state it meets as the counterexample,
        // and a sticky flag would make that the longest path instead of the shortest.
        let (prefix, last) = history.split_at(history.len().saturating_sub(1));
        let mut w = World::replay(&self.cfg, prefix);
        let before: Vec<Prop> = w.violations().keys().copied().collect();
        for a in last {
            w.apply(a);
        }
        w.check_state();
        let violations: BTreeMap<Prop, String> =
            w.violations().iter().filter(|(p, _)| !before.contains(p)).map(|(p, why)| (*p, why.clone())).collect();
        let mut h = Fingerprinter::new();
        w.fingerprint(&mut h);
        h.write(&violations.keys().collect::<Vec<_>>());
        State {
            cfg: Arc::clone(&self.cfg),
            key: h.finish(),
            enabled: w.enabled(),
            violations,
            ended: w.requests_ended(),
            clean: w.is_clean(),
            served: w.all_served() && w.is_clean(),
            resumed: w.all_served() && w.is_clean() && w.retractions() > 0,
            shared: w.all_served() && w.is_clean() && w.cache_hit_and_eviction(),
            batched: w.all_served() && w.is_clean() && w.batched(),
            local: w.all_served() && w.is_clean() && w.local_prefills() > 0,
            contended: w.all_served() && w.is_clean() && w.capacity_refusals() > 0,
            survived: w.survived_gateway_loss(),
            history,
        }
    }
}

/// A state of the model: the actions taken from the initial world, and what the replayed
/// world showed (its fingerprint, enabled actions, property observations).
#[derive(Clone)]
pub struct State {
    cfg: Arc<Config>,
    /// Actions from the initial world.
    pub history: Vec<Action>,
    /// Fingerprint of the replayed world (the state's identity).
    pub key: u128,
    enabled: Vec<Action>,
    /// Violations caused by the step into this state (or true of this state), with the
    /// reason for each.
    pub violations: BTreeMap<Prop, String>,
    /// Every request submitted and ended for its client.
    pub ended: bool,
    /// Clean end: every request ended, nothing in flight, every pool full.
    pub clean: bool,
    /// Clean end where every request that fits finished and every other one was rejected.
    pub served: bool,
    /// `served`, after the decode loop retracted a sequence to let another grow.
    pub resumed: bool,
    /// `served`, after a prompt page was shared from the prefix cache and one was evicted.
    pub shared: bool,
    /// `served`, after a prefill step interleaved the chunks of two jobs.
    pub batched: bool,
    /// `served`, after the decode worker computed a request's rest itself.
    pub local: bool,
    /// `served`, after the decode worker refused a reservation for want of room.
    pub contended: bool,
    /// Clean end after a gateway died, every request of the others finished.
    pub survived: bool,
}

impl State {
    /// Replays the state's history into a fresh world and runs the state checks (for dumps
    /// and tests).
    pub fn world(&self) -> World<'_> {
        let mut w = World::replay(&self.cfg, &self.history);
        w.check_state();
        w
    }
}

impl PartialEq for State {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl Eq for State {}

impl Hash for State {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.key.hash(h);
    }
}

impl fmt::Debug for State {
    /// The replayed world, for counterexamples and the web explorer.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "after {} steps (fingerprint {:032x})", self.history.len(), self.key)?;
        f.write_str(&self.world().dump())
    }
}

/// Property names, each after the invariant it checks.
pub mod names {
    /// I1, I2.
    pub const READ_ISOLATION: &str =
        "I1+I2 always: every read is of a slot leased to the reader, at its current generation, below its watermark, holding its own KV";
    /// I2.
    pub const VERIFIED_COVERAGE: &str = "I2 always: decode starts a sequence only when its verified coverage equals its reservation";
    /// I1.
    pub const SINGLE_LEASE: &str = "I1 always: no page is in two leases";
    /// I4.
    pub const NO_LATE_WRITES: &str = "I4 always: no page returns to the free list while a chunk for it may still arrive";
    /// I3, the workers' view.
    pub const REJECTION_TERMINAL: &str = "I3 always: a rejected request never reaches Reserve, transfer or decode";
    /// I3, the client's view.
    pub const ONE_OUTCOME: &str = "I3 always: no request has two terminal outcomes, and none over capacity finishes";
    /// I7 (prefix-cache configurations).
    pub const CACHE_FENCE: &str = "I7 always: no cache lookup reaches a page of another tenant or salt";
    /// I3, the client's view (only with `Config::check_original_error`).
    pub const ORIGINAL_ERROR: &str =
        "I3 always: an over-capacity request the workers refuse is answered with that refusal (HTTP 400), not a failure";
    /// Liveness, with clean pools.
    pub const ENDS_CLEAN: &str = "eventually: every request ends and all pools are full";
    /// Liveness, requests only (configurations with message loss).
    pub const ENDS: &str = "eventually: every request ends";
    /// Reachability of the happy path.
    pub const SERVED: &str = "sometimes: every request that fits finishes, the other is rejected, all pools full";
    /// Reachability of a prefix-cache hit and an eviction, on the happy path.
    pub const SHARED: &str = "sometimes: a cached page is shared within its tenant and one is evicted for another prompt, and every request finishes, all pools idle";
    /// Reachability of batched prefill, on the happy path.
    pub const BATCHED: &str =
        "sometimes: one prefill step computes the chunks of two jobs, and every request still finishes, all pools full";
    /// Reachability of a rest computed on the decode worker, on the happy path.
    pub const LOCAL: &str =
        "sometimes: the decode worker computes a request's short rest itself, and every request finishes, all pools idle";
    /// Reachability of two gateways contending for one decode pool (several gateways).
    pub const CONTENDED: &str = "sometimes: the decode worker refuses a gateway's reservation for want of room that another gateway's request holds, and every request still finishes, all pools full";
    /// Reachability of a gateway's death that costs the other gateways nothing.
    pub const SURVIVED: &str =
        "sometimes: a gateway dies with a request in flight, every request of the others still finishes, and all pools end full";
    /// Reachability of KV on demand's retraction, on the happy path.
    pub const RESUMED: &str = "sometimes: a sequence is retracted for another to grow, and every request still finishes, all pools full";
}

fn holds(s: &State, p: Prop) -> bool {
    !s.violations.contains_key(&p)
}

impl Model for HandoffModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.capture(Vec::new())]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        actions.extend(state.enabled.iter().cloned());
    }

    fn next_state(&self, state: &State, action: Action) -> Option<State> {
        let mut history = Vec::with_capacity(state.history.len() + 1);
        history.extend(state.history.iter().cloned());
        history.push(action);
        Some(self.capture(history))
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut p = vec![
            Property::always(names::READ_ISOLATION, |_, s: &State| holds(s, Prop::ReadIsolation)),
            Property::always(names::VERIFIED_COVERAGE, |_, s: &State| holds(s, Prop::VerifiedCoverage)),
            Property::always(names::SINGLE_LEASE, |_, s: &State| holds(s, Prop::SingleLease)),
            Property::always(names::NO_LATE_WRITES, |_, s: &State| holds(s, Prop::NoLateWrites)),
            Property::always(names::REJECTION_TERMINAL, |_, s: &State| holds(s, Prop::RejectionTerminal)),
            Property::always(names::ONE_OUTCOME, |_, s: &State| holds(s, Prop::OneOutcome)),
        ];
        if self.cfg.prefix_cache || self.cfg.decode_cache {
            p.push(Property::always(names::CACHE_FENCE, |_, s: &State| holds(s, Prop::CacheFence)));
        }
        if self.cfg.check_original_error {
            p.push(Property::always(names::ORIGINAL_ERROR, |_, s: &State| holds(s, Prop::OriginalError)));
        }
        // A lost message that no connection close follows (a lost fence) keeps pages
        // quarantined for ever, by design (I4 prefers a leak to a reuse); with loss in the
        // model, liveness is checked for requests only.
        if self.cfg.faults.lose == 0 {
            p.push(Property::eventually(names::ENDS_CLEAN, |_, s: &State| s.clean));
        } else {
            p.push(Property::eventually(names::ENDS, |_, s: &State| s.ended));
        }
        p.push(Property::sometimes(names::SERVED, |_, s: &State| s.served));
        p.push(Property::sometimes(names::RESUMED, |_, s: &State| s.resumed));
        p.push(Property::sometimes(names::BATCHED, |_, s: &State| s.batched));
        if self.cfg.prefix_cache || self.cfg.decode_cache {
            p.push(Property::sometimes(names::SHARED, |_, s: &State| s.shared));
        }
        if self.cfg.decode_local_prefill > 0 {
            p.push(Property::sometimes(names::LOCAL, |_, s: &State| s.local));
        }
        if self.cfg.gateways > 1 {
            p.push(Property::sometimes(names::CONTENDED, |_, s: &State| s.contended));
        }
        if self.cfg.faults.gateway_losses > 0 {
            p.push(Property::sometimes(names::SURVIVED, |_, s: &State| s.survived));
        }
        p
    }
}
