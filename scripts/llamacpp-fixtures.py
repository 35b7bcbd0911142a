#!/usr/bin/env python3
"""Record what llama.cpp computes, as fixtures for the tests that hold Bulkhead to it. Not run
in CI: the JSON it writes is committed, and CI compares against it.

Needs llama.cpp through llama-cpp-python 0.3.36 (its vendored copy, built from the sdist),
numpy and cargo:

    python3 -m venv ~/.cache/bulkhead/llamacpp-venv
    ~/.cache/bulkhead/llamacpp-venv/bin/pip install numpy llama-cpp-python==0.3.36
    ~/.cache/bulkhead/llamacpp-venv/bin/python scripts/llamacpp-fixtures.py

It writes:

- crates/tokenizer/tests/fixtures/gemma3_tokenizer.json: llama.cpp's token ids of the strings
  below for Gemma 3 270M (its SentencePiece vocabulary), special tokens parsed, no BOS;
- crates/model/tests/fixtures/gemma3_greedy.json: greedy continuations of a few prompts (ids),
  which the test replays teacher-forced: at every step llama.cpp's choice must be our argmax,
  or within 0.25 logits of it;
- crates/model/tests/fixtures/tiny_logits.json: llama.cpp's logits for tiny random-weight
  models of the architectures with no small real model here (qwen2, qwen3, llama with
  Llama 3's RoPE factors, gemma3 with a sliding window), which
  `cargo run -p bulkhead-model --example tiny-models` writes from a fixed seed (the test
  rebuilds them and checks the recorded digests).

The Gemma model comes from the Bulkhead cache (`bulkhead serve --model gemma3-270m` fetches
it), or $GEMMA.
"""

import json
import os
import subprocess
import sys
import tempfile

import llama_cpp.llama_cpp as llama_c
import numpy as np
from llama_cpp import Llama

# ggml's AMX buffer type crashes in ggml_backend_amx_mul_mat on some Intel hosts (seen on a
# Xeon with AMX_INT8 under a VM); the plain CPU kernels compute the same thing.
_default_params = llama_c.llama_model_default_params


def _without_extra_buffers():
    p = _default_params()
    p.use_extra_bufts = False
    return p


