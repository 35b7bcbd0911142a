#!/usr/bin/env bash
# Property-based test of the OpenAPI document (docs/openapi.json, served at /openapi.json)
# against a live `bulkhead serve`: schemathesis generates requests from the document and
# checks that no response is a 5xx and that every response matches its documented schema.
# Bounded: a small context (256 tokens) and at most 4 generated tokens per request (see
# tests/python/schemathesis_hooks.py), a fixed number of examples per operation and a fixed
# seed. scripts/test.sh runs it; by hand: bash scripts/schemathesis.sh [schemathesis flags].
# Uses $BULKHEAD_BIN, else builds and uses target/debug/bulkhead.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${BULKHEAD_BIN:-}" ]; then
    cargo build --quiet -p bulkhead
    export BULKHEAD_BIN="${CARGO_TARGET_DIR:-target}/debug/bulkhead"
fi
export PYTHONDONTWRITEBYTECODE=1 # no __pycache__ in the work tree
venv=$(bash tests/python/venv.sh)
# Every check but positive_data_acceptance: a schema-valid body is still refused (400,
# context_length_exceeded) when prompt plus max_tokens exceed the context, a bound that
# depends on the model and on tokenisation, which the document cannot state.
checks=not_a_server_error,response_schema_conformance,status_code_conformance
checks+=,content_type_conformance,response_headers_conformance,negative_data_rejection
checks+=,unsupported_method,allow_header_conformance,missing_required_header
# One worker: concurrent full-context requests could meet the KV pool's designed 503.
exec "$venv/bin/python" tests/python/run_schemathesis.py --checks "$checks" \
    --max-examples "${SCHEMATHESIS_MAX_EXAMPLES:-30}" --workers 1 --seed 1 \
    --generation-database none --no-color "$@"
