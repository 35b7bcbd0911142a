#!/usr/bin/env bash
# bench-llamacpp.sh - build llama.cpp's benchmark tools and measure them on the
# Bulkhead default model, as a CPU baseline for `bulkhead bench-engine`.
#
# Usage:
#   scripts/bench-llamacpp.sh [--model PATH] [--out DIR] [--threads N]
#                             [--batched-reps N] [--no-server] [--build-only]
#                             [--isa native|avx2] [--prompt-tokens N] [--depth N]
#                             [--batched-prompt N]
#
#   --model PATH       GGUF model (env MODEL; default
#                      $BULKHEAD_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   --out DIR          where results go (env OUT; default
#                      $CACHE_DIR/results/<UTC timestamp>)
#   --threads N        threads for the multi-thread runs (env THREADS; default 2).
#                      llama-bench always also runs with -t 1.
#   --batched-reps N   how many times llama-batched-bench is run; the summary
#                      reports the median (env BATCHED_REPS; default 3)
#   --no-server        do not build llama-server
#   --build-only       fetch + build, then exit
#   --prompt-tokens N  llama-bench's prompt (-p; env PROMPT_TOKENS; default 512):
#                      compare with `bench-engine --prompt-tokens N`
#   --depth N          tokens already in the context before llama-bench's prompt
#                      and decode are timed (-d; env DEPTH; default 0): decode at
#                      N tokens of context, compare with `bench-engine
#                      --decode-context N`
#   --batched-prompt N llama-batched-bench's prompt per sequence (-npp; env
#                      BATCHED_PROMPT; default 128)
#   --isa avx2         build (in build-avx2/) and run llama.cpp with AVX2, FMA and
#                      F16C only, to compare against Bulkhead's AVX2 kernels
#                      (BULKHEAD_NO_VNNI=1) on a CPU that has AVX-512 (env ISA;
#                      default native)
#
# What it does:
#   1. fetches the llama-cpp-python 0.3.36 sdist with `pip download` (it vendors
#      llama.cpp) and builds llama-bench, llama-batched-bench and llama-server
#      with CMake (Release, GGML_NATIVE=ON; on an AMX host the same ISA without
#      AMX, whose kernels crash there). Everything is cached under
#      ${BULKHEAD_HOME:-~/.cache/bulkhead}/llama.cpp-0.3.36/, so reruns skip
#      download and build (delete that directory to force a rebuild).
#   2. llama-bench -m MODEL -t 1,THREADS -p PROMPT_TOKENS -n 128 -d DEPTH -r 5
#      (markdown on stdout + saved as llama-bench.md, JSON saved as llama-bench.json)
#   3. llama-batched-bench -m MODEL -t THREADS -c 4096 -b 2048 -ub 512
#      -npp BATCHED_PROMPT -ntg 64 -npl 1,4,16: 128-token prompt per sequence, then 64
#      decode steps at 1/4/16 parallel sequences; S_TG is the aggregate decode
#      tok/s, comparable to `bulkhead bench-engine`.
#   4. prints a summary (medians) and writes it to summary.txt in the out dir.
#
# Contention: other processes on the machine (e.g. a cargo build) wreck these
# numbers, multi-thread decode above all. Each benchmark run first waits for
# the machine to be idle (env WAIT_IDLE, default 600 s), and is retried (env
# MAX_TRIES, default 4) if other processes used more than CONTENTION_MAX cores
# (default 0.10) while it ran. Tries are logged in runs.jsonl; the summary says
# whether the kept runs were clean.
#
# Needs: bash, python3 + pip, a C/C++ compiler, cmake (installed with apt-get
# when missing and running as root), git (optional, for the build commit).
# Not for CI: it downloads ~75 MB and compiles for several minutes.
set -euo pipefail

