#!/usr/bin/env bash
# bench-noisy.sh - the noisy neighbour: tenant B's SLO attainment alone and while tenant A
# overloads the server, both open-loop (Poisson), on `bulkhead serve` with a tenants file
# (A: max_concurrent_requests = 8) and, for contrast, on llama-server (no tenants: the
# two streams share one queue).
#
# Usage:
#   scripts/bench-noisy.sh [--model PATH] [--threads N] [--rate-a R] [--rate-b R]
#                          [--window-s S] [--servers LIST] [--serve-args ARGS] [--out DIR]
#
#   --model PATH     GGUF (env MODEL; default $BULKHEAD_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   --threads N      threads per server process (env THREADS; default: nproc)
#   --rate-a R       tenant A's rate, requests/s (env RATE_A; default 2.0: several times
#                    Bulkhead's chat-pair goodput on 2 cores)
#   --rate-b R       tenant B's rate (env RATE_B; default 0.3)
#   --window-s S     arrivals per point for S seconds (env WINDOW_S; default 60)
#   --servers LIST   bulkhead, llamacpp, in order (env SERVERS; default bulkhead,llamacpp)
#   --serve-args A   extra `bulkhead serve` flags, e.g. "--core-budget split" (env SERVE_ARGS)
#   --out DIR        results (env OUT; default $CACHE_DIR/noisy/<UTC timestamp>)
#
# Per server, fresh: 5 warm-up requests, then point 1: B alone at RATE_B; point 2: A at
# RATE_A and B at RATE_B in one window. 512-word prompts, 128 output tokens (ignore_eos),
# judged on the chat pair (TTFT <= 2500 ms, TPOT <= 100 ms). A request over its tenant's
# limit gets 429 and counts as a miss for its tenant. The figure: B's attainment with A
# overloading / B's attainment alone. B alone runs as tenant 0 and beside A as tenant 1,
# so its arrival times differ between the points (same rate, another seeded stream).
# llama-server's requests still waiting after 180 s are cut (they missed the SLO anyway).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench-lib.sh
source scripts/bench-lib.sh

LLAMA_SERVER="$CACHE_DIR/build/bin/llama-server"
MODEL="${MODEL:-$BULKHEAD_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
THREADS="${THREADS:-$(nproc 2>/dev/null || echo 2)}"
RATE_A="${RATE_A:-2.0}"
RATE_B="${RATE_B:-0.3}"
WINDOW_S="${WINDOW_S:-60}"
SERVERS="${SERVERS:-bulkhead,llamacpp}"
SERVE_ARGS="${SERVE_ARGS:-}"
OUT="${OUT:-}"
SEED=4343
CTX=2048
SLOTS=64

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --rate-a) RATE_A="$2"; shift 2 ;;
    --rate-b) RATE_B="$2"; shift 2 ;;
    --window-s) WINDOW_S="$2"; shift 2 ;;
    --servers) SERVERS="$2"; shift 2 ;;
    --serve-args) SERVE_ARGS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
done

[[ "$SERVERS" != *llamacpp* || -x "$LLAMA_SERVER" ]] || bash scripts/bench-llamacpp.sh --build-only
[[ -f "$MODEL" ]] || cargo run --quiet -p bulkhead-fetch --example fetch-model smollm2-135m
[[ -f "$MODEL" ]] || die "model not found: $MODEL"
log "building bulkhead (release)"
cargo build --release -p bulkhead
BULKHEAD="${CARGO_TARGET_DIR:-$PWD/target}/release/bulkhead"

[[ -n "$OUT" ]] || OUT="$CACHE_DIR/noisy/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$OUT"

PID=""
stop_server() {
  if [[ -n "$PID" ]]; then
    kill "$PID" 2>/dev/null || true
    wait "$PID" 2>/dev/null || true
    PID=""
  fi
}
trap stop_server EXIT
trap 'exit 130' INT TERM

KEY_A="sk-noisy-a-$RANDOM$RANDOM"
KEY_B="sk-noisy-b-$RANDOM$RANDOM"
cat > "$OUT/tenants.toml" <<EOF
[[tenant]]
name = "a"
api_keys = ["$KEY_A"]
max_concurrent_requests = 8

