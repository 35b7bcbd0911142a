//! `bulkhead-modelcheck [check|explore] [CONFIG] [VARIANT] [ADDR]`
//!
//! - `check` (default): run the breadth-first checker and print the states explored and
//!   every discovery (counterexamples with their paths).
//! - `explore`: serve stateright's web explorer (default `localhost:3000`).
//!
//! CONFIG: `three-requests` (default), `faulty-network`, `duplicating-network`,
//! `reordering-network`, `prefill-restart`, `keepalive`, `growth`, `prefix-cache`,
//! `decode-cache`, `decode-local`, `batched-prefill`, `two-gateways`. VARIANT:
//! `production` (default), `trust-done`, `read-past-watermark`, `keep-rejected-job`,
//! `release-quarantine-on-tick`, `retry-after-reject`, `drop-fence`,
//! `keep-retracted-running`, `unscoped-cache-keys`, `one-decode-scope`,
//! `one-sided-writes`, `ignore-gateway-loss`.

use std::process::ExitCode;

use bulkhead_modelcheck::{Config, HandoffModel, Variant, check};
use stateright::Model;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map_or("check", String::as_str);
    let config = match args.get(1).map_or("three-requests", String::as_str) {
        "three-requests" => Config::three_requests(),
        "faulty-network" => Config::faulty_network(),
        "duplicating-network" => Config::duplicating_network(),
        "reordering-network" => Config::reordering_network(),
        "prefill-restart" => Config::prefill_restart(),
        "ucx-restart" => Config::ucx_restart(),
        "keepalive" => Config::keepalive(),
        "growth" => Config::growth(),
        "speculation" => Config::speculation(),
        "prefix-cache" => Config::prefix_cache(),
        "decode-cache" => Config::decode_cache(),
        "decode-local" => Config::decode_local(),
        "batched-prefill" => Config::batched_prefill(),
        "two-gateways" => Config::two_gateways(),
        other => {
            eprintln!(
                "unknown configuration {other:?}: three-requests | faulty-network | duplicating-network | reordering-network | prefill-restart | ucx-restart | keepalive | growth | speculation | prefix-cache | decode-cache | decode-local | batched-prefill | two-gateways"
            );
            return ExitCode::FAILURE;
        }
    };
    let variant = match args.get(2).map_or("production", String::as_str) {
        "production" => Variant::Production,
        "trust-done" => Variant::TrustDone,
        "read-past-watermark" => Variant::ReadPastWatermark,
        "keep-rejected-job" => Variant::KeepRejectedJob,
        "release-quarantine-on-tick" => Variant::ReleaseQuarantineOnTick,
        "retry-after-reject" => Variant::RetryAfterReject,
        "drop-fence" => Variant::DropFence,
        "ignore-gateway-loss" => Variant::IgnoreGatewayLoss,
        "keep-retracted-running" => Variant::KeepRetractedRunning,
        "unscoped-cache-keys" => Variant::UnscopedCacheKeys,
        "one-decode-scope" => Variant::OneDecodeScope,
        "one-sided-writes" => Variant::OneSidedWrites,
        "keep-rejected-drafts" => Variant::KeepRejectedDrafts,
        other => {
            eprintln!("unknown variant {other:?}");
            return ExitCode::FAILURE;
        }
    };
    let config = config.with_variant(variant);
    match mode {
        "check" => {
            let model = HandoffModel::new(config.clone());
            let report = check(config, false);
            println!("{report}");
            let failures = report.failures(&model);
            if failures.is_empty() {
                println!("all properties hold");
                ExitCode::SUCCESS
            } else {
                println!("FAILED: {failures:?}");
                ExitCode::FAILURE
            }
        }
        "explore" => {
            let addr = args.get(3).cloned().unwrap_or_else(|| "localhost:3000".into());
            println!("serving the stateright explorer on http://{addr}/ (Ctrl-C to stop)");
            HandoffModel::new(config).checker().serve(addr);
            ExitCode::SUCCESS
        }
        other => {
            eprintln!("unknown mode {other:?}: check | explore");
            ExitCode::FAILURE
        }
    }
}