LLAMA_CPP_PY_VERSION=0.3.36
BULKHEAD_HOME="${BULKHEAD_HOME:-$HOME/.cache/bulkhead}"
CACHE_DIR="$BULKHEAD_HOME/llama.cpp-$LLAMA_CPP_PY_VERSION"
MODEL="${MODEL:-$BULKHEAD_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
OUT="${OUT:-}"
THREADS="${THREADS:-2}"
BATCHED_REPS="${BATCHED_REPS:-3}"
BUILD_SERVER=1
BUILD_ONLY=0
ISA="${ISA:-native}"
PROMPT_TOKENS="${PROMPT_TOKENS:-512}"
DEPTH="${DEPTH:-0}"
BATCHED_PROMPT="${BATCHED_PROMPT:-128}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --model=*) MODEL="${1#*=}"; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --out=*) OUT="${1#*=}"; shift ;;
    --threads) THREADS="$2"; shift 2 ;;
    --threads=*) THREADS="${1#*=}"; shift ;;
    --batched-reps) BATCHED_REPS="$2"; shift 2 ;;
    --batched-reps=*) BATCHED_REPS="${1#*=}"; shift ;;
    --no-server) BUILD_SERVER=0; shift ;;
    --build-only) BUILD_ONLY=1; shift ;;
    --isa) ISA="$2"; shift 2 ;;
    --isa=*) ISA="${1#*=}"; shift ;;
    --prompt-tokens) PROMPT_TOKENS="$2"; shift 2 ;;
    --prompt-tokens=*) PROMPT_TOKENS="${1#*=}"; shift ;;
    --depth) DEPTH="$2"; shift 2 ;;
    --depth=*) DEPTH="${1#*=}"; shift ;;
    --batched-prompt) BATCHED_PROMPT="$2"; shift 2 ;;
    --batched-prompt=*) BATCHED_PROMPT="${1#*=}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
done

log() { printf '\n==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

SRC_DIR="$CACHE_DIR/src"                 # unpacked sdist
LLAMA_DIR="$SRC_DIR/vendor/llama.cpp"
case "$ISA" in
  native) BUILD_DIR="$CACHE_DIR/build" ;;
  avx2) BUILD_DIR="$CACHE_DIR/build-avx2" ;;
  *) die "--isa must be native or avx2, not '$ISA'" ;;
esac
BIN_DIR="$BUILD_DIR/bin"

# ---------------------------------------------------------------- 1. fetch --
fetch() {
  if [[ -f "$LLAMA_DIR/CMakeLists.txt" ]]; then
    log "llama.cpp source cached at $LLAMA_DIR"
    return
  fi
  command -v python3 >/dev/null || die "python3 is required (for pip download)"
  mkdir -p "$CACHE_DIR/dl"
  local tarball="$CACHE_DIR/dl/llama_cpp_python-$LLAMA_CPP_PY_VERSION.tar.gz"
  if [[ ! -f "$tarball" ]]; then
    log "downloading llama-cpp-python==$LLAMA_CPP_PY_VERSION sdist (pip)"
    # Only llama-cpp-python itself from source: with `:all:`, pip would also build its
    # build dependencies (cmake among them) from source just to read the metadata.
    python3 -m pip download --no-binary llama-cpp-python --no-deps \
      "llama-cpp-python==$LLAMA_CPP_PY_VERSION" -d "$CACHE_DIR/dl"
  fi
  [[ -f "$tarball" ]] || die "pip did not produce $tarball"
  log "unpacking sdist"
  rm -rf "$SRC_DIR.tmp"
  mkdir -p "$SRC_DIR.tmp"
  tar -xzf "$tarball" -C "$SRC_DIR.tmp" --strip-components=1
  [[ -f "$SRC_DIR.tmp/vendor/llama.cpp/CMakeLists.txt" ]] || die "sdist has no vendor/llama.cpp"
  rm -rf "$SRC_DIR"
  mv "$SRC_DIR.tmp" "$SRC_DIR"
}

ensure_cmake() {
  command -v cmake >/dev/null && return
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    log "cmake missing; installing with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake
  else
    die "cmake not found; install it (e.g. apt-get install cmake)"
  fi
}

