#!/usr/bin/env python3
"""Record ggml's dequantisation of random blocks of every tensor type Bulkhead loads, as
computed by the `gguf` Python package (ggml's own reference implementation in numpy), for
crates/model/tests/dequant.rs. Not run in CI: the fixture it writes is committed.

    python3 -m pip install gguf==0.19.0 numpy
    python3 scripts/dequant-fixtures.py > crates/model/tests/fixtures/dequant.json
"""

import json
import random
import struct

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants

TYPES = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]

# Where each type keeps its f16 scale fields (byte offsets within a block): random bytes
# there could be infinities or NaN, so they are replaced by small finite values.
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}


def block(rng, name, nbytes):
    b = bytearray(rng.getrandbits(8) for _ in range(nbytes))
    if name in ("F16", "BF16"):
        # Finite values only: clear the top exponent bit of each element.
        for i in range(1, nbytes, 2):
            b[i] &= 0x3F
    for off in F16_FIELDS.get(name, []):
        b[off:off + 2] = struct.pack("<e", rng.uniform(-0.05, 0.05))
    return bytes(b)


def main():
    rng = random.Random(20261202)
    cases = []
    for name in TYPES:
        ty = getattr(T, name)
        elems, nbytes = GGML_QUANT_SIZES[ty]
        blocks = 512 // elems if elems > 1 else 64
        data = b"".join(block(rng, name, nbytes) for _ in range(max(blocks, 2)))
        values = quants.dequantize(np.frombuffer(data, dtype=np.uint8), ty).astype(np.float32).ravel()
        cases.append({"type": name, "bytes": data.hex(), "values": [float(v) for v in values]})
    json.dump({"source": "gguf (Python) 0.19.0 quants.dequantize", "cases": cases}, indent=None, fp=__import__("sys").stdout)


if __name__ == "__main__":
    main()
