"""Schemathesis hooks for scripts/schemathesis.sh (loaded through SCHEMATHESIS_HOOKS).

- A generated `model` string would only ever exercise the 404 path: it is replaced by the served
  model so the completion paths run.
- Generation cost: a generated `max_tokens` (or `max_completion_tokens`) that the server would
  accept and that asks for more than MAX_GEN tokens is lowered to MAX_GEN, and a body that sets
  neither gets `max_tokens: MAX_GEN`. Values the server refuses (0, negative, not integers,
  over the context) are sent as generated.
"""

import os

import schemathesis

from bulkhead_server import MODEL

MAX_GEN = 4
CONTEXT = int(os.environ["BULKHEAD_SCHEMATHESIS_CONTEXT"])
LIMITS = ("max_completion_tokens", "max_tokens")


def cheap(v):
    return isinstance(v, int) and not isinstance(v, bool) and MAX_GEN < v <= CONTEXT


@schemathesis.hook
def map_body(context, body):
    if not isinstance(body, dict):
        return body
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    for k in LIMITS:
        if cheap(body.get(k)):
            body[k] = MAX_GEN
    if all(body.get(k) is None for k in LIMITS):
        body["max_tokens"] = MAX_GEN
    return body
