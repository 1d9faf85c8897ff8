"""Rows of blocks that llama.cpp's own `llama-quantize` wrote, one tensor per block type we read,
saved for tests/model/test_blocks_llama_quantize.py (our own quantizers are no reference for how
real files fill their blocks, the IQ types' least of all).

    python scripts/llama_quantize_blocks.py OUT.npz FILE.gguf [FILE.gguf ...]

The files are SmolLM2's weights written by `llama-quantize --allow-requantize` in each mix
(Q2_K with `--pure`, so that its 1536-wide rows hold Q2_K; MXFP4, which llama-quantize writes
only for experts or asked, as `Q8_0 --tensor-type ffn_up=mxfp4`). From each file, the first tensor
of every type not taken yet gives ROWS rows: an odd count, so that a row group is padded."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from batchserve.model.blocks import NATIVE_TYPES
from batchserve.model.gguf_file import GGUFTensors

ROWS = 13


def extract(paths: list[Path]) -> dict[str, np.ndarray]:
    """`{TYPE: uint8 [ROWS, row bytes], TYPE_cols: [cols], TYPE_source: the tensor}` per type."""
    from gguf import GGMLQuantizationType

    out: dict[str, np.ndarray] = {}
    for path in paths:
        tensors = GGUFTensors(path)
        for view in tensors.tensors.values():
            name = GGMLQuantizationType(view.qtype).name
            if view.qtype not in NATIVE_TYPES or len(view.shape) != 2 or name in out:
                continue
            out[name] = np.array(view.data[:ROWS])
            out[f"{name}_cols"] = np.array([view.shape[1]])
            out[f"{name}_source"] = np.array([f"{path.name}:{view.name}"])
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    found = extract([Path(p) for p in argv[1:]])
    np.savez_compressed(argv[0], **found)
    print(", ".join(sorted(k for k in found if not k.endswith(("_cols", "_source")))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
