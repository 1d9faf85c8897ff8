"""Every decoder layer in one call of our kernels (`KernelDecoderLayers`): the bits of the layers'
own forwards on every row of a mixed step (prompt chunks, draft trees, windows), the same pool
writes, at any thread count; where it does not run, the layers run one by one."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from batchserve import kernels
from batchserve.attention import StepLayout, TorchReferenceBackend
from batchserve.attention.kernel import KernelBackend
from batchserve.model import native_from_hf
from batchserve.model.blocks import BlockLinear, BlockPart, random_blocks
from batchserve.model.fused import KernelDecoderLayers, why_not_fused
from batchserve.model.layers import use_kernel_layers
from batchserve.model.llama import layer_attention
from tests.attention.layouts import blocks_needed, random_step, slot_mapping
from tests.conftest import TINY_VOCAB

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}")
LAYERS, BS = 3, 16


def _q4_model(bias: bool, seed: int = 0, kind: str = "llama") -> Any:
    """A tiny Llama (or Qwen3 with its per-head q/k norms, or Mistral with a 8-key window in every
    layer) whose products are random Q4_1 blocks on our kernel, norms and silu*up ours."""
    import transformers as tf

    config_class = {"llama": tf.LlamaConfig, "qwen3": tf.Qwen3Config, "mistral-window": tf.MistralConfig}[kind]
    extra = {"sliding_window": 8} if kind == "mistral-window" else {}
    config = config_class(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        attention_bias=bias, mlp_bias=bias, bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    hf = tf.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # not ones: a skipped norm shows
                p.uniform_(0.5, 1.5)
    native = native_from_hf(hf)
    gen = torch.Generator().manual_seed(seed)
    for layer in native.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):  # fmt: skip
            old = getattr(parent, name)
            b = None if old.bias is None else torch.randn(old.out_features, generator=gen)
            sizes = getattr(old, "sizes", (old.out_features,))
            raw = random_blocks(T.Q4_1, old.out_features, old.in_features, gen)
            setattr(parent, name, BlockLinear([BlockPart(raw, T.Q4_1, old.in_features)], b, sizes))
    use_kernel_layers(native)
    return native


def _forward(model: Any, backend: Any, seqs: list, ids: torch.Tensor) -> torch.Tensor:
    """Every row's logits [T, V] for one packed step."""
    step = StepLayout.from_seqs(seqs)
    positions = torch.from_numpy(np.concatenate([step.row_positions(i) for i in range(len(seqs))]))
    meta = backend.build_metadata(step, slot_mapping(seqs, BS))
    with torch.no_grad():
        return model(ids[None], positions[None], torch.arange(ids.shape[0]), meta).logits[0]


def _pools(num_blocks: int, gen: torch.Generator, config: Any = None) -> tuple[KernelBackend, KernelBackend]:
    shape = (LAYERS, 2, 16) if config is None else (config.num_hidden_layers, config.num_key_value_heads,
                                                     config.head_dim)  # fmt: skip
    a, b = (KernelBackend(shape[0], num_blocks, BS, *shape[1:]) for _ in range(2))
    if config is not None:  # each layer's window, as the engine gives them
        a.set_layers(layer_attention(config))
        b.set_layers(layer_attention(config))
    torch.randn(a.k_cache.shape, generator=gen, out=a.k_cache)
    torch.randn(a.v_cache.shape, generator=gen, out=a.v_cache)
    b.k_cache.copy_(a.k_cache)
    b.v_cache.copy_(a.v_cache)
    return a, b


@pytest.mark.parametrize(
    ("bias", "seed", "kind"),
    [(False, 0, "llama"), (True, 1, "llama"), (False, 2, "qwen3"), (False, 3, "mistral-window")],
)
def test_the_fused_layers_give_every_row_the_bits_of_the_layers_one_by_one(bias, seed, kind):
    model = _q4_model(bias, seed, kind)
    assert why_not_fused(model.layers) is None
    together = check_fused_against_one_by_one(model, seed, (1, 3))
    assert together.seconds > 0  # attention's time is still reported apart


def check_fused_against_one_by_one(model: Any, seed: int, thread_counts: tuple[int, ...]) -> KernelBackend:
    """A random ragged step through `model`'s layers one by one, then fused at each thread count:
    the same output and the same K/V written, bit for bit. Returns the fused run's pool."""
    fused = KernelDecoderLayers(model.layers)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    num_blocks = blocks_needed((0, 1, 7, 33, 200), BS)
    seqs = random_step(rng, BS, num_blocks, cached=(0, 1, 7, 33, 200))
    ids = torch.randint(0, TINY_VOCAB, (seqs[-1].q_start + seqs[-1].q_len,), generator=gen)
    one_by_one, together = _pools(num_blocks, gen, model.config)
    model.fused_layers = None
    want = _forward(model, one_by_one, seqs, ids)
    model.fused_layers = fused
    before = torch.get_num_threads()
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            assert torch.equal(_forward(model, together, seqs, ids), want), threads
            assert torch.equal(together.k_cache, one_by_one.k_cache)
            assert torch.equal(together.v_cache, one_by_one.v_cache)
    finally:
        torch.set_num_threads(before)
    return together


def test_a_layer_that_is_not_ours_end_to_end_runs_the_layers_one_by_one():
    model = _q4_model(bias=False)
    assert why_not_fused(model.layers) is None
    down = model.layers[1].mlp.down_proj
    model.layers[1].mlp.down_proj = torch.nn.Linear(down.in_features, down.out_features, bias=False)
    assert "layer 1's mlp.down_proj" in why_not_fused(model.layers)
    with pytest.raises(ValueError, match="do not run fused"):
        KernelDecoderLayers(model.layers)
    model.layers[1].mlp.down_proj = down
    model.layers[0].self_attn.head_dim = 8  # rotary's kernel rotates whole halves of 8 values
    assert "head dim 8" in why_not_fused(model.layers)


def test_a_step_on_another_attention_backend_runs_the_layers_one_by_one():
    """The torch reference's metadata carries no kernel plan: the layers run in Python on it (the
    bits of the model without fused layers), close to what the kernel backend's step gives (its
    attention sums in another order, and the products quantize their inputs)."""
    model = _q4_model(bias=False)
    fused = KernelDecoderLayers(model.layers)
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    seqs = random_step(rng, BS, 200, cached=(0, 9))
    ids = torch.randint(0, TINY_VOCAB, (seqs[-1].q_start + seqs[-1].q_len,), generator=gen)
    refs = [TorchReferenceBackend(LAYERS, 200, BS, 2, 16) for _ in range(2)]
    assert not fused.runs(refs[0].build_metadata(StepLayout.from_seqs(seqs), slot_mapping(seqs, BS)))
    want = _forward(model, refs[0], seqs, ids)
    model.fused_layers = fused
    assert torch.equal(_forward(model, refs[1], seqs, ids), want)
    ours = _forward(model, KernelBackend(LAYERS, 200, BS, 2, 16), seqs, ids)
    torch.testing.assert_close(ours, want, rtol=0, atol=5e-3)
