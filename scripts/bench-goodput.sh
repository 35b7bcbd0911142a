#!/usr/bin/env bash
# bench-goodput.sh - goodput of `bulkhead serve` and llama.cpp's llama-server on the same
# GGUF: open-loop (Poisson) arrivals swept over rates, SLO attainment per rate, and the
# highest rate at which 90% of requests meet both a TTFT and a TPOT SLO.
#
# Usage:
#   scripts/bench-goodput.sh [--model PATH] [--threads N] [--ctx N] [--slots N]
#                            [--rates LIST] [--requests N] [--window-s S]
#                            [--min-requests N] [--stop-below F] [--servers LIST]
#                            [--out DIR]
#
#   --model PATH    GGUF (env MODEL; default
#                   $BULKHEAD_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   --threads N     llama-server -t/-tb and `bulkhead serve --threads` per worker (env
#                   THREADS; default: nproc), as scripts/bench-vs-llamacpp.sh
#   --ctx N         context per slot (env CTX; default 2048)
#   --slots N       llama-server -np N (env SLOTS; default 64). Both servers hold SLOTS*CTX
#                   tokens of KV: llama-server -c, bulkhead --kv-pool-tokens (and
#                   --prefill-kv-pool-tokens 8*CTX), as scripts/bench-vs-llamacpp.sh
#   --rates LIST    offered rates, requests/s, ascending (env RATES; default
#                   0.05,0.1,0.2,0.3,0.45,0.6,0.8,1.0)
#   --requests N    arrivals per rate stop after N requests... (env REQUESTS; default 100)
#   --window-s S    ...or S seconds, whichever first (env WINDOW_S; default 90)...
#   --min-requests N  ...the window staying open until N arrived (env MIN_REQUESTS;
#                   default 15): at 0.05 req/s a 90 s window draws 4 or 5, and one early
#                   burst would decide the point
#   --stop-below F  end a server's sweep after a rate where both SLO pairs' attainment is
#                   below F (env STOP_BELOW; default 0.3; 0 = sweep every rate)
#   --servers LIST  which servers, in order (env SERVERS; default llamacpp,bulkhead):
#                   llamacpp, bulkhead (default flags: the core budget paced by the chat
#                   pair, 100 ms / 2.5 s), bulkhead-split (`--core-budget split`, the
#                   default before 2026-12-07), bulkhead-slo-tight (`--slo-tpot-ms 50
#                   --slo-ttft-ms 1200`), bulkhead-nowindow (`--prefill-window-tokens 0`)
#                   or bulkhead-nospec (`--speculative off`)
#   --out DIR       results (env OUT; default $CACHE_DIR/goodput/<UTC timestamp>)
#
# Each server runs alone (the other is stopped) and fresh: its own process, started for
# its sweep, after 5 warm-up requests that are not counted. Requests: 512-word prompts
# (about 512 tokens), 128 output tokens (ignore_eos), streamed; one seed for both servers,
# so both get the same prompts at the same arrival times. A rate's arrivals are drawn
# from the seed and the rate's index in the list: runs with another rate list are not
# comparable arrival for arrival. Two SLO pairs are judged on the
# same requests: "chat" TTFT <= 2500 ms and TPOT <= 100 ms, "tight" TTFT <= 1200 ms and
# TPOT <= 50 ms (TPOT = (latency - TTFT) / (output tokens - 1); a failed request meets
# neither). Goodput is interpolated linearly between the two rates that bracket 90%
# attainment (the first fall below 90% counts); 0 when even the lowest rate misses.
#
# Writes, under --out: <server>.json (the loadgen report, every request's TTFT and TPOT),
# <server>.txt, goodput.png (attainment against rate, both servers, one panel per SLO
# pair), summary.md (the table and the goodput ratio), setup.txt and the server logs.
# Takes about 10-13 minutes per server with the defaults on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench-lib.sh
source scripts/bench-lib.sh

