//! Seeded fault schedules over Bulkhead's production protocol roles and KV pools.
//!
//! A schedule runs the real [`GatewayRole`], [`PrefillRole`] and [`DecodeRole`] and real
//! [`KvPool`]s (every check on, the auditor included) through drivers that do what the
//! processes (`crates/gateway`, `crates/worker`) do, over an in-process transport with a
//! virtual clock. One seed determines everything: the cluster, the requests (fitting, over
//! the context, malformed), client aborts, message delays, connection cuts, bad bytes,
//! worker crashes and restarts, timeouts, and the interleaving of every step. No threads,
//! sockets or wall clock.
//!
//! After each schedule ([`sim::Sim::verdict`]): every request has exactly one terminal
//! outcome at the gateway (or its client left first); every finished output equals the
//! model's reference output for its prompt; nothing that does not fit finishes; every
//! pool is back to full with nothing quarantined and its invariants holding; no model
//! read was refused, found a missing slot, read a poisoned slot or failed the auditor.
//! A failure names its seed; `BULKHEAD_SEED=<seed>` replays exactly that schedule.
//!
//! # Layout
//! - [`dice`]: the seeded random source of a schedule.
//! - [`plan`]: what a schedule does, drawn from its seed before it runs.
//! - [`net`]: connections with TCP's guarantees and a deployment's failures.
//! - [`model`]: what a schedule needs of a model; [`mock`]: a CPU mock whose outputs
//!   hash every KV slot they read; [`real`]: the real model and engine.
//! - [`sim`]: the world, its drivers, the loop and the verdict.
//!
//! See `docs/TESTING.md`, "Seeded fault schedules".
//!
//! [`GatewayRole`]: bulkhead_protocol::gateway::GatewayRole
//! [`PrefillRole`]: bulkhead_protocol::prefill::PrefillRole
//! [`DecodeRole`]: bulkhead_protocol::decode::DecodeRole
//! [`KvPool`]: bulkhead_kv::KvPool
#![forbid(unsafe_code)]

pub mod dice;
pub mod mock;
pub mod model;
pub mod net;
pub mod plan;
pub mod real;
pub mod sim;

pub use mock::MockModels;
pub use model::Models;
pub use plan::{Options, Sabotage};
pub use sim::{Outcome, Tally, run};

/// What a batch of schedules found.
#[derive(Debug, Default)]
pub struct Summary {
    /// Schedules run.
    pub schedules: u64,
    /// The failed ones, in seed order.
    pub failures: Vec<Outcome>,
    /// Counts over every schedule.
    pub tally: Tally,
}

/// Runs the schedule of every seed in `seeds`.
pub fn run_seeds<M: Models>(models: &M, seeds: impl IntoIterator<Item = u64>, options: Options) -> Summary {
    let mut s = Summary::default();
    for seed in seeds {
        let o = run(models, seed, options);
        s.schedules += 1;
        s.tally += o.tally;
        if !o.violations.is_empty() {
            s.failures.push(o);
        }
    }
    s
}

/// An environment variable as a number, if set and numeric.
pub fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// A failed schedule for a person: the seed, what broke, the end of its event log, and
/// the command that replays it (`target` and `test` name the test target and test).
pub fn failure_report(o: &Outcome, target: &str, test: &str, log_tail: usize) -> String {
    let mut s = format!("schedule with seed {} failed:\n", o.seed);
    for v in &o.violations {
        s.push_str(&format!("  - {v}\n"));
    }
    let from = o.log.len().saturating_sub(log_tail);
    s.push_str(&format!("event log (last {} of {} lines):\n", o.log.len() - from, o.log.len()));
    for line in &o.log[from..] {
        s.push_str(&format!("  {line}\n"));
    }
    s.push_str(&format!("replay: BULKHEAD_SEED={} cargo test -p bulkhead-faultsim --test {target} -- {test} --nocapture\n", o.seed));
    s
}
