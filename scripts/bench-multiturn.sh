#!/usr/bin/env bash
# Multi-turn chats against llama-server on the same machine and model: 2 tenants x 8
# conversations x 5 turns, all 16 conversations at once, a 1,000-word system prompt per
# tenant, 32 output tokens per turn (`bulkhead loadgen --scenario multi-turn`). Each rep
# starts both servers fresh (nothing cached from an earlier rep) and runs Bulkhead, then
# llama-server, with the same seed. Prints, per rep, later-turn and first-turn TTFT p50,
# output tok/s and their ratios, and Bulkhead's KV handoff: prompt tokens its decode worker
# received in later turns divided by those turns' new tokens (from its log: each
# request's `reserved held_tokens= ... local=` and `decode finished prompt_tokens=`; a rest
# computed on the decode worker, `local=true`, received nothing; the 16 smallest prompts
# are the first turns), and how many later turns the decode worker computed itself.
#
#   bash scripts/bench-multiturn.sh [--reps N] [--out DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench-lib.sh
source scripts/bench-lib.sh

LLAMA_SERVER="$CACHE_DIR/build/bin/llama-server"
MODEL="${MODEL:-$BULKHEAD_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
THREADS="${THREADS:-$(nproc 2>/dev/null || echo 2)}"
REPS=2
OUT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --reps) REPS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
[[ -x "$LLAMA_SERVER" ]] || bash scripts/bench-llamacpp.sh --build-only
[[ -x "$LLAMA_SERVER" ]] || die "no llama-server at $LLAMA_SERVER"
[[ -f "$MODEL" ]] || cargo run --quiet -p bulkhead-fetch --example fetch-model smollm2-135m
cargo build --quiet --release -p bulkhead
BULKHEAD="$PWD/target/release/bulkhead"
[[ -n "$OUT" ]] || OUT="$CACHE_DIR/multiturn/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$OUT"
printf '[[tenant]]\nname = "a"\napi_keys = ["ka"]\n\n[[tenant]]\nname = "b"\napi_keys = ["kb"]\n' > "$OUT/tenants.toml"
PID=""
stop() { [[ -z "$PID" ]] || { kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; PID=""; }; }
trap stop EXIT
ADMIN="bench-operator-$RANDOM$RANDOM"
metric() { # URL NAME: the sum of a metric's samples on the operator's page
  python3 - "$1" "$2" "$ADMIN" <<'PY'
import sys, urllib.request
# The cache activity is on the operator's page (serve runs with --admin-key "$ADMIN").
req = urllib.request.Request(sys.argv[1] + "/metrics/tenants", headers={"Authorization": "Bearer " + sys.argv[3]})
text = urllib.request.urlopen(req, timeout=5).read().decode()
print(sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(sys.argv[2] + "{") or l.startswith(sys.argv[2] + " ")))
PY
}
load() { # URL OUTFILE SEED
  "$BULKHEAD" loadgen "$1" --scenario multi-turn --tenants 2 --conversations 8 --turns 5 --system-prompt-tokens 1000 \
    --output-tokens 32 --tenant-key ka --tenant-key kb --seed "$3" --json > "$2"
}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(nproc) CPUs; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'); flags: $(grep -m1 -o 'avx512_vnni\|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  echo "bulkhead: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (dirty tree)')"
  echo "llama-server: -t $THREADS -tb $THREADS -np 16 -c 32768"
} | tee "$OUT/setup.txt"
for rep in $(seq "$REPS"); do
  seed=$((1000 + rep))
  port=$(free_port)
  BULKHEAD_LOG=info "$BULKHEAD" serve --model "$MODEL" --threads "$THREADS" --tenants "$OUT/tenants.toml" --admin-key "$ADMIN" --port "$port" \
    > "$OUT/bulkhead-$rep.log" 2>&1 &
  PID=$!
  wait_ready "http://127.0.0.1:$port" /ready
  load "http://127.0.0.1:$port" "$OUT/bulkhead-$rep.json" "$seed"
  sleep 1 # the workers' last metrics
  metric "http://127.0.0.1:$port" bulkhead:kv_transferred_tokens_total > "$OUT/bulkhead-$rep.transferred"
  metric "http://127.0.0.1:$port" bulkhead:kv_held_tokens_total > "$OUT/bulkhead-$rep.held"
  stop
  port=$(free_port)
  "$LLAMA_SERVER" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -np 16 -c 32768 --host 127.0.0.1 --port "$port" \
    > "$OUT/llama-server-$rep.log" 2>&1 &
  PID=$!
  wait_ready "http://127.0.0.1:$port" /health
  load "http://127.0.0.1:$port" "$OUT/llama-server-$rep.json" "$seed"
  stop
done
python3 - "$OUT" "$REPS" <<'PY' | tee "$OUT/summary.txt"
import json, re, sys
out, reps = sys.argv[1], int(sys.argv[2])

def handoff(log):
    """(prompt tokens, tokens received, computed here) of each request that finished, from the decode worker's log."""
    held, local, done = {}, set(), []
    for line in open(log, errors="replace"):
        rid = re.search(r"request_id=(\w+)", line)
        if not rid:
            continue
        if m := re.search(r" reserved held_tokens=(\d+)", line):
            held[rid.group(1)] = int(m.group(1))
            if "local=true" in line:
                local.add(rid.group(1))
        elif m := re.search(r"decode finished prompt_tokens=(\d+)", line):
            here = rid.group(1) in local
            done.append((int(m.group(1)), 0 if here else int(m.group(1)) - held.get(rid.group(1), 0), here))
    return sorted(done)
for rep in range(1, reps + 1):
    b = json.load(open(f"{out}/bulkhead-{rep}.json"))
    l = json.load(open(f"{out}/llama-server-{rep}.json"))
    sent = float(open(f"{out}/bulkhead-{rep}.transferred").read())
    held = float(open(f"{out}/bulkhead-{rep}.held").read())
    reqs = handoff(f"{out}/bulkhead-{rep}.log")
    later_sent = sum(r for _, r, _ in reqs[16:])
    later_local = sum(1 for _, _, here in reqs[16:] if here)
    print(f"rep {rep}: ok {b['ok']}/{b['requests']} bulkhead, {l['ok']}/{l['requests']} llama-server")
    for key, name in [("ttft_later_turns_p50_ms", "TTFT p50 later turns ms"), ("ttft_first_turn_p50_ms", "TTFT p50 first turn ms"),
                      ("output_tokens_per_s", "output tok/s")]:
        print(f"  {name:26} bulkhead {b[key]:9.1f}  llama-server {l[key]:9.1f}  ratio {b[key] / l[key]:.2f}")
    print(f"  cached share of prompt tokens: bulkhead {b['cached_share']:.2f}, llama-server {l['cached_share'] or 0:.2f}")
    print(f"  KV handoff: {sent:.0f} prompt tokens received, {held:.0f} held by the decode worker; later turns received "
          f"{later_sent:.0f} for {b['later_turn_new_tokens']} new tokens: ratio {later_sent / max(b['later_turn_new_tokens'], 1):.2f}; "
          f"{later_local} of {len(reqs) - 16} later turns computed on the decode worker")
PY
