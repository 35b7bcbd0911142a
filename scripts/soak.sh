#!/usr/bin/env bash
# Chaos soak (issues 13, 34): `bulkhead serve` with two gateways and two workers of each
# role under 16 clients (half on each gateway) for 10 minutes, a random worker or gateway
# killed with SIGKILL every 2 minutes, and a keyless attacker trickling handshakes into a
# decode worker's KV port the whole time; prints outcomes, unclean requests, pages free,
# RSS and isolation-check failures (scripts/soak.py).
#
#   bash scripts/soak.sh                 # 10 minutes, release build
#   bash scripts/soak.sh --short         # 1 minute: a prefill, a gateway and a decode kill (CI)
#
# BULKHEAD_BIN picks the binary (default: a release build made here).
set -euo pipefail
cd "$(dirname "$0")/.."
args=(--duration 600 --kill-every 120)
if [[ "${1:-}" == "--short" ]]; then
    args=(--duration 60 --kills 15:prefill,30:gateway,45:decode --max-prompt 2000 --clients 8)
fi
if [[ -z "${BULKHEAD_BIN:-}" ]]; then
    cargo build --quiet --release -p bulkhead
    BULKHEAD_BIN="${CARGO_TARGET_DIR:-target}/release/bulkhead"
fi
log=$(mktemp)
out=$(mktemp)
# The pools' cache pages are on the operator's page: soak.py reads it with this key.
export BULKHEAD_ADMIN_KEY="soak-operator-$RANDOM$RANDOM"
"$BULKHEAD_BIN" serve --port 0 --gateways 2 --prefill-workers 2 --decode-workers 2 --audit-kv >"$out" 2>"$log" &
serve=$!
status=0
# serve's log stays for a failed soak, to read what the gateway and workers said.
trap 'kill $serve 2>/dev/null; wait $serve 2>/dev/null; rm -f "$out"; if [[ $status == 0 ]]; then rm -f "$log"; else echo "soak: serve log kept at $log"; fi' EXIT
addrs=""
for _ in $(seq 1 600); do
    # Every gateway's HTTP address, comma-separated.
    addrs=$(grep -o 'http://[^ ]*' "$out" | sed 's|http://||' | paste -sd, - || true)
    [[ -n "$addrs" ]] && break
    sleep 0.2
done
[[ -n "$addrs" ]] || { echo "soak: serve did not start"; cat "$log"; status=1; exit 1; }
python3 scripts/soak.py --addr "$addrs" --serve-pid "$serve" --log "$log" "${args[@]}" || status=$?
kill -0 "$serve" 2>/dev/null || { echo "soak: serve exited"; tail -20 "$log"; status=1; }
exit "$status"
