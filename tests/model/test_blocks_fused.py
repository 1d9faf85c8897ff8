"""Decoder layers whose products are `BlockLinear`s (any GGUF types, q|k|v and gate|up in several
types, beside a layer of one type) in one call of our kernels: the bits of the layers one by one."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as T

from batchserve import kernels
from batchserve.model import native_from_hf
from batchserve.model.blocks import BlockLinear, BlockPart, random_blocks
from batchserve.model.fused import why_not_fused
from batchserve.model.layers import use_kernel_layers
from tests.conftest import TINY_VOCAB
from tests.model.test_fused import LAYERS, check_fused_against_one_by_one

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}")

# Per layer, each product's parts' types, as llama.cpp's mixes store them: Q4_K_M with attn_v and
# ffn_down in Q6_K, a file of 32-value types, and a Q4_1 layer (SmolLM2's), each product one part.
MIXES = (
    {"qkv": (T.Q4_K, T.Q4_K, T.Q6_K), "o": (T.Q4_K,), "gate_up": (T.Q4_K, T.Q5_K), "down": (T.Q6_K,)},
    {"qkv": (T.Q4_0, T.Q5_1, T.Q8_0), "o": (T.Q5_0,), "gate_up": (T.Q4_1, T.Q8_0), "down": (T.Q5_K,)},
    {"qkv": (T.Q4_1,), "o": (T.Q4_1,), "gate_up": (T.Q4_1,), "down": (T.Q4_1,)},
)


def _block_model(bias: bool, seed: int) -> Any:
    """A tiny Llama (widths multiples of 256, for the K-quants) whose products are random GGUF
    blocks per MIXES, norms and silu*up ours."""
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
        num_attention_heads=16, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        attention_bias=bias, mlp_bias=bias, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    native = native_from_hf(tf.AutoModelForCausalLM.from_config(config).float().eval())
    gen = torch.Generator().manual_seed(seed)
    for layer, mix in zip(native.layers, MIXES, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        products = ((attn, "qkv_proj", "qkv"), (attn, "o_proj", "o"), (mlp, "gate_up_proj", "gate_up"),
                    (mlp, "down_proj", "down"))  # fmt: skip
        for parent, name, key in products:
            old = getattr(parent, name)
            b = None if old.bias is None else torch.randn(old.out_features, generator=gen)
            sizes = getattr(old, "sizes", (old.out_features,))
            k = old.in_features
            widths = sizes if len(sizes) == len(mix[key]) else (old.out_features,)
            parts = [BlockPart(random_blocks(q, n, k, gen), q, k) for q, n in zip(mix[key], widths, strict=True)]
            setattr(parent, name, BlockLinear(parts, b, sizes))
    use_kernel_layers(native)
    return native


@pytest.mark.parametrize(("bias", "seed"), [(False, 0), (True, 1)])
def test_fused_block_layers_give_every_row_the_bits_of_the_layers_one_by_one(bias, seed):
    model = _block_model(bias, seed)
    assert why_not_fused(model.layers) is None
    assert type(model.layers[0].self_attn.qkv_proj) is BlockLinear
    assert model.layers[0].self_attn.qkv_proj.qtypes == (T.Q4_K, T.Q4_K, T.Q6_K)
    check_fused_against_one_by_one(model, seed, (1, 2))