LLAMA_SERVER="$CACHE_DIR/build/bin/llama-server"
MODEL="${MODEL:-$BULKHEAD_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
THREADS="${THREADS:-$(nproc 2>/dev/null || echo 2)}"
CTX="${CTX:-2048}"
SLOTS="${SLOTS:-64}"
RATES="${RATES:-0.05,0.1,0.2,0.3,0.45,0.6,0.8,1.0}"
REQUESTS="${REQUESTS:-100}"
WINDOW_S="${WINDOW_S:-90}"
MIN_REQUESTS="${MIN_REQUESTS:-15}"
STOP_BELOW="${STOP_BELOW:-0.3}"
SERVERS="${SERVERS:-llamacpp,bulkhead}"
OUT="${OUT:-}"
SEED=4242
SLO_TTFT=2500,1200
SLO_TPOT=100,50

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --ctx) CTX="$2"; shift 2 ;;
    --slots) SLOTS="$2"; shift 2 ;;
    --rates) RATES="$2"; shift 2 ;;
    --requests) REQUESTS="$2"; shift 2 ;;
    --window-s) WINDOW_S="$2"; shift 2 ;;
    --min-requests) MIN_REQUESTS="$2"; shift 2 ;;
    --stop-below) STOP_BELOW="$2"; shift 2 ;;
    --servers) SERVERS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
done

[[ -x "$LLAMA_SERVER" ]] || bash scripts/bench-llamacpp.sh --build-only
[[ -x "$LLAMA_SERVER" ]] || die "no llama-server at $LLAMA_SERVER"
[[ -f "$MODEL" ]] || cargo run --quiet -p bulkhead-fetch --example fetch-model smollm2-135m
[[ -f "$MODEL" ]] || die "model not found: $MODEL"
log "building bulkhead (release)"
cargo build --release -p bulkhead
BULKHEAD="${CARGO_TARGET_DIR:-$PWD/target}/release/bulkhead"

[[ -n "$OUT" ]] || OUT="$CACHE_DIR/goodput/$(date -u +%Y%m%dT%H%M%SZ)"
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
trap 'exit 130' INT TERM   # run the EXIT trap on signals too


KV_TOKENS=$((SLOTS * CTX))
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -srm); $(nproc) CPUs; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
  echo "model: $MODEL"
  echo "llama-server: -t $THREADS -tb $THREADS -np $SLOTS -c $KV_TOKENS (llama-cpp-python $LLAMA_CPP_PY_VERSION vendor)"
  echo "bulkhead serve: --threads $THREADS (each of 1 prefill + 1 decode worker) --context-length $CTX --kv-pool-tokens $KV_TOKENS --prefill-kv-pool-tokens $((8 * CTX))"
  echo "bulkhead: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (dirty tree)')"
  echo "load: Poisson arrivals at $RATES req/s; per rate $REQUESTS requests or $WINDOW_S s (open until $MIN_REQUESTS arrived), whichever first; 5 warm-up requests; seed $SEED; stop below $STOP_BELOW"
  echo "SLO pairs: chat TTFT <= 2500 ms, TPOT <= 100 ms; tight TTFT <= 1200 ms, TPOT <= 50 ms"
} | tee "$OUT/setup.txt"

