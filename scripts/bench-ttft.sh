#!/usr/bin/env bash
# Time to first token for one long prompt: disaggregated `bulkhead serve` (gateway +
# prefill + decode processes) with the KV over each transport in TRANSPORTS (default: ucx
# where libucp loads, and tcp), against the same prompt prefilled in one process
# (`bulkhead bench-engine`), as ratios in one run. The prefix cache is off, so every
# repetition prefills the whole prompt. Not part of CI.
#
# Usage: [MODEL=FILE] scripts/bench-ttft.sh [PROMPT_TOKENS] [REPS] [TRANSPORTS]
#   MODEL: a GGUF (default: the default model), e.g. a `bulkhead synth-model` file; both
#   sides get a context of the prompt plus 256 tokens and a KV pool of twice that.
set -euo pipefail
cd "$(dirname "$0")/.."
TOKENS=${1:-2000}
REPS=${2:-3}
DEFAULT_TRANSPORTS=tcp
ldconfig -p 2>/dev/null | grep -q 'libucp\.so\.0' && DEFAULT_TRANSPORTS=ucx,tcp
TRANSPORTS=${3:-$DEFAULT_TRANSPORTS}
cargo build --release -q -p bulkhead
BIN=target/release/bulkhead
PORT=18089
CTX=$((TOKENS + 256))
MODEL_ARGS=(${MODEL:+--model "$MODEL"})
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
RESULTS=()
for T in ${TRANSPORTS//,/ }; do
  $BIN serve "${MODEL_ARGS[@]}" --context-length $CTX --kv-pool-tokens $((2 * CTX)) --prefill-kv-pool-tokens $((2 * CTX)) \
    --port $PORT --model-id bulkhead --no-prefix-cache --kv-transport "$T" >/tmp/bulkhead-ttft.log 2>&1 &
  SERVE=$!
  trap 'kill $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
  for _ in $(seq 600); do curl -sf localhost:$PORT/ready >/dev/null && break; sleep 0.2; done
  PROMPT_TOKENS=$(curl -s localhost:$PORT/v1/completions -H 'content-type: application/json' -d "$BODY" | python3 -c 'import json,sys; print(json.load(sys.stdin)["usage"]["prompt_tokens"])')
  ROAD=$(grep -o 'KV connection open.*transport="[a-z]*" detail="[^"]*"' /tmp/bulkhead-ttft.log | sed 's/.*transport=/transport=/' | head -1)
  TIMES=()
  for _ in $(seq "$REPS"); do
    TIMES+=("$(curl -s -o /dev/null -w '%{time_total}' localhost:$PORT/v1/completions -H 'content-type: application/json' -d "$BODY")")
  done
  kill $SERVE; wait $SERVE 2>/dev/null || true; trap - EXIT
  RESULTS+=("$T $(printf '%s\n' "${TIMES[@]}" | sort -n | sed -n "$(( (REPS + 1) / 2 ))p") $ROAD")
done
LOCAL_TPS=$($BIN bench-engine "${MODEL_ARGS[@]}" --prompt-tokens "$PROMPT_TOKENS" --batches 1 --decode-steps 1 --reps "$REPS" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["prefill_tok_s"])')
python3 - "$PROMPT_TOKENS" "$LOCAL_TPS" "${RESULTS[@]}" <<'PY'
import sys
n, tps = int(sys.argv[1]), float(sys.argv[2])
local = n / tps
print(f"prompt {n} tokens: in-process prefill {local:.3f} s")
for r in sys.argv[3:]:
    t, serve, road = (r.split(" ", 2) + [""])[:3]
    print(f"disaggregated serve over {t} ({road}): TTFT {float(serve):.3f} s (HTTP, max_tokens 1); ratio disaggregated / in-process = {float(serve) / local:.3f}")
PY
