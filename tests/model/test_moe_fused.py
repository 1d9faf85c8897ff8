"""Sparse layers in the one-call decoder layers (`model.fused`, csrc/layers.cpp): a Qwen3-MoE file's
layers, router, routing and experts included, give every row the bits of the layers one by one at
every thread count; what keeps a model's sparse layers out of the call says why."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchserve import kernels
from batchserve.bench.gguf_write import write_gguf
from batchserve.model.fused import KernelDecoderLayers, why_not_fused
from batchserve.model.gguf_native import load_gguf_native
from tests.model.test_fused import check_fused_against_one_by_one
from tests.model.test_moe import SHAPES, needs_blocks

pytestmark = [needs_blocks, pytest.mark.skipif(not kernels.available(), reason="our kernels do not build here")]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-fused")
    quants = {"gpt-oss": "MXFP4_MOE", "qwen3moe": "Q4_K_M", "qwen2moe": "Q4_K_M"}
    return {name: write_gguf(root / f"{name}.gguf", SHAPES[name], quant) for name, quant in quants.items()}


def test_sparse_layers_in_one_call_give_every_row_the_bits_of_the_layers_one_by_one(files):
    model, _ = load_gguf_native(files["qwen3moe"])
    assert isinstance(model.fused_layers, KernelDecoderLayers), why_not_fused(model.layers)
    routing = model.layers[0].mlp.routing
    assert model.fused_layers.routing == (routing.experts, routing.top_k, 3)  # softmax first, renormalized
    together = check_fused_against_one_by_one(model, 0, (1, 2, 3))
    assert together.seconds > 0


@pytest.mark.parametrize(("name", "why"), [("qwen2moe", "shared expert"), ("gpt-oss", "clamped SwiGLU")])
def test_what_keeps_sparse_layers_out_of_the_call_says_why(files, name, why):
    model, _ = load_gguf_native(files[name])
    assert model.fused_layers is None
    assert why in why_not_fused(model.layers)