IFS=, read -r -a SERVER_LIST <<< "$SERVERS"
for server in "${SERVER_LIST[@]}"; do
  port=$(free_port)
  case "$server" in
    llamacpp)
      log "llama-server on :$port (-t $THREADS -np $SLOTS -c $KV_TOKENS)"
      "$LLAMA_SERVER" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -np "$SLOTS" -c "$KV_TOKENS" \
        --host 127.0.0.1 --port "$port" > "$OUT/llama-server.log" 2>&1 &
      PID=$!
      wait_ready "http://127.0.0.1:$port" /health
      label=llama-server ;;
    bulkhead|bulkhead-split|bulkhead-slo-tight|bulkhead-nowindow|bulkhead-nospec)
      slo_args=()
      case "$server" in
        bulkhead-split) slo_args=(--core-budget split) ;;
        bulkhead-nowindow) slo_args=(--prefill-window-tokens 0) ;;
        bulkhead-nospec) slo_args=(--speculative off) ;;
        bulkhead-slo-tight) slo_args=(--slo-tpot-ms 50 --slo-ttft-ms 1200) ;;
      esac
      log "bulkhead serve on :$port (--threads $THREADS per worker, --context-length $CTX, --kv-pool-tokens $KV_TOKENS ${slo_args[*]})"
      BULKHEAD_LOG=warn "$BULKHEAD" serve --model "$MODEL" --threads "$THREADS" --context-length "$CTX" \
        --kv-pool-tokens "$KV_TOKENS" --prefill-kv-pool-tokens $((8 * CTX)) "${slo_args[@]}" \
        --port "$port" > "$OUT/$server-serve.log" 2>&1 &
      PID=$!
      wait_ready "http://127.0.0.1:$port" /ready
      label="$server" ;;
    *) die "unknown server: $server (llamacpp, bulkhead)" ;;
  esac
  log "$server: sweep $RATES req/s (loadavg $(cut -d' ' -f1-3 /proc/loadavg))"
  stop_args=()
  [[ "$STOP_BELOW" == 0 ]] || stop_args=(--stop-below "$STOP_BELOW")
  BULKHEAD_LOG=warn "$BULKHEAD" loadgen "http://127.0.0.1:$port" --rates "$RATES" \
    --requests "$REQUESTS" --duration-s "$WINDOW_S" --min-requests "$MIN_REQUESTS" --warmup 5 --seed "$SEED" \
    --prompt-tokens 512 --output-tokens 128 --slo-ttft-ms "$SLO_TTFT" --slo-tpot-ms "$SLO_TPOT" \
    "${stop_args[@]}" --read-timeout-s 600 --label "$label" --json-out "$OUT/$server.json" | tee "$OUT/$server.txt"
  echo "$server $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/loadavg.txt"
  stop_server
done

JSONS=()
for server in "${SERVER_LIST[@]}"; do JSONS+=("$OUT/$server.json"); done
"$BULKHEAD" loadgen-plot "${JSONS[@]}" -o "$OUT/goodput.png"

python3 - "$OUT" "$SERVERS" <<'PY' | tee "$OUT/summary.md"
import json, os, sys
out, servers = sys.argv[1], sys.argv[2].split(",")
reports = {s: json.load(open(os.path.join(out, f"{s}.json"))) for s in servers}
names = {"llamacpp": "llama-server", "bulkhead": "Bulkhead", "bulkhead-split": "Bulkhead --core-budget split",
         "bulkhead-nowindow": "Bulkhead, no prefill window",
         "bulkhead-slo-tight": "Bulkhead --slo 50/1200", "bulkhead-nospec": "Bulkhead --speculative off"}
print(open(os.path.join(out, "setup.txt")).read())
slos = next(iter(reports.values()))["slos"]
pair = lambda s: f"TTFT <= {s['ttft_ms']:g} ms, TPOT <= {s['tpot_ms']:g} ms"
print("Attainment of both SLOs per offered rate (TTFT / TPOT alone in brackets); TTFT and TPOT p90:\n")
head = "| server | rate req/s | sent | ok | " + " | ".join(f"SLO {i + 1} ({pair(s)})" for i, s in enumerate(slos)) + " | TTFT p90 ms | TPOT p90 ms |"
print(head)
print("|" + "---|" * (head.count("|") - 1))
for s, r in reports.items():
    for p in r["points"]:
        att = " | ".join(f"{a['both'] * 100:.0f}% ({a['ttft'] * 100:.0f} / {a['tpot'] * 100:.0f})" for a in p["attainment"])
        tt = p["ttft_ms"]["p90"] if p["ttft_ms"] else float("nan")
        tp = p["tpot_ms"]["p90"] if p["tpot_ms"] else float("nan")
        print(f"| {names.get(s, s)} | {p['rate']:g} | {p['sent']} | {p['ok']} | {att} | {tt:,.0f} | {tp:.1f} |")
