#!/usr/bin/env bash
# Prints the path of a Python virtual environment holding tests/python/requirements.txt
# (the official `openai` client, pytest, schemathesis, selenium), creating it on first use with
# `python3 -m venv` and pip. It lives in the cache beside the default model ($BULKHEAD_HOME,
# else $XDG_CACHE_HOME/bulkhead, else ~/.cache/bulkhead), named after a hash of the Python
# version and the pins: fresh clones on one machine share it, new pins make a new one.
# Python: $BULKHEAD_PYTHON, else python3.
set -euo pipefail
req="$(cd "$(dirname "$0")" && pwd)/requirements.txt"
home=${BULKHEAD_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/bulkhead}
py=${BULKHEAD_PYTHON:-python3}
key=$({ "$py" --version; cat "$req"; } | sha256sum | cut -c1-12)
venv="$home/venv-$key"
mkdir -p "$home"
# One creator at a time; the marker is written only after pip succeeded.
exec 9>"$home/venv.lock"
flock 9
if [ ! -f "$venv/.complete" ] || ! "$venv/bin/python" -c 'import openai, pytest, schemathesis, selenium' 2>/dev/null; then
    echo "venv.sh: creating the Python test environment $venv (pip, about 30 s)" >&2
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2
    touch "$venv/.complete"
fi
echo "$venv"
