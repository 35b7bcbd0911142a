#!/usr/bin/env bash
# bench-vs-llamacpp.sh - serve the same GGUF with llama.cpp's llama-server and with
# `bulkhead serve`, and run the same `bulkhead loadgen` against both in alternation.
#
# Usage:
#   scripts/bench-vs-llamacpp.sh [--model PATH] [--threads N] [--bulkhead-threads N]
#                                [--ctx N] [--slots N] [--reps N] [--scenarios LIST]
#                                [--out DIR] [--probe] [--isa native|avx2]
#
#   --model PATH          GGUF (env MODEL; default
#                         $BULKHEAD_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   --threads N           llama-server -t/-tb (env THREADS; default: nproc)
#   --bulkhead-threads N  `bulkhead serve --threads` (env BULKHEAD_THREADS_PER_WORKER;
#                         default: --threads). NOTE: serve passes the same --threads to
#                         its prefill AND its decode worker process, so N per worker
#                         means up to 2N compute threads when both are busy.
#   --ctx N               context per request/slot (env CTX; default 8192):
#                         llama-server -c SLOTS*N, bulkhead --context-length N
#   --slots N             llama-server -np N (env SLOTS; default 64). Both servers get
#                         the same KV capacity, SLOTS*CTX tokens: llama-server's -c and
#                         bulkhead's decode pool (--kv-pool-tokens); bulkhead's prefill
#                         pool holds 8*CTX (--prefill-kv-pool-tokens): it keeps only the
#                         prompts being computed and its prefix cache
#   --reps N              alternations A B A B ... per scenario (env REPS; default 2)
#   --scenarios LIST      comma-separated, from single,conc16,mixed64 (env SCENARIOS;
#                         default all three)
#   --out DIR             results (env OUT; default $CACHE_DIR/vs/<UTC timestamp>)
#   --probe               afterwards, run `bulkhead probe` against both servers
#   --isa avx2            both servers on AVX2 only: llama-server from
#                         `bench-llamacpp.sh --isa avx2`'s build, Bulkhead with
#                         BULKHEAD_NO_VNNI=1 (env ISA; default native)
#
# Scenarios (each a `bulkhead loadgen` run; ignore_eos keeps outputs at max_tokens):
#   single: 1 stream,  prompt 512 words (~512 tokens), 128 output tokens, 8 requests
#   conc16: 16 streams, prompt 512, 128 output tokens, 32 requests
#   mixed64: 64 streams, prompts uniform over 50..2000 words, 128 output tokens,
#            64 requests, one wave (needs --ctx >= 2300 or so: a word may be more than a token)
#            loadgen waits up to 1200 s for a response head here (300 by default): the
#            last of 64 long prompts waits that long at a server that takes them in turn
# Each rep uses its own seed (same for both servers) so no server can reuse a cached
# prompt from an earlier rep. Ratios are Bulkhead / llama.cpp of the medians over reps.
#
# The ceiling (issue 17): before the servers start, `bulkhead bench-engine` measures the
# engine's prefill-512 and batch-16 decode rates on this machine, with --threads, decode
# at the contexts conc16 decodes at (512..640; a batch-16 step there costs about 1.6x one
# at 128..192, attention reading 4x the KV); conc16's work, 16 x 512 prompt tokens and
# 16 x 128 output tokens, takes 16*512/prefill + 16*128/decode16 seconds of the engine on
# all these cores, so 16*128 over that is the most output tok/s a schedule gets that runs
# one step at a time on every core. (Two one-thread workers side by side, as the split
# core budget runs them, can pass it a little: they never wait at a barrier.) conc16
# prints Bulkhead / ceiling.
#
# llama-server comes from scripts/bench-llamacpp.sh's cached build (built there on first
# use, ~10 min on 2 cores). Needs: bash, python3, cargo, and what bench-llamacpp.sh needs.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench-lib.sh
source scripts/bench-lib.sh

MODEL="${MODEL:-$BULKHEAD_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
THREADS="${THREADS:-$(nproc 2>/dev/null || echo 2)}"
BH_THREADS="${BULKHEAD_THREADS_PER_WORKER:-}"
CTX="${CTX:-8192}"
SLOTS="${SLOTS:-64}"
REPS="${REPS:-2}"
SCENARIO_LIST="${SCENARIOS:-single,conc16,mixed64}"
OUT="${OUT:-}"
PROBE=0
ISA="${ISA:-native}"

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --bulkhead-threads) BH_THREADS="$2"; shift 2 ;;
    --ctx) CTX="$2"; shift 2 ;;
    --slots) SLOTS="$2"; shift 2 ;;
    --scenarios) SCENARIO_LIST="$2"; shift 2 ;;
    --reps) REPS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --probe) PROBE=1; shift ;;
    --isa) ISA="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