# ---------------------------------------------------------------- build -----
build() {
  local want=(llama-bench llama-batched-bench)
  [[ $BUILD_SERVER -eq 1 ]] && want+=(llama-server)
  local missing=0 t
  for t in "${want[@]}"; do [[ -x "$BIN_DIR/$t" ]] || missing=1; done
  if [[ $missing -eq 0 ]]; then
    log "binaries cached in $BIN_DIR"
    return
  fi
  ensure_cmake
  # ggml's AMX kernels crash (SIGSEGV in ggml_backend_amx_mul_mat) on an AMX Xeon under a
  # VM, and Bulkhead has no AMX kernels either: there, build the host's ISA without AMX.
  local ISA_FLAGS=(-DGGML_NATIVE=ON)
  if [[ $ISA == avx2 ]]; then
    ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
    log "AVX2 only (${ISA_FLAGS[*]})"
  elif grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
    local f
    for f in avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
      grep -qw "${f%%:*}" /proc/cpuinfo && ISA_FLAGS+=("-DGGML_${f##*:}=ON")
    done
    log "AMX host: building without AMX (${ISA_FLAGS[*]})"
  fi
  log "configuring llama.cpp ($BUILD_DIR)"
  # Server: no embedded web UI (it would be downloaded from Hugging Face or
  # built with npm) and no OpenSSL/HTTPS; neither matters for benchmarking.
  cmake -S "$LLAMA_DIR" -B "$BUILD_DIR" \
    -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
  log "building ${want[*]} with -j$JOBS"
  local t0=$SECONDS
  if ! cmake --build "$BUILD_DIR" -j"$JOBS" --target "${want[@]}"; then
    if [[ $BUILD_SERVER -eq 1 ]]; then
      log "build with llama-server failed; retrying without it"
      BUILD_SERVER=0
      cmake --build "$BUILD_DIR" -j"$JOBS" --target llama-bench llama-batched-bench
    else
      die "build failed"
    fi
  fi
  log "build took $((SECONDS - t0)) s"
  echo "$((SECONDS - t0))" > "$BUILD_DIR/.build-seconds"
}

fetch
build
for t in llama-bench llama-batched-bench; do
  [[ -x "$BIN_DIR/$t" ]] || die "missing $BIN_DIR/$t"
done
if [[ -x "$BIN_DIR/llama-server" ]]; then
  log "llama-server: $BIN_DIR/llama-server"
fi
[[ $BUILD_ONLY -eq 1 ]] && exit 0

# ---------------------------------------------------------------- run -------
[[ -f "$MODEL" ]] || die "model not found: $MODEL (use --model PATH or MODEL=...)"
[[ -n "$OUT" ]] || OUT="$CACHE_DIR/results/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$OUT"
log "model: $MODEL"
log "results: $OUT"
: > "$OUT/runs.jsonl"

# run_clean LABEL STDOUT_FILE STDERR_FILE CMD...
# Waits (up to WAIT_IDLE s) until the machine is idle, runs CMD, and compares
# the CPU time used machine-wide with CMD's own CPU time. If other processes
# used more than CONTENTION_MAX cores on average while it ran, the run counts
# as contended and is retried (up to MAX_TRIES times; the last try is kept
# either way). Each try is logged to runs.jsonl. Returns 0 when clean.
WAIT_IDLE="${WAIT_IDLE:-600}"
CONTENTION_MAX="${CONTENTION_MAX:-0.10}"
MAX_TRIES="${MAX_TRIES:-4}"
read -r -d '' RUNNER <<'PY' || true
import json, os, subprocess, sys, time
label, out_f, err_f, runs_f = sys.argv[1:5]
cmd = sys.argv[5:]
wait_idle, max_other = float(os.environ["WAIT_IDLE"]), float(os.environ["CONTENTION_MAX"])
hz, ncpu = os.sysconf("SC_CLK_TCK"), os.cpu_count()