# Side by side: each rate's attainment of the first pair, one column per server.
rates = sorted({p["rate"] for r in reports.values() for p in r["points"]})
print(f"\nAttainment of both SLOs of {pair(slos[0])} per rate, side by side (sent in brackets; - : the sweep had stopped):\n")
print("| rate req/s | " + " | ".join(names.get(s, s) for s in reports) + " |")
print("|---|" + "---|" * len(reports))
for rate in rates:
    cells = []
    for r in reports.values():
        p = next((p for p in r["points"] if p["rate"] == rate), None)
        cells.append(f"{p['attainment'][0]['both'] * 100:.0f}% ({p['sent']})" if p else "-")
    print(f"| {rate:g} | " + " | ".join(cells) + " |")
print("\nGoodput (highest rate with >= 90% of requests meeting both SLOs):\n")
against_llama = len(reports) == 2 and "llamacpp" in reports
print("| SLO pair | " + " | ".join(names.get(s, s) for s in reports) + (" | Bulkhead / llama-server |" if against_llama else " |"))
print("|---|" + "---|" * len(reports) + ("---|" if against_llama else ""))
for i, slo in enumerate(slos):
    gs = [r["goodput"][i] for r in reports.values()]
    def fmt(g):
        if g["kind"] == "below_lowest_rate":
            return "0 (lowest rate < 90%)"
        if g["kind"] == "at_least_highest_rate":
            return f">= {g['rate']:.2f}"
        return f"{g['rate']:.3f}"
    row = f"| {pair(slo)} | " + " | ".join(fmt(g) for g in gs)
    # The Bulkhead server beside llama-server, whichever variant it is (bulkhead-split, ...).
    ours = [s for s in reports if s != "llamacpp"]
    if len(gs) == 2 and "llamacpp" in reports and len(ours) == 1:
        l, b = reports["llamacpp"]["goodput"][i], reports[ours[0]]["goodput"][i]
        ratio = f"{b['rate'] / l['rate']:.2f}" if l["rate"] > 0 else ("n/a (llama-server 0)" if b["rate"] == 0 else "inf (llama-server 0)")
        if "at_least_highest_rate" in (l["kind"], b["kind"]):
            ratio += " (a bound: a sweep never fell below 90%)"
        row += f" | {ratio}"
    print(row + " |")
print()
for i, slo in enumerate(slos):
    for s, r in reports.items():
        print(f"- {pair(slo)}, {names.get(s, s)}: {r['goodput'][i]['note']}")
for other in ("bulkhead-split", "bulkhead-slo-tight"):
    if other in reports and "bulkhead" in reports:
        print()
        for i, slo in enumerate(slos):
            a, b = reports["bulkhead"]["goodput"][i], reports[other]["goodput"][i]
            r = f"{a['rate'] / b['rate']:.2f}" if b["rate"] > 0 else f"n/a ({names[other]}: 0)"
            print(f"- {pair(slo)}: goodput of Bulkhead (default flags) / {names[other]}: {r}")
if "bulkhead-nospec" in reports and "bulkhead" in reports:
    print()
    for i, slo in enumerate(slos):
        a, b = reports["bulkhead"]["goodput"][i], reports["bulkhead-nospec"]["goodput"][i]
        r = f"{a['rate'] / b['rate']:.2f}" if b["rate"] > 0 else "n/a (speculation off: 0)"
        print(f"- {pair(slo)}: goodput of Bulkhead (speculation on, the default) / --speculative off: {r}")
print()
print("load average (1, 5, 15 min) after each sweep:")
print(open(os.path.join(out, "loadavg.txt")).read())
print(f"plot: {os.path.join(out, 'goodput.png')}")
PY
log "done; results in $OUT"
