//! Seeded fault schedules on the real default model: prefill workers run the paged forward
//! pass on their chunks, decode workers run the engine, and every finished output must
//! equal the engine's in-process greedy output for the same prompt, token for token.
//!
//! The default model, Gemma 3 270M and a tiny model of every other architecture.
//! `BULKHEAD_REAL_SCHEDULES=N` runs N schedules on each instead of 12, 8 and 16;
//! `BULKHEAD_SEED=S` replays only schedule S and prints its event log.

use std::sync::Arc;

use bulkhead_faultsim::real::RealModels;
use bulkhead_faultsim::{Options, env_u64, failure_report, run, run_seeds};

#[path = "../../model/tests/support/mod.rs"]
mod support;

/// `n` seeded schedules (or `BULKHEAD_SEED` alone, with its event log) on the model at
/// `path`.
fn schedules_on(path: &std::path::Path, n: u64, test: &str) {
    let loaded = bulkhead_engine::load_model(path, 2).expect("load the model");
    let models = RealModels::new(Arc::new(loaded.model), Arc::new(loaded.tokenizer), 8);
    if let Some(seed) = env_u64("BULKHEAD_SEED") {
        let o = run(&models, seed, Options::default());
        for line in &o.log {
            println!("{line}");
        }
        assert!(o.violations.is_empty(), "{}", failure_report(&o, "real_model", test, 80));
        return;
    }
    let n = env_u64("BULKHEAD_REAL_SCHEDULES").unwrap_or(n);
    let s = run_seeds(&models, 0..n, Options::default());
    println!("faultsim ({}): {} schedules, {} failures", path.display(), s.schedules, s.failures.len());
    println!("faultsim ({}): {:?}", path.display(), s.tally);
    if let Some(first) = s.failures.first() {
        let seeds: Vec<u64> = s.failures.iter().map(|o| o.seed).collect();
        panic!("{}failing seeds: {seeds:?}", failure_report(first, "real_model", test, 60));
    }
    assert!(s.tally.finished >= n, "too few requests finished to compare with the reference: {:?}", s.tally);
}

#[test]
fn seeded_fault_schedules_on_the_real_model_keep_every_invariant() {
    let path = bulkhead_fetch::ensure_default_model(false).expect("default model (bulkhead-fetch)");
    schedules_on(&path, 12, "seeded_fault_schedules_on_the_real_model_keep_every_invariant");
}

/// The second real model: SentencePiece, k-quants, sliding-window layers, 262,144 logits.
#[test]
fn seeded_fault_schedules_on_gemma3_keep_every_invariant() {
    let path = bulkhead_fetch::ensure(&bulkhead_fetch::GEMMA3_270M, false).expect("Gemma 3 270M (bulkhead-fetch)");
    schedules_on(&path, 10, "seeded_fault_schedules_on_gemma3_keep_every_invariant");
}

/// Every architecture with no small real model here, on the tiny models that are held to
/// llama.cpp's logits: the checks, the handoff and the schedules do not depend on the family.
#[test]
fn seeded_fault_schedules_on_every_architecture_keep_every_invariant() {
    let dir = std::env::temp_dir().join(format!("bulkhead-faultsim-tiny-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for (arch, window) in support::LLAMACPP_TINY {
        let path = dir.join(format!("{arch}.gguf"));
        std::fs::write(&path, support::llamacpp_tiny(arch, window).to_bytes()).expect("write the tiny model");
        schedules_on(&path, 16, "seeded_fault_schedules_on_every_architecture_keep_every_invariant");
    }
    let _ = std::fs::remove_dir_all(dir);
}
