"""Our block kernels on blocks that llama.cpp's `llama-quantize` wrote (SmolLM2's weights, one
tensor's first 13 rows per type: tests/model/data, written by scripts/llama_quantize_blocks.py):
within the activations' error bound of gguf-py's dequantized product and on the kernel's stated
arithmetic, like the random blocks of test_blocks.py, and the same bits at every row count."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from batchserve.model.blocks import NATIVE_TYPES, BlockLinear, BlockPart, block_products_invariant
from tests.model.test_blocks import _check

DATA = Path(__file__).parent / "data" / "llama_quantize_blocks.npz"

pytestmark = pytest.mark.skipif(not block_products_invariant(), reason="our block kernels do not run here")


def _blocks() -> dict[str, tuple[np.ndarray, int, str]]:
    data = np.load(DATA)
    return {
        k: (data[k], int(data[f"{k}_cols"][0]), str(data[f"{k}_source"][0]))
        for k in data.files
        if not k.endswith(("_cols", "_source"))
    }


def test_every_type_we_read_has_llama_quantizes_blocks():
    assert {T[name] for name in _blocks()} == set(NATIVE_TYPES)


@pytest.mark.parametrize("name", sorted(t.name for t in map(T, NATIVE_TYPES)))
def test_llama_quantizes_blocks_are_the_dequantized_product(name):
    raw, cols, source = _blocks()[name]
    qtype = int(T[name])
    layer = BlockLinear([BlockPart(raw, qtype, cols)])
    gen = torch.Generator().manual_seed(qtype)
    for rows in (1, 4, 9):
        x = torch.randn(rows, cols, generator=gen) * torch.rand(1, cols, generator=gen) * 4  # uneven channels
        _check(layer, [(raw, qtype)], x)
    # A row's bits do not depend on the rows beside it.
    x = torch.randn(9, cols, generator=gen)
    together = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(9)])
    assert torch.equal(together, alone), f"{name} ({source})"