done
BH_THREADS="${BH_THREADS:-$THREADS}"
case "$ISA" in
  native) LLAMA_SERVER="$CACHE_DIR/build/bin/llama-server" ;;
  avx2) LLAMA_SERVER="$CACHE_DIR/build-avx2/bin/llama-server"; export BULKHEAD_NO_VNNI=1 ;;
  *) die "--isa must be native or avx2, not '$ISA'" ;;
esac

[[ -x "$LLAMA_SERVER" ]] || bash scripts/bench-llamacpp.sh --build-only --isa "$ISA"
[[ -x "$LLAMA_SERVER" ]] || die "no llama-server at $LLAMA_SERVER"
[[ -f "$MODEL" ]] || cargo run --quiet -p bulkhead-fetch --example fetch-model smollm2-135m
[[ -f "$MODEL" ]] || die "model not found: $MODEL"
log "building bulkhead (release)"
cargo build --release -p bulkhead
BULKHEAD="$PWD/target/release/bulkhead"

[[ -n "$OUT" ]] || OUT="$CACHE_DIR/vs/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$OUT"
log "bench-engine for the ceiling (--threads $THREADS)"
# Decode timed from context 512 over 128 steps: the contexts conc16's sequences decode at.
# The second run (context 128, bench-engine's default) gives the ceiling as computed
# before 2026-12-04, printed beside it for comparison.
{ BULKHEAD_LOG=warn "$BULKHEAD" bench-engine --model "$MODEL" --threads "$THREADS" --batches 16 --reps 3 \
    --prompt-tokens 512 --decode-context 512 --decode-steps 128
  BULKHEAD_LOG=warn "$BULKHEAD" bench-engine --model "$MODEL" --threads "$THREADS" --batches 16 --reps 3 \
    --prompt-tokens 512 --decode-context 128 | grep '^decode'; } | tee "$OUT/bench-engine.txt"
LPORT=$(free_port)
BPORT=$(free_port)

PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM   # run the EXIT trap on signals too

KV_TOKENS=$((SLOTS * CTX))
log "llama-server on :$LPORT (-t $THREADS -np $SLOTS -c $KV_TOKENS)"
"$LLAMA_SERVER" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -np "$SLOTS" -c "$KV_TOKENS" \
  --host 127.0.0.1 --port "$LPORT" > "$OUT/llama-server.log" 2>&1 &
PIDS+=($!)
log "bulkhead serve on :$BPORT (--threads $BH_THREADS per worker, --context-length $CTX, --kv-pool-tokens $KV_TOKENS)"
BULKHEAD_LOG=warn "$BULKHEAD" serve --model "$MODEL" --threads "$BH_THREADS" --context-length "$CTX" \
  --kv-pool-tokens "$KV_TOKENS" --prefill-kv-pool-tokens $((8 * CTX)) \
  --port "$BPORT" > "$OUT/bulkhead-serve.log" 2>&1 &
PIDS+=($!)

wait_ready "http://127.0.0.1:$LPORT" /health
wait_ready "http://127.0.0.1:$BPORT" /ready
declare -A URL=([llamacpp]="http://127.0.0.1:$LPORT" [bulkhead]="http://127.0.0.1:$BPORT")

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -srm); $(nproc) CPUs; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
  echo "model: $MODEL"
  echo "llama-server: -t $THREADS -tb $THREADS -np $SLOTS -c $KV_TOKENS (llama-cpp-python $LLAMA_CPP_PY_VERSION vendor)"
  echo "bulkhead serve: --threads $BH_THREADS (each of 1 prefill + 1 decode worker) --context-length $CTX --kv-pool-tokens $KV_TOKENS --prefill-kv-pool-tokens $((8 * CTX))"
  echo "bulkhead: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (dirty tree)')"
} | tee "$OUT/setup.txt"

IFS=, read -r -a SCENARIOS <<< "$SCENARIO_LIST"
declare -A ARGS=(
  [single]="-c 1 -n 8 --prompt-tokens 512 --output-tokens 128 --warmup 1"
  [conc16]="-c 16 -n 32 --prompt-tokens 512 --output-tokens 128 --warmup 1"
  [mixed64]="-c 64 -n 64 --prompt-tokens uniform:50:2000 --output-tokens 128 --warmup 1 --read-timeout-s 1200"
)
for sc in "${SCENARIOS[@]}"; do [[ -n "${ARGS[$sc]:-}" ]] || die "unknown scenario: $sc"; done
for sc in "${SCENARIOS[@]}"; do
  for ((rep = 1; rep <= REPS; rep++)); do
    for server in llamacpp bulkhead; do
      seed=$((1000 + rep))
      log "$sc rep $rep/$REPS: $server (seed $seed; loadavg $(cut -d' ' -f1-3 /proc/loadavg))"
      # shellcheck disable=SC2086
      "$BULKHEAD" loadgen "${URL[$server]}" ${ARGS[$sc]} --seed "$seed" --json \
        > "$OUT/$sc.$server.$rep.json"
      echo "$sc $server $rep $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/loadavg.txt"
    done
  done
