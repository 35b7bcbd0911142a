//! Seeded fault schedules on the real default model: prefill workers run the paged forward
//! pass on their chunks, decode workers run the engine, and every finished output must
//! equal the engine's in-process greedy output for the same prompt, token for token.
//!
//! `BULKHEAD_REAL_SCHEDULES=N` runs N schedules instead of 12; `BULKHEAD_SEED=S` replays
//! only schedule S and prints its event log.

use std::sync::Arc;

use bulkhead_faultsim::real::RealModels;
use bulkhead_faultsim::{env_u64, failure_report, run, run_seeds, Options};

#[test]
fn seeded_fault_schedules_on_the_real_model_keep_every_invariant() {
    const TEST: &str = "seeded_fault_schedules_on_the_real_model_keep_every_invariant";
    let path = bulkhead_fetch::ensure_default_model(false).expect("default model (bulkhead-fetch)");
    let loaded = bulkhead_engine::load_model(&path, 2).expect("load the default model");
    let models = RealModels::new(Arc::new(loaded.model), Arc::new(loaded.tokenizer), 8);
    if let Some(seed) = env_u64("BULKHEAD_SEED") {
        let o = run(&models, seed, Options::default());
        for line in &o.log {
            println!("{line}");
        }
        assert!(o.violations.is_empty(), "{}", failure_report(&o, "real_model", TEST, 80));
        return;
    }
    let n = env_u64("BULKHEAD_REAL_SCHEDULES").unwrap_or(12);
    let s = run_seeds(&models, 0..n, Options::default());
    println!("faultsim (real model): {} schedules, {} failures", s.schedules, s.failures.len());
    println!("faultsim (real model): {:?}", s.tally);
    if let Some(first) = s.failures.first() {
        let seeds: Vec<u64> = s.failures.iter().map(|o| o.seed).collect();
        panic!("{}failing seeds: {seeds:?}", failure_report(first, "real_model", TEST, 60));
    }
    assert!(s.tally.finished >= n, "too few requests finished to compare with the reference: {:?}", s.tally);
}