llama_c.llama_model_default_params = _without_extra_buffers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOME = os.environ.get("BULKHEAD_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "bulkhead")
GEMMA = os.environ.get("GEMMA") or os.path.join(HOME, "models", "gemma-3-270m-q4_k_m.gguf")

# At least 50 strings: Unicode, code, whitespace runs, digits, special tokens.
STRINGS = [
    "Hello world", " Hello world", "  leading spaces", "trailing spaces   ", "tab\tseparated\tvalues",
    "new\nline", "\n\n\nthree newlines", "mixed \t \n whitespace", "    four spaces of indent",
    "1234567890", "3.14159265358979", "1,000,000 and 2,000,000", "phone: +1 (555) 123-4567", "0x7fffffff",
    "2026-12-02T07:24:00Z", "v1.2.3-rc.4+build.5",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
    "fn main() { println!(\"{}\", 42); }", "#include <stdio.h>\nint main(void) { return 0; }",
    "SELECT * FROM users WHERE id = 1;", "<div class=\"x\">&amp;</div>", "{\"key\": [1, 2, {\"nested\": null}]}",
    "a = b ** 2 // 3 % 4", "if (x != y && z >= 0) { w <<= 1; }",
    "naïve café résumé", "Übergrößenträger", "Ελληνικά γράμματα", "Русский текст здесь", "日本語のテキストです",
    "中文文本测试", "한국어 텍스트", "עברית", "العربية", "हिन्दी पाठ", "ไทย", "emoji 😀🎉👍🏽", "🇫🇷🇯🇵",
    "zero\u200bwidth", "combining e\u0301", "math ∑∫√∞≠≤", "arrows ←↑→↓", "currency €£¥₹",
    "The quick brown fox jumps over the lazy dog.", "Once upon a time, there was a little girl.",
    "ALL CAPS SHOUTING", "camelCaseIdentifier and snake_case_name", "hyphen-ated--double---triple",
    "...ellipsis... and !!! and ???", "quotes 'single' \"double\" `back`", "<start_of_turn>user\nhi<end_of_turn>",
    "<bos>text after bos", "repeat repeat repeat repeat repeat", "a", " ", "",
]

PROMPTS = [
    "The Eiffel Tower is located in the city of",
    "One, two, three, four,",
    "The capital of France is",
    "def fibonacci(n):",
    "The largest planet in the solar system is",
    "Once upon a time, there was a little",
    "Water boils at a temperature of",
    "import numpy as np\n\ndef",
    "The first president of the United States was",
    "In 1969, humans first",
]


def write(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print("wrote", os.path.relpath(path, ROOT), file=sys.stderr)


def gemma():
    llm = Llama(model_path=GEMMA, n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    cases = [{"text": s, "ids": llm.tokenize(s.encode(), add_bos=False, special=True)} for s in STRINGS]
    write(os.path.join(ROOT, "crates/tokenizer/tests/fixtures/gemma3_tokenizer.json"),
          {"source": "llama.cpp (llama-cpp-python 0.3.36), Gemma 3 270M Q4_K_M, special tokens parsed, no BOS", "cases": cases})
    greedy = []
    for p in PROMPTS:
        ids = llm.tokenize(p.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        out = []
        for _ in range(16):
            t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out.append(t)
            llm.eval([t])
        greedy.append({"prompt": p, "prompt_ids": ids, "completion_ids": out})
    write(os.path.join(ROOT, "crates/model/tests/fixtures/gemma3_greedy.json"),
          {"source": "llama.cpp (llama-cpp-python 0.3.36), Gemma 3 270M Q4_K_M, greedy, 16 tokens, prompt with BOS", "cases": greedy})


# ---------------------------------------------------------------- tiny models

# Token ids, fed to llama.cpp as they are (the tiny vocabulary is filler): BOS, then a walk
# over the vocabulary; 24 positions, three times gemma3's window of 8.
TINY_PROMPTS = [[1] + [(7 * i + 11) % 297 + 3 for i in range(23)], [1] + [(13 * i * i + 5) % 297 + 3 for i in range(23)]]


def tiny():
    """The tiny models are written by Rust (tests/support, a fixed seed) so CI rebuilds the
    same bytes instead of a weights file being committed; the fixture records their digests."""
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run(["cargo", "run", "-q", "-p", "bulkhead-model", "--example", "tiny-models", d],
                             cwd=ROOT, check=True, capture_output=True, text=True).stdout
        record = []
        for line in out.split("\n"):
            if not line.strip():
                continue
            arch, digest = line.split()
            llm = Llama(model_path=os.path.join(d, arch + ".gguf"), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
            cases = []
            for ids in TINY_PROMPTS:
                llm.reset()
                llm.eval(ids)
                # every 4th position and the last: the fixture stays small, the window's edge is in it
                rows = [{"pos": p, "logits": [round(float(v), 4) for v in llm.scores[p]]}
                        for p in list(range(0, len(ids), 4)) + [len(ids) - 1]]
                cases.append({"ids": ids, "rows": rows})
            record.append({"arch": arch, "digest": digest, "cases": cases})
            print("tiny", arch, digest, file=sys.stderr)
    write(os.path.join(ROOT, "crates/model/tests/fixtures/tiny_logits.json"),
          {"source": "llama.cpp (llama-cpp-python 0.3.36), logits of tiny random models at every 4th and the last position", "models": record})


if __name__ == "__main__":
    which = sys.argv[1:] or ["gemma", "tiny"]
    if "gemma" in which:
        gemma()
    if "tiny" in which:
        tiny()