[[tenant]]
name = "b"
api_keys = ["$KEY_B"]
EOF
KV_TOKENS=$((SLOTS * CTX))
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -srm); $(nproc) CPUs; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
  echo "bulkhead: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (dirty tree)') serve --threads $THREADS --context-length $CTX --kv-pool-tokens $KV_TOKENS --tenants (A: max_concurrent_requests = 8) $SERVE_ARGS"
  echo "llama-server: -t $THREADS -tb $THREADS -np $SLOTS -c $KV_TOKENS"
  echo "load: B alone at $RATE_B req/s, then A at $RATE_A and B at $RATE_B req/s; $WINDOW_S s each; seed $SEED; chat SLO pair"
} | tee "$OUT/setup.txt"

point() { # SERVER PORT NAME RATES KEYS... : one open-loop point
  local server="$1" port="$2" name="$3" rates="$4"; shift 4
  local keys=()
  for k in "$@"; do keys+=(--tenant-key "$k"); done
  local timeout=()
  [[ "$server" == llamacpp ]] && timeout=(--read-timeout-s 180)
  BULKHEAD_LOG=warn "$BULKHEAD" loadgen "http://127.0.0.1:$port" --tenant-rates "$rates" "${keys[@]}" \
    --duration-s "$WINDOW_S" --warmup 5 --seed "$SEED" --prompt-tokens 512 --output-tokens 128 \
    --slo-ttft-ms 2500 --slo-tpot-ms 100 "${timeout[@]}" --label "$server" \
    --json-out "$OUT/$server-$name.json" | tee "$OUT/$server-$name.txt"
}

IFS=, read -r -a SERVER_LIST <<< "$SERVERS"
for server in "${SERVER_LIST[@]}"; do
  port=$(free_port)
  case "$server" in
    llamacpp)
      "$LLAMA_SERVER" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -np "$SLOTS" -c "$KV_TOKENS" \
        --host 127.0.0.1 --port "$port" > "$OUT/llama-server.log" 2>&1 &
      PID=$!
      wait_ready "http://127.0.0.1:$port" /health ;;
    bulkhead)
      # shellcheck disable=SC2086
      BULKHEAD_LOG=warn "$BULKHEAD" serve --model "$MODEL" --threads "$THREADS" --context-length "$CTX" \
        --kv-pool-tokens "$KV_TOKENS" --prefill-kv-pool-tokens $((8 * CTX)) --tenants "$OUT/tenants.toml" \
        $SERVE_ARGS --port "$port" > "$OUT/bulkhead-serve.log" 2>&1 &
      PID=$!
      wait_ready "http://127.0.0.1:$port" /ready ;;
    *) die "unknown server: $server (bulkhead, llamacpp)" ;;
  esac
  log "$server: B alone (loadavg $(cut -d' ' -f1-3 /proc/loadavg))"
  point "$server" "$port" b-alone "$RATE_B" "$KEY_B"
  log "$server: A overloading beside B"
  point "$server" "$port" a-and-b "$RATE_A,$RATE_B" "$KEY_A" "$KEY_B"
  stop_server
done

python3 - "$OUT" "$SERVERS" <<'PY' | tee "$OUT/summary.md"
import json, os, sys
out, servers = sys.argv[1], sys.argv[2].split(",")
names = {"llamacpp": "llama-server", "bulkhead": "Bulkhead"}
print(open(os.path.join(out, "setup.txt")).read())
print("| server | B alone: sent, chat pair (TTFT / TPOT) | beside A: B sent, chat pair (TTFT / TPOT) | A: sent, ok, chat pair | B with A / B alone |")
print("|---|---|---|---|---|")
fmt = lambda a: f"{a['both'] * 100:.0f}% ({a['ttft'] * 100:.0f} / {a['tpot'] * 100:.0f})"
for s in servers:
    alone = json.load(open(os.path.join(out, f"{s}-b-alone.json")))["points"][0]
    both = json.load(open(os.path.join(out, f"{s}-a-and-b.json")))["points"][0]
    a, b = both["tenants"][0], both["tenants"][1]
    ba, bb = alone["attainment"][0], b["attainment"][0]
    ratio = f"{bb['both'] / ba['both']:.2f}" if ba["both"] > 0 else "n/a (B alone 0%)"
    print(f"| {names.get(s, s)} | {alone['sent']}, {fmt(ba)} | {b['sent']}, {fmt(bb)} | {a['sent']}, {a['ok']}, {fmt(a['attainment'][0])} | **{ratio}** |")
PY
log "done; results in $OUT"
