# Helpers the benchmark scripts share; sourced, not run. The caller sets OUT (where its logs
# go) before calling wait_ready.

# llama.cpp as scripts/bench-llamacpp.sh builds it (llama-cpp-python's vendored copy), under
# $BULKHEAD_HOME.
LLAMA_CPP_PY_VERSION=0.3.36
BULKHEAD_HOME="${BULKHEAD_HOME:-$HOME/.cache/bulkhead}"
CACHE_DIR="$BULKHEAD_HOME/llama.cpp-$LLAMA_CPP_PY_VERSION"

log() { printf '\n==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# A TCP port free on loopback now.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Wait up to 5 minutes for URL+PATH to answer 2xx.
wait_ready() { # URL PATH
  local i
  for ((i = 0; i < 600; i++)); do
    python3 -c 'import sys,urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2).read()' "$1$2" 2>/dev/null && return 0
    sleep 0.5
  done
  die "$1$2 did not become ready (see ${OUT:-the server logs})"
}