done

python3 - "$OUT" "$REPS" "$SCENARIO_LIST" <<'PY' | tee "$OUT/summary.md"
import json, re, statistics, sys, os
out, reps, scenarios = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
def load(sc, server):
    return [json.load(open(os.path.join(out, f"{sc}.{server}.{r}.json"))) for r in range(1, reps + 1)]
figs = [("output tok/s", lambda r: r["output_tokens_per_s"]),
        ("TTFT p50 ms", lambda r: r["ttft_ms"]["p50"]),
        ("TTFT p99 ms", lambda r: r["ttft_ms"]["p99"]),
        ("ITL p50 ms", lambda r: r["itl_ms"]["p50"]),
        ("ITL p99 ms", lambda r: r["itl_ms"]["p99"])]
print(open(os.path.join(out, "setup.txt")).read())
prefill, decode16 = None, {}
for line in open(os.path.join(out, "bench-engine.txt")):
    w, rate = line.split(), re.search(r"([0-9.]+) tok/s", line)
    if w[:2] == ["prefill", "512"] and rate:
        prefill = float(rate.group(1))
    if w[:4] == ["decode", "batch", "16", "(ctx"] and rate:
        decode16[int(w[4].rstrip(")"))] = float(rate.group(1))
def ceiling_at(ctx):
    d = decode16.get(ctx)
    return 16 * 128 / (16 * 512 / prefill + 16 * 128 / d) if prefill and d else None
ceiling, old_ceiling = ceiling_at(512), ceiling_at(128)
if ceiling:
    print(f"ceiling for conc16 (bench-engine: prefill 512 {prefill:.1f} tok/s, batch-16 decode from context 512 "
          f"{decode16[512]:.1f} tok/s): {ceiling:.1f} output tok/s")
    if old_ceiling:
        print(f"(priced with decode from context 128 as before 2026-12-04, {decode16[128]:.1f} tok/s: {old_ceiling:.1f})")
    print()
else:
    print("ceiling: bench-engine's figures not found in bench-engine.txt\n")
titles = {"single": "1 stream, 512-token prompt, 128 output tokens",
          "conc16": "16 concurrent streams, 512-token prompts, 128 output tokens",
          "mixed64": "64 concurrent streams, prompts of 50..2000 words, 128 output tokens"}
for sc in scenarios:
    title = titles[sc]
    L, B = load(sc, "llamacpp"), load(sc, "bulkhead")
    bad = [f"{s} rep {i+1}: {r['failed']} failed, {r['short_outputs']} short" for s, rs in (("llama.cpp", L), ("bulkhead", B))
           for i, r in enumerate(rs) if r["failed"] or r["short_outputs"]]
    print(f"### {title} (median of {reps} alternating reps)\n")
    print("| figure | llama.cpp (reps) | Bulkhead (reps) | Bulkhead / llama.cpp |")
    print("|---|---|---|---|")
    for name, f in figs:
        l, b = [f(r) for r in L], [f(r) for r in B]
        ml, mb = statistics.median(l), statistics.median(b)
        fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)
        print(f"| {name} | {ml:.1f} ({fmt(l)}) | {mb:.1f} ({fmt(b)}) | {mb / ml:.2f} |")
    if sc == "conc16" and ceiling:
        mb = statistics.median(r["output_tokens_per_s"] for r in B)
        print(f"\nBulkhead output tok/s / ceiling: {mb:.1f} / {ceiling:.1f} = {mb / ceiling:.2f} (issue 17 target >= 0.9)")
        if old_ceiling:
            print(f"(/ the context-128 ceiling: {mb / old_ceiling:.2f})")
    print(f"\nprompt tokens (server count, mean): llama.cpp {L[0]['prompt_tokens_mean']}, bulkhead {B[0]['prompt_tokens_mean']}; "
          f"problems: {'; '.join(bad) if bad else 'none'}\n")
print("load average (1, 5, 15 min) after each run:")
print(open(os.path.join(out, "loadavg.txt")).read())
PY

if [[ $PROBE -eq 1 ]]; then
  for server in bulkhead llamacpp; do
    log "probe against $server"
    rc=0
    # Context: bulkhead says it in /v1/models, llama-server its per-slot n_ctx in /props.
    "$BULKHEAD" probe "${URL[$server]}" --seed 7 > "$OUT/probe.$server.txt" || rc=$?
    cat "$OUT/probe.$server.txt"
    echo "exit status $rc" | tee -a "$OUT/probe.$server.txt"
  done
fi
log "done; results in $OUT"
