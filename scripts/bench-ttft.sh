#!/usr/bin/env bash
# Time to first token for one long prompt: disaggregated `bulkhead serve` (gateway +
# prefill + decode processes, KV over loopback TCP) against the same prompt prefilled
# in one process (`bulkhead bench-engine`), as a ratio. Not part of CI.
#
# Usage: scripts/bench-ttft.sh [PROMPT_TOKENS] [REPS]
set -euo pipefail
cd "$(dirname "$0")/.."
TOKENS=${1:-2000}
REPS=${2:-3}
cargo build --release -q -p bulkhead
BIN=target/release/bulkhead
PORT=18089
$BIN serve --port $PORT >/tmp/bulkhead-ttft.log 2>&1 &
SERVE=$!
trap 'kill $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -sf localhost:$PORT/ready >/dev/null && break; sleep 0.2; done
# Token ids are not accepted by the API: build a text of about N tokens;
# the server's own usage figure says exactly how many.
BODY=$(python3 - "$TOKENS" <<'PY'
import json, sys
n = int(sys.argv[1])
# about 3.9 tokens per " wNNN" word with this tokenizer (digits split one by one)
words = " ".join(f"w{i % 997}" for i in range(int(n / 3.9)))
print(json.dumps({"model": "bulkhead", "prompt": words, "max_tokens": 1, "temperature": 0}))
PY
)
PROMPT_TOKENS=$(curl -s localhost:$PORT/v1/completions -H 'content-type: application/json' -d "$BODY" | python3 -c 'import json,sys; print(json.load(sys.stdin)["usage"]["prompt_tokens"])')
TIMES=()
for _ in $(seq "$REPS"); do
  TIMES+=("$(curl -s -o /dev/null -w '%{time_total}' localhost:$PORT/v1/completions -H 'content-type: application/json' -d "$BODY")")
done
kill $SERVE; wait $SERVE 2>/dev/null || true; trap - EXIT
SERVE_TTFT=$(printf '%s\n' "${TIMES[@]}" | sort -n | sed -n "$(( (REPS + 1) / 2 ))p")
LOCAL_TPS=$($BIN bench-engine --prompt-tokens "$PROMPT_TOKENS" --batches 1 --decode-steps 1 --reps "$REPS" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["prefill_tok_s"])')
python3 - "$PROMPT_TOKENS" "$SERVE_TTFT" "$LOCAL_TPS" <<'PY'
import sys
n, serve, tps = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
local = n / tps
print(f"prompt {n} tokens: disaggregated serve TTFT {serve:.3f} s (HTTP, max_tokens 1), in-process prefill {local:.3f} s")
print(f"ratio disaggregated / in-process = {serve / local:.3f}")
PY
