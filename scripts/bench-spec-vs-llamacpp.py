#!/usr/bin/env python3
"""Served speculative decoding at batch 1: output tok/s of OpenAI-compatible servers on a
copying task (repeat a passage), free chat, and a later turn that quotes an earlier one
(turn 1 asks for a paragraph, untimed; turn 2, timed, asks to copy it: SmolLM2-135M
ignores "repeat it word for word, then add a sentence" and writes anew), greedy, 128
tokens, one request at a time, alternating servers, the median of 3 after a warm-up. Whole-request time (the first token included), the same for every server.
Not part of CI.

Usage: scripts/bench-spec-vs-llamacpp.py PORT:MODEL:NAME [PORT:MODEL:NAME ...]
  e.g. bulkhead serve --port 18201 --model-id smol &
       llama-server -m MODEL.gguf -t 2 --port 18202 -c 4096 --spec-type ngram-simple &
       scripts/bench-spec-vs-llamacpp.py 18201:smol:bulkhead 18202:x:llama-ngram
Ratios are against the first server named.
"""
import json, sys, time, urllib.request
PASSAGE = ("A key-value cache stores, for every token a model has read, the keys and values its "
"attention layers computed, so that each new token attends to them without computing them again. In a "
"disaggregated server one machine computes a prompt's cache and another generates from it; the cache moves "
"between them in pages, and a page that changes hands must never show its earlier owner's values.")
TASKS = {"copy": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
         "chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
         "turn2": None}
TURN1 = "Explain in one paragraph how a lighthouse warns ships at night."
TURN2 = "Copy your last answer exactly."
def chat(port, model, messages):
    body = json.dumps({"model": model, "temperature": 0, "max_tokens": 128, "messages": messages}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))
first_turns = {}
def messages(port, model, task):
    if task != "turn2":
        return [{"role": "user", "content": TASKS[task]}]
    if port not in first_turns:   # the server's own first answer, untimed
        first_turns[port] = chat(port, model, [{"role": "user", "content": TURN1}])["choices"][0]["message"]["content"]
    return [{"role": "user", "content": TURN1}, {"role": "assistant", "content": first_turns[port]},
            {"role": "user", "content": TURN2}]
def run(port, model, task):
    body = json.dumps({"model": model, "temperature": 0, "max_tokens": 128,
                       "messages": messages(port, model, task)}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, {"content-type": "application/json"})
    t = time.monotonic()
    r = json.load(urllib.request.urlopen(req, timeout=300))
    dt = time.monotonic() - t
    return r["usage"]["completion_tokens"] / dt, r["choices"][0]["message"]["content"]
servers = [(int(p), m, n) for p, m, n in (s.split(":") for s in sys.argv[1:])]
for task in TASKS:
    res = {n: [] for _, _, n in servers}
    texts = {}
    for rep in range(4):
        for port, model, name in servers:
            v, text = run(port, model, task)
            if rep: res[name].append(v)   # first rep warms up
            texts[name] = text
    med = {n: sorted(v)[len(v)//2] for n, v in res.items()}
    base = med[servers[0][2]]
    print(task, "  ".join(f"{n}: {med[n]:.1f} tok/s ({med[n]/base:.2f}x of {servers[0][2]})" for n in med))
    for n, t in texts.items(): print("   ", n, repr(t[:70]))
