#!/usr/bin/env python3
"""Record what llama.cpp computes, as fixtures for the tests that hold Bulkhead to it. Not run
in CI: the JSON it writes is committed, and CI compares against it.

Needs llama.cpp through llama-cpp-python 0.3.36 (its vendored copy, built from the sdist) and
the gguf package:

    python3 -m venv ~/.cache/bulkhead/llamacpp-venv
    ~/.cache/bulkhead/llamacpp-venv/bin/pip install numpy gguf==0.19.0 llama-cpp-python==0.3.36
    ~/.cache/bulkhead/llamacpp-venv/bin/python scripts/llamacpp-fixtures.py

It writes:

- crates/tokenizer/tests/fixtures/gemma3_tokenizer.json: llama.cpp's token ids of the strings
  below for Gemma 3 270M (its SentencePiece vocabulary), special tokens parsed, no BOS;
- crates/model/tests/fixtures/gemma3_greedy.json: greedy continuations of a few prompts (ids),
  which the test replays teacher-forced: at every step llama.cpp's choice must be our argmax,
  or within 0.2 logits of it;
- crates/model/tests/fixtures/tiny/*.gguf and tiny_logits.json: tiny random-weight models of
  the architectures with no small real model here (qwen2, qwen3, llama with Llama 3's RoPE
  factors, llama with a sliding window, gemma3), written with the gguf package from a fixed
  seed, and llama.cpp's logits at every position of a few prompts.

The Gemma model comes from the Bulkhead cache (`bulkhead serve --model gemma3-270m` fetches
it), or $GEMMA.
"""

import json
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants
from llama_cpp import Llama

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

TINY = dict(hidden=64, ffn=128, heads=4, kv_heads=2, layers=3, ctx=128)


def tiny_vocab():
    """A small SentencePiece vocabulary: specials, the 256 byte tokens, then pieces."""
    tokens, scores, types = ["<unk>", "<s>", "</s>"], [0.0, 0.0, 0.0], [2, 3, 3]
    for b in range(256):
        tokens.append("<0x%02X>" % b)
        scores.append(0.0)
        types.append(6)
    words = ["▁", "e", "t", "a", "o", "i", "n", "s", "h", "r", "d", "l", "u", "c", "m", "w", "f", "g", "y", "p", "b",
             "v", "k", ",", ".", "▁t", "he", "▁the", "▁a", "in", "er", "an", "on", "▁o", "re", "▁w", "at", "en", "nd",
             "▁s", "▁c", "▁f", "▁of", "ing", "▁is", "▁in", "▁and", "ou", "▁to", "it", "▁h", "▁b", "es", "or", "▁p"]
    for i, w in enumerate(words):
        tokens.append(w)
        scores.append(-float(i))
        types.append(1)
    return tokens, scores, types


def tiny_model(path, arch, rng, window=None, rope_freqs=False):
    h, ffn, nh, nkv, layers = TINY["hidden"], TINY["ffn"], TINY["heads"], TINY["kv_heads"], TINY["layers"]
    hd = h // nh
    name = "llama" if arch in ("llama3", "mistral") else arch
    w = GGUFWriter(path, name)
    w.add_block_count(layers)
    w.add_context_length(TINY["ctx"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(ffn)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(hd)
    w.add_value_length(hd)
    if window:
        w.add_sliding_window(window)
    tokens, scores, types = tiny_vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(arch != "gemma3")
    vocab = len(tokens)

    def mat(name, rows, cols, scale=0.25):
        x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        q = quants.quantize(x, GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_shape=(rows, cols), raw_dtype=GGMLQuantizationType.Q8_0)

    def vec(name, n, around=1.0):
        w.add_tensor(name, (around + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", vocab, h, 0.5)
    vec("output_norm.weight", h)
    if arch != "gemma3":
        mat("output.weight", vocab, h)
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", np.array([1.0] * (hd // 4) + [4.0] * (hd // 4), dtype=np.float32))
    for l in range(layers):
        p = f"blk.{l}."
        vec(p + "attn_norm.weight", h)
        vec(p + "ffn_norm.weight", h)
        mat(p + "attn_q.weight", nh * hd, h)
        mat(p + "attn_k.weight", nkv * hd, h)
        mat(p + "attn_v.weight", nkv * hd, h)
        mat(p + "attn_output.weight", h, nh * hd)
        mat(p + "ffn_gate.weight", ffn, h)
        mat(p + "ffn_up.weight", ffn, h)
        mat(p + "ffn_down.weight", h, ffn)
        if arch == "qwen2":
            for t, n in (("attn_q", nh * hd), ("attn_k", nkv * hd), ("attn_v", nkv * hd)):
                vec(p + t + ".bias", n, 0.0)
        if arch in ("qwen3", "gemma3"):
            vec(p + "attn_q_norm.weight", hd)
            vec(p + "attn_k_norm.weight", hd)
        if arch == "gemma3":
            vec(p + "post_attention_norm.weight", h)
            vec(p + "post_ffw_norm.weight", h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


TINY_PROMPTS = ["the cat is in the hat, and the dog is on a mat.", "a b c d e f g h i j k l m n o p", "water of the sea"]


def tiny():
    out_dir = os.path.join(ROOT, "crates/model/tests/fixtures/tiny")
    os.makedirs(out_dir, exist_ok=True)
    models = [("qwen2", {}), ("qwen3", {}), ("llama3", {"rope_freqs": True}), ("mistral", {"window": 64}), ("gemma3", {"window": 8})]
    record = []
    for i, (arch, kw) in enumerate(models):
        path = os.path.join(out_dir, f"{arch}.gguf")
        tiny_model(path, arch, np.random.default_rng(1000 + i), **kw)
        llm = Llama(model_path=path, n_ctx=TINY["ctx"], n_threads=2, logits_all=True, verbose=False)
        cases = []
        for p in TINY_PROMPTS:
            ids = llm.tokenize(p.encode(), add_bos=True, special=True)
            llm.reset()
            llm.eval(ids)
            logits = [[round(float(v), 5) for v in llm.scores[i]] for i in range(len(ids))]
            cases.append({"prompt": p, "ids": ids, "logits": logits})
        record.append({"model": f"{arch}.gguf", "cases": cases})
        print("tiny", arch, os.path.getsize(path), "bytes", file=sys.stderr)
    write(os.path.join(out_dir, "tiny_logits.json"), {"source": "llama.cpp (llama-cpp-python 0.3.36), logits at every prompt position", "models": record})


if __name__ == "__main__":
    which = sys.argv[1:] or ["gemma", "tiny"]
    if "gemma" in which:
        gemma()
    if "tiny" in which:
        tiny()
