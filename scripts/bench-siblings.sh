#!/usr/bin/env bash
# `n = 4` siblings on the decode side: one request with n = 4 choices, a ~1,000-token
# prompt and 128 output tokens each (ignore_eos), against a fresh `bulkhead serve` with its
# defaults and against one with --no-prefix-cache (every sibling receives its own copy).
# Polls the decode worker's leased and cached pages every 20 ms while the request runs and
# prints the peak against the ideal: the prompt's full pages once, plus each sibling's own
# pages (its partial last prompt page and its output): ceil((prompt + 128) / 16) - full.
#
#   bash scripts/bench-siblings.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench-lib.sh
source scripts/bench-lib.sh
MODEL="${MODEL:-$BULKHEAD_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
[[ -f "$MODEL" ]] || cargo run --quiet -p bulkhead-fetch --example fetch-model smollm2-135m
cargo build --quiet --release -p bulkhead
OUT="$(mktemp -d)"
PID=""
stop() { [[ -z "$PID" ]] || { kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; PID=""; }; }
trap 'stop; rm -rf "$OUT"' EXIT
ADMIN="bench-operator-$RANDOM$RANDOM" # the cached pages are on the operator's page
for mode in defaults no-prefix-cache; do
  port=$(free_port)
  extra=()
  [[ "$mode" == defaults ]] || extra=(--no-prefix-cache)
  target/release/bulkhead serve --model "$MODEL" --port "$port" --admin-key "$ADMIN" "${extra[@]}" > "$OUT/$mode.log" 2>&1 &
  PID=$!
  wait_ready "http://127.0.0.1:$port" /ready
  python3 - "http://127.0.0.1:$port" "$mode" "$ADMIN" <<'PY'
import json, math, sys, threading, time, urllib.request
url, mode, admin = sys.argv[1], sys.argv[2], sys.argv[3]
def metric(text, name):
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if l.startswith(name + "{") and 'role="decode"' in l)
words = " ".join(f"item{i} is stored in room {100 + i % 37}." for i in range(80))
body = {"model": "SmolLM2-135M-Instruct.Q4_1", "n": 4, "temperature": 0.8, "seed": 7, "max_tokens": 128, "ignore_eos": True,
        "messages": [{"role": "system", "content": words}, {"role": "user", "content": "Where is item7?"}]}
result = {}
def send():
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    result["r"] = json.load(urllib.request.urlopen(req, timeout=300))
t = threading.Thread(target=send); t.start()
peak = 0
while t.is_alive():
    text = "".join(urllib.request.urlopen(urllib.request.Request(url + path, headers=h), timeout=5).read().decode()
                   for path, h in [("/metrics", {}), ("/metrics/tenants", {"Authorization": "Bearer " + admin})])
    peak = max(peak, metric(text, "bulkhead:kv_leased_pages") + metric(text, "bulkhead:kv_cached_pages"))
    time.sleep(0.02)
t.join()
r = result["r"]
prompt, out = r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"] // 4
full = prompt // 16
ideal = full + 4 * (math.ceil((prompt + out) / 16) - full)
print(f"{mode}: prompt {prompt} tokens, {out} output tokens each, {len(r['choices'])} choices; "
      f"decode pages at peak {peak:.0f}, ideal {ideal}: ratio {peak / ideal:.2f}")
PY
  stop
done
