#!/usr/bin/env bash
# logits-vs-llamacpp.sh - Bulkhead's teacher-forced logits against llama.cpp's at real model
# shapes: for each shape, a random-weight GGUF (`bulkhead synth-model`), the same seeded
# tokens through both engines in one batch, every position's logits compared under the bound
# the llama.cpp fixtures use (crates/model/examples/logits-vs-llamacpp.rs says it). Random
# weights make the text meaningless but the numbers comparable; the shapes catch what the
# small models cannot (hidden 4096, GQA 4:1 and 7:1, 128k-256k vocabularies, Llama 3's RoPE
# scaling, Qwen's Q/K/V biases, Gemma 3's window and head of 256). Not part of CI: the files
# are 0.8-5 GB and take minutes to write.
#
# Usage:
#   scripts/logits-vs-llamacpp.sh [--shapes LIST] [--quant Q] [--tokens N] [--threads N]
#                                 [--dir DIR]
#
#   --shapes LIST  comma-separated `synth-model --shape` names (env SHAPES; default all:
#                  llama-3.2-1b,gemma-3-1b,qwen2.5-7b,llama-3.1-8b,mistral-7b)
#   --quant Q      q4_0, q8_0 or q4_k_m (env QUANT; default q4_k_m)
#   --tokens N     positions compared (env TOKENS; default 32)
#   --threads N    threads of each engine (env THREADS; default nproc)
#   --dir DIR      where the model files and logits go (env DIR; default
#                  $BULKHEAD_HOME/synth); a file already there is reused
#
# Needs llama.cpp built by scripts/bench-llamacpp.sh (it runs `--build-only` if missing) and
# gcc. Exits non-zero when any shape is out of bounds.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench-lib.sh
source scripts/bench-lib.sh

SHAPES="${SHAPES:-llama-3.2-1b,gemma-3-1b,qwen2.5-7b,llama-3.1-8b,mistral-7b}"
QUANT="${QUANT:-q4_k_m}"
TOKENS="${TOKENS:-32}"
THREADS="${THREADS:-$(nproc 2>/dev/null || echo 2)}"
DIR="${DIR:-$BULKHEAD_HOME/synth}"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --shapes) SHAPES="$2"; shift 2 ;;
    --quant) QUANT="$2"; shift 2 ;;
    --tokens) TOKENS="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --dir) DIR="$2"; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) die "unknown argument: $1" ;;
  esac
done

[[ -f "$CACHE_DIR/build/bin/libllama.so" ]] || bash scripts/bench-llamacpp.sh --build-only
VENDOR="$CACHE_DIR/src/vendor/llama.cpp"
TOOL="$CACHE_DIR/build/bin/llamacpp-logits"
if [[ ! -x "$TOOL" || scripts/llamacpp-logits.c -nt "$TOOL" ]]; then
  log "building llamacpp-logits"
  gcc -O2 -o "$TOOL" scripts/llamacpp-logits.c -I"$VENDOR/include" -I"$VENDOR/ggml/include" \
    -L"$CACHE_DIR/build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$CACHE_DIR/build/bin"
fi
log "building bulkhead and the comparison (release)"
cargo build --release -q -p bulkhead -p bulkhead-model --example logits-vs-llamacpp
BULKHEAD="${CARGO_TARGET_DIR:-$PWD/target}/release/bulkhead"
COMPARE="${CARGO_TARGET_DIR:-$PWD/target}/release/examples/logits-vs-llamacpp"
mkdir -p "$DIR"

# Seeded token ids below 30,000 (every shape's vocabulary, and its donor tokenizer's, holds them).
read -r -a IDS <<< "$(python3 -c "import random; r = random.Random(7); print(' '.join(str(r.randrange(30000)) for _ in range($TOKENS)))")"
status=0
summary=()
IFS=, read -r -a SHAPE_LIST <<< "$SHAPES"
for shape in "${SHAPE_LIST[@]}"; do
  model="$DIR/$shape-$QUANT.gguf"
  if [[ ! -f "$model" ]]; then
    log "writing $model"
    "$BULKHEAD" synth-model --shape "$shape" --quant "$QUANT" --out "$model" >/dev/null
  fi
  log "$shape: llama.cpp"
  "$TOOL" "$model" "$THREADS" "${IDS[@]}" > "$DIR/$shape-$QUANT.llamacpp.f32"
  log "$shape: bulkhead"
  if line=$("$COMPARE" "$model" "$DIR/$shape-$QUANT.llamacpp.f32" "$THREADS" "${IDS[@]}" | tee "$DIR/$shape-$QUANT.compare.txt" | tail -1); then
    :
  else
    status=1
  fi
  summary+=("$shape $QUANT: ${line#*: }")
done
echo
echo "teacher-forced logits, $TOKENS positions, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $THREADS threads, bulkhead $(git rev-parse --short HEAD)"
printf '%s\n' "${summary[@]}"
exit $status