def stat():
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    busy = f[0] + f[1] + f[2] + f[5] + f[6]          # user nice system irq softirq
    return busy / hz, f[7] / hz, time.monotonic()    # busy s, steal s, now

# wait until the other load is below max_other cores for 3 s in a row
t0, quiet = time.monotonic(), 0
while time.monotonic() - t0 < wait_idle and quiet < 3:
    b0, _, w0 = stat(); time.sleep(1); b1, _, w1 = stat()
    quiet = quiet + 1 if (b1 - b0) / (w1 - w0) < max_other else 0
waited = time.monotonic() - t0
if quiet < 3:
    print(f"   warning: machine still busy after waiting {waited:.0f} s; running anyway", file=sys.stderr)

b0, s0, w0 = stat()
with open(out_f, "w") as o, open(err_f, "w") as e:
    p = subprocess.Popen(cmd, stdout=o, stderr=e)
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
b1, s1, w1 = stat()
rc = p.returncode
wall, own = w1 - w0, ru.ru_utime + ru.ru_stime
other = max(0.0, (b1 - b0) - own) / wall
rec = dict(label=label, rc=rc, wall_s=round(wall, 2), own_cpu_s=round(own, 2),
           other_cores=round(other, 3), steal_cores=round((s1 - s0) / wall, 3),
           waited_idle_s=round(waited, 1), clean=(rc == 0 and other <= max_other))
with open(runs_f, "a") as f:
    f.write(json.dumps(rec) + "\n")
print(f"   {label}: wall {wall:.1f} s, other processes {other:.2f} cores, "
      f"steal {rec['steal_cores']:.2f} cores -> {'clean' if rec['clean'] else 'CONTENDED'}",
      file=sys.stderr)
sys.exit(rc if rc else (0 if rec["clean"] else 3))
PY
export WAIT_IDLE CONTENTION_MAX
run_clean() {
  local label="$1" out_f="$2" err_f="$3" try rc
  shift 3
  for ((try = 1; try <= MAX_TRIES; try++)); do
    rc=0
    python3 -c "$RUNNER" "$label#$try" "$out_f" "$err_f" "$OUT/runs.jsonl" "$@" || rc=$?
    [[ $rc -eq 0 ]] && return 0
    [[ $rc -ne 3 ]] && { cat "$err_f" >&2; die "$label failed (exit $rc)"; }
    [[ $try -lt $MAX_TRIES ]] && log "$label was contended; retrying"
  done
  log "warning: $label was contended on all $MAX_TRIES tries; keeping the last"
}

# 2. llama-bench: pp512 + tg128 (or as asked) at 1 and THREADS threads, 5 repetitions each.
# Markdown goes to stdout, JSON to stderr (-oe), so the benchmark runs once.
BENCH_CMD=("$BIN_DIR/llama-bench" -m "$MODEL" -t "1,$THREADS" -p "$PROMPT_TOKENS" -n 128 -d "$DEPTH" -r 5 -o md -oe json)
log "${BENCH_CMD[*]}"
run_clean llama-bench "$OUT/llama-bench.md" "$OUT/llama-bench.stderr" "${BENCH_CMD[@]}"
cat "$OUT/llama-bench.md"

# 3. llama-batched-bench: aggregate decode tok/s at 1/4/16 sequences.
# Each row is a single measurement, so the whole run is repeated BATCHED_REPS times.
# Room for 16 sequences of prompt + 64 tokens (4096 at the default 128-token prompts).
CTX=$((16 * (BATCHED_PROMPT + 64) + 256)); ((CTX < 4096)) && CTX=4096
BATCHED_CMD=("$BIN_DIR/llama-batched-bench" -m "$MODEL" -t "$THREADS" -tb "$THREADS"
             -c "$CTX" -b 2048 -ub 512 -npp "$BATCHED_PROMPT" -ntg 64 -npl 1,4,16)
