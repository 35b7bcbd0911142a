//! A stateright model of Bulkhead's KV handoff protocol that runs the production code.
//!
//! The model's actors are the real [`GatewayRole`] and the production prefill and decode
//! drivers ([`bulkhead_protocol::driver`], which run the real [`PrefillRole`] and
//! [`DecodeRole`]), with a real [`KvPool`] per worker. The model supplies only the
//! transports ([`world`]), a mock model and the broken variants as driver policies
//! ([`drivers`]): the job loop and the action dispatch are the server's own code. The checker chooses every interleaving of message deliveries, client
//! aborts, prefill steps, decode steps, timeouts, message loss, duplication and reordering,
//! and prefill worker crashes, within the budgets of a [`Config`]. A state is the history of
//! choices; its production state is rebuilt by replaying that history, and states are
//! deduplicated by a typed fingerprint of the replayed world ([`bulkhead_fingerprint`],
//! [`world::World::fingerprint`]).
//!
//! The properties ([`model::names`]) are named after the isolation contract's invariants
//! (I1–I4) and are observed on the real pools and roles: reads go through `KvPool::read`,
//! handles are the roles' own (through typed accessors), counts are the pool's.
//! [`Variant`]s are deliberately broken driver policies that prove each property can fail.
//!
//! See `docs/PROTOCOL.md` for the message sequence, the role state diagrams, the
//! properties in words, and how to run the checker and its web explorer.
//!
//! [`GatewayRole`]: bulkhead_protocol::gateway::GatewayRole
//! [`PrefillRole`]: bulkhead_protocol::prefill::PrefillRole
//! [`DecodeRole`]: bulkhead_protocol::decode::DecodeRole
//! [`KvPool`]: bulkhead_kv::KvPool
#![forbid(unsafe_code)]

pub mod config;
pub mod drivers;
pub mod model;
pub mod world;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use stateright::{Checker, HasDiscoveries, Model};

pub use config::{Config, Faults, Request, Variant};
pub use model::{HandoffModel, State, names};
pub use world::{Action, Prop, World};

/// What one checker run found.
#[derive(Debug)]
pub struct Report {
    /// Configuration name.
    pub name: &'static str,
    /// Driver variant.
    pub variant: Variant,
    /// Distinct states (fingerprints) explored.
    pub unique_states: usize,
    /// States generated, duplicates included.
    pub states: usize,
    /// Longest path explored.
    pub max_depth: usize,
    /// Wall time.
    pub elapsed: Duration,
    /// Discoveries by property name: a counterexample (always, eventually) or an example
    /// (sometimes), as the actions leading to it and the final state's dump.
    pub discoveries: BTreeMap<&'static str, (Vec<Action>, String)>,
}

impl Report {
    /// Names of the properties with a counterexample.
    pub fn failures(&self, model: &HandoffModel) -> Vec<&'static str> {
        model
            .properties()
            .iter()
            .filter(|p| p.expectation.discovery_is_failure() && self.discoveries.contains_key(p.name))
            .map(|p| p.name)
            .collect()
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} ({:?}): {} unique states, {} generated, depth {}, {:.1?}",
            self.name, self.variant, self.unique_states, self.states, self.max_depth, self.elapsed
        )?;
        for (name, (path, last)) in &self.discoveries {
            writeln!(f, "  discovered: {name}\n    path: {path:?}\n    last state:\n{}", indent(last, 6))?;
        }
        Ok(())
    }
}

fn indent(s: &str, n: usize) -> String {
    let pad = " ".repeat(n);
    s.lines().map(|l| format!("{pad}{l}\n")).collect()
}

/// Breadth-first check of `cfg` on one thread (so the state count is deterministic), until
/// every property is decided or, with `stop_at_failure`, until the first counterexample.
pub fn check(cfg: Config, stop_at_failure: bool) -> Report {
    run(cfg, if stop_at_failure { HasDiscoveries::AnyFailures } else { HasDiscoveries::All })
}

/// Breadth-first search of `cfg` for a discovery of the property named `property` (it
/// stops at the first one, or when the state space is exhausted).
pub fn find(cfg: Config, property: &'static str) -> Report {
    run(cfg, HasDiscoveries::AnyOf([property].into_iter().collect()))
}

fn run(cfg: Config, finish_when: HasDiscoveries) -> Report {
    let name = cfg.name;
    let variant = cfg.variant;
    let model = HandoffModel::new(cfg);
    let started = Instant::now();
    let checker = model.clone().checker().threads(1).finish_when(finish_when).spawn_bfs().join();
    let elapsed = started.elapsed();
    let discoveries = checker
        .discoveries()
        .into_iter()
        .map(|(name, path)| {
            let last = path.last_state().world().dump();
            (name, (path.into_actions(), last))
        })
        .collect();
    Report {
        name,
        variant,
        unique_states: checker.unique_state_count(),
        states: checker.state_count(),
        max_depth: checker.max_depth(),
        elapsed,
        discoveries,
    }
}
