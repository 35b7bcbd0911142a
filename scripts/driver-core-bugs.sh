#!/usr/bin/env bash
# Puts deliberate bugs into the driver core (crates/protocol/src/driver), one at a time,
# and checks that both checkers catch each: the model checker (the three-requests and
# faulty-network configurations, through its CLI) and the fault schedules (2,000 seeds on
# the mock model). Shows that the checkers verify the code the servers run, not a copy
# of it. Works on a copy of the driver taken at the start and puts that copy back after
# each bug and at the end, whatever happens, so uncommitted edits to the driver survive
# (it never runs `git checkout`). Not in CI (about 4 minutes a bug on 2 cores);
# docs/TESTING.md records a run.
set -euo pipefail
cd "$(dirname "$0")/.."
core=crates/protocol/src/driver
saved=$(mktemp -d)
cp -R "$core/." "$saved/"
# A fresh mtime on every restore, so cargo rebuilds from the restored text.
restore() { cp -R "$saved/." "$core/"; }
trap 'restore; rm -rf "$saved"' EXIT

# name | file | text to replace | replacement
bugs=(
  "decode role never told a request left the loop|decode.rs|            cached.push(if terminal { self.role.finished(e.req()) } else { 0 });|            cached.push(if terminal { let _ = e.req(); 0 } else { 0 });"
  "prefill job's own pages never given back|prefill.rs|            _ => match j.seq.release(pool) {|            _ => match { std::mem::forget(j.seq); Ok::<usize, bulkhead_kv::Unreleased>(0) } {"
  "fences dropped on the way to the decode worker|prefill.rs|            PrefillAction::ToDecode { to, msg } => {|            PrefillAction::ToDecode { msg: Message::Fenced { .. }, .. } => {}\n            PrefillAction::ToDecode { to, msg } => {"
)

cargo build --quiet --release -p bulkhead-modelcheck
status=0
for bug in "${bugs[@]}"; do
  IFS='|' read -r name file from to <<<"$bug"
  restore
  python3 - "$core/$file" "$from" "$to" <<'EOF'
import sys
path, old, new = sys.argv[1], sys.argv[2], sys.argv[3].replace("\\n", "\n")
s = open(path).read()
assert s.count(old) == 1, f"{path}: {old!r} found {s.count(old)} times"
open(path, "w").write(s.replace(old, new))
EOF
  echo "== bug: $name"
  cargo build --quiet --release -p bulkhead-modelcheck
  # Caught if a configuration finds a property failing (faulty-network checks "every
  # request ends" rather than "ends with every pool full", since a lost fence keeps pages
  # quarantined by design; three-requests checks both).
  mc=MISSED
  for cfg in three-requests faulty-network; do
    if target/release/bulkhead-modelcheck check "$cfg" >/tmp/driver-core-bug.log 2>&1; then
      echo "   modelcheck $cfg: every property holds"
    else
      mc=caught
      echo "   modelcheck $cfg: $(grep -E '^FAILED' /tmp/driver-core-bug.log | head -1)"
    fi
  done
  fs=caught
  if BULKHEAD_SCHEDULES=2000 cargo test --quiet -p bulkhead-faultsim --test schedules seeded_fault_schedules \
      >/tmp/driver-core-bug-fs.log 2>&1; then
    fs=MISSED
  else
    echo "   faultsim: $(grep -E 'faultsim: [0-9]+ schedules' /tmp/driver-core-bug-fs.log | head -1); first: $(grep -m1 -E '^  - ' /tmp/driver-core-bug-fs.log | cut -c1-140)"
  fi
  echo "   model checker: $mc; fault schedules: $fs"
  [ "$mc" = caught ] && [ "$fs" = caught ] || status=1
done
exit "$status"
