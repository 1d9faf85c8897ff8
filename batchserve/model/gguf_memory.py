"""What loading a GGUF file from its blocks takes in memory, checked before anything is read: the
packed blocks (about the file's bytes), bfloat16 copies of the tensors without a kernel of ours,
float32 routers, the KV pool and a margin, against the machine's available memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from batchserve.model.gguf_file import FLOAT_TYPES, GGUFTensors

MARGIN_BYTES = 512 << 20  # left free beside the weights and the KV pool (the runtime's own)
ROUTER = "ffn_gate_inp"  # a sparse layer's router (and, `_shexp`, its shared expert's gate)


class GGUFTooLarge(ValueError):
    """The file's layers and the KV pool do not fit in this machine's available memory."""


def bytes_needed(tensors: GGUFTensors) -> int:
    """Bytes the load needs at its peak: the blocks of every native type as packed (about the
    file's), bfloat16 for the rest, and while such a product is built its float32 weights twice
    (the dequantized parts joined, then the layer's own; at most two parts' worth of the largest
    such tensor); the embedding's rows stay in the file."""
    from batchserve.model.blocks import NATIVE_TYPES

    total = largest = 0
    for view in tensors.tensors.values():
        if view.name == "token_embd.weight" and "output.weight" in tensors.tensors:
            continue
        if view.qtype in FLOAT_TYPES and ROUTER in view.name:  # kept in float32 (`_router`)
            total += 4 * int(np.prod(view.shape))
        elif view.qtype in NATIVE_TYPES or len(view.shape) < 2:
            total += view.nbytes
        else:
            values = int(np.prod(view.shape))
            total += 2 * values
            largest = max(largest, values)
    return total + 2 * 2 * 4 * largest


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(tensors: GGUFTensors, kv_bytes: int) -> None:
    need = bytes_needed(tensors) + kv_bytes + MARGIN_BYTES
    have = available_bytes()
    if have is not None and need > have:
        raise GGUFTooLarge(
            f"{tensors.path.name} needs {need:,} bytes ({need / 2**30:.1f} GiB: its layers, a KV pool of"
            f" {kv_bytes / 2**30:.1f} GiB and {MARGIN_BYTES >> 20} MiB to run) and {have:,} are available;"
            " lower --kv-cache-gb or use a smaller file"
        )