for ((i = 1; i <= BATCHED_REPS; i++)); do
  log "[$i/$BATCHED_REPS] ${BATCHED_CMD[*]}"
  run_clean "batched-bench.$i" "$OUT/batched-bench.$i.md" "$OUT/batched-bench.$i.log" "${BATCHED_CMD[@]}"
  grep -E '^(\||llama_batched_bench:)' "$OUT/batched-bench.$i.md" || cat "$OUT/batched-bench.$i.md"
done

# ---------------------------------------------------------------- summary ---
python3 - "$OUT" "$THREADS" "$BATCHED_REPS" "$PROMPT_TOKENS" "$DEPTH" "$BATCHED_PROMPT" <<'PY' | tee "$OUT/summary.txt"
import json, re, statistics, sys, glob, os
out, threads, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompt, depth, batched_prompt = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])

raw = open(os.path.join(out, "llama-bench.stderr")).read()
start = raw.find("[")
tests = json.JSONDecoder().raw_decode(raw[start:])[0]
with open(os.path.join(out, "llama-bench.json"), "w") as f:
    json.dump(tests, f, indent=2)

def bench(n_prompt, n_gen, t):
    for x in tests:
        if x["n_prompt"] == n_prompt and x["n_gen"] == n_gen and x["n_threads"] == t:
            s = x.get("samples_ts") or [x["avg_ts"]]
            return statistics.median(s), x["avg_ts"], x["stddev_ts"]
    return None

first = tests[0]
print(f"llama.cpp build: {first['build_commit']} ({first['build_number']})  "
      f"[llama-cpp-python 0.3.36 vendor]")
print(f"cpu: {first.get('cpu_info','?')}  backend: {first.get('backends','?')}")
print(f"model: {first.get('model_filename','?')} ({first.get('model_type','?')})")
print()
at = f" at depth {depth}" if depth else ""
print(f"llama-bench (-r 5; median [mean +- stddev] tok/s){at}")
for label, np_, ng in ((f"prefill pp{prompt}", prompt, 0), ("decode  tg128", 0, 128)):
    for t in sorted({1, threads}):
        r = bench(np_, ng, t)
        if r:
            print(f"  {label}  t={t}: {r[0]:9.2f}   [{r[1]:.2f} +- {r[2]:.2f}]")

rows = {}  # pl -> list of S_TG
pp_rows = {}
hdr = None
for i in range(1, reps + 1):
    for line in open(os.path.join(out, f"batched-bench.{i}.md")):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0] == "PP":
            hdr = cells
        elif len(cells) == 10 and re.fullmatch(r"\d+", cells[0]):
            pl = int(cells[2])
            rows.setdefault(pl, []).append(float(cells[7]))
            pp_rows.setdefault(pl, []).append(float(cells[5]))
print()
print(f"llama-batched-bench -t {threads} (PP={batched_prompt}/seq, TG=64 steps; median of {reps} runs)")
print("  B   S_TG aggregate decode tok/s   (S_PP prefill tok/s)   all runs S_TG")
for pl in sorted(rows):
    print(f"  {pl:<3} {statistics.median(rows[pl]):10.2f}"
          f"                     ({statistics.median(pp_rows[pl]):8.2f})"
          f"            {', '.join(f'{v:.2f}' for v in rows[pl])}")

runs = [json.loads(l) for l in open(os.path.join(out, "runs.jsonl")) if l.strip()]
kept = {}
for r in runs:
    kept[r["label"].split("#")[0]] = r   # the last try of each run is the one kept
bad = [k for k, r in kept.items() if not r["clean"]]
print()
print(f"contention: {len(runs)} tries for {len(kept)} runs; "
      + ("all kept runs clean" if not bad else "CONTENDED (numbers unreliable): " + ", ".join(bad))
      + f"; max steal {max(r['steal_cores'] for r in kept.values()):.2f} cores")
PY
log "done; results in $OUT"
