"""The native forward's layers: norm and rotary with transformers' arithmetic bit for bit, row by row;
the bfloat16 products row-invariant; gpt-oss's clamped SwiGLU on our kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchserve import kernels
from batchserve.model.layers import (
    Bf16Linear,
    ClampedSwiGLU,
    RMSNorm,
    Rotary,
    bf16_prepack_available,
    packed_products_invariant,
)
from batchserve.model.moe import KernelClampedSwiGLU


def test_the_fused_norm_has_transformers_bits_and_a_row_never_depends_on_the_others():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    ours, theirs = RMSNorm(576, 1e-5), LlamaRMSNorm(576, 1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(576, generator=gen))
        theirs.weight.copy_(ours.weight)
    x, residual = torch.randn(2, 64, 576, generator=gen)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
        normed, summed = ours(x, residual)
        assert torch.equal(summed, x + residual) and torch.equal(normed, theirs(x + residual))
        assert all(torch.equal(ours(x[:rows]), ours(x)[:rows]) for rows in (1, 2, 3, 5, 8, 17))


def test_the_rotation_has_transformers_bits_for_q_and_k_rotated_together():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))  # head dim 16
    rotary = Rotary(inv_freq, 1.0)
    positions = torch.tensor([0, 5, 5, 6, 300, 7])  # draft siblings share a position; one far out
    qkv = torch.randn(6, (3 + 1 + 1) * 16, generator=gen)  # 3 query heads, 1 KV head
    cos, sin = rotary.cos_sin(positions, torch.float32)
    qk = Rotary.apply(qkv.view(6, 5, 16).transpose(0, 1)[:4], cos, sin)  # a strided view, as the layer passes it
    assert qk.is_contiguous() and qk.shape == (4, 6, 16)  # head-major, as the backends read it
    qk = qk.transpose(0, 1)
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    q, k = qkv[:, :48].view(6, 3, 16), qkv[:, 48:64].view(6, 1, 16)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin(), unsqueeze_dim=1)
    assert torch.equal(qk[:, :3], ref_q) and torch.equal(qk[:, 3:], ref_k)


needs_bf16 = pytest.mark.skipif(not bf16_prepack_available(), reason="oneDNN reorders no bfloat16 weights here")


@needs_bf16
def test_bf16_products_take_float32_rows_and_give_float32_rows_near_the_float32_product():
    gen = torch.Generator().manual_seed(2)
    linear = nn.Linear(192, 320, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(320, 192, generator=gen) / 8)
        linear.bias.copy_(torch.randn(320, generator=gen))
    layer = Bf16Linear(linear)
    x = torch.randn(7, 192, generator=gen)
    with torch.no_grad():
        out, exact = layer(x), linear(x)
    assert out.dtype == torch.float32 and out.shape == (7, 320)
    assert (out - exact).abs().max() < 0.05 * exact.abs().max()  # bfloat16's rounding, not another product
    assert not torch.equal(out, exact)  # ... and rounded: this is not the float32 product
    # The bias is added in float32 after the bfloat16 product.
    assert layer.bias.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(out, Bf16Linear(_without_bias(linear))(x) + linear.bias)


@needs_bf16
def test_a_bf16_product_feeding_the_residual_leaves_in_bfloat16_with_the_same_values():
    gen = torch.Generator().manual_seed(4)
    linear = nn.Linear(192, 320, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(320, 192, generator=gen))
    x, residual = torch.randn(5, 192, generator=gen), torch.randn(5, 320, generator=gen)
    with torch.no_grad():
        wide, narrow = Bf16Linear(linear)(x), Bf16Linear(linear, torch.bfloat16)(x)
    assert wide.dtype == torch.float32 and narrow.dtype == torch.bfloat16
    assert torch.equal(narrow.float(), wide)  # the kernel's bfloat16, not rounded again
    # The residual add widens it exactly: the bits of the float32-out layer's sum.
    norm = RMSNorm(320, 1e-5)
    (h_wide, sum_wide), (h_narrow, sum_narrow) = norm(wide, residual), norm(narrow, residual)
    assert sum_narrow.dtype == torch.float32 and torch.equal(sum_narrow, sum_wide) and torch.equal(h_narrow, h_wide)
    # A bias is added in float32, so such a layer leaves in float32 whatever it was asked.
    assert Bf16Linear(nn.Linear(192, 320), torch.bfloat16)(x).dtype == torch.float32


def _without_bias(linear: nn.Linear) -> nn.Linear:
    bare = nn.Linear(linear.in_features, linear.out_features, bias=False)
    with torch.no_grad():
        bare.weight.copy_(linear.weight)
    return bare


@needs_bf16
def test_a_row_of_a_bf16_product_has_the_same_bits_in_every_row_bucket_where_the_check_says_so():
    # oneDNN's product is a third-party kernel: its invariance is asserted through the verdict of
    # the check the engine runs once per process (true must mean true); where the check says
    # otherwise (AMX tiles), the engine does not run oneDNN's bfloat16 products (ours, or none).
    from batchserve.model import bf16_layer_class

    if not packed_products_invariant(Bf16Linear):
        assert bf16_layer_class() is not Bf16Linear
        return
    gen = torch.Generator().manual_seed(3)
    layer = Bf16Linear(nn.Linear(576, 1536, bias=False))
    x = torch.randn(40, 576, generator=gen)
    with torch.no_grad():
        whole = layer(x)
        assert all(torch.equal(layer(x[i : i + 1]), whole[i : i + 1]) for i in range(0, 40, 7))
        assert torch.equal(layer(x[:5]), whole[:5]) and torch.equal(layer(x[3:20]), whole[3:20])


def test_a_product_past_the_last_bucket_is_computed_in_checked_calls():
    """A step of more rows than the last row bucket (a long chunk under a large token budget) is
    split into calls the kernel checks cover: every row has the bits it has in a small call."""
    from batchserve.model.layers import ROW_BUCKETS, PackedLinear, prepack_available

    if not prepack_available():
        pytest.skip("this torch cannot prepack oneDNN weights")
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 64, generator=gen))
    packed = PackedLinear(linear)
    rows = ROW_BUCKETS[-1] * 2 + 300
    x = torch.randn(rows, 64, generator=gen)
    out = packed(x)
    assert out.shape == (rows, 96)
    for i in (0, ROW_BUCKETS[-1] - 1, ROW_BUCKETS[-1], rows - 1):
        assert torch.equal(out[i], packed(x[i : i + 8])[0])


@pytest.mark.skipif(not kernels.available(), reason="our kernels do not build here")
def test_the_clamped_swiglu_kernel_computes_gpt_oss_activation_row_by_row():
    """`KernelClampedSwiGLU` against `ClampedSwiGLU` (transformers' gpt-oss expert activation in
    torch ops; our exp: near, not its bits): the gate clamped above, up on both sides, a NaN kept,
    and each row's bits its own at any row and thread count."""
    alpha, limit, inter = 1.702, 7.0, 64
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(33, 2 * inter, generator=gen) * 6  # past the limit on both sides
    gate_up[3, 5] = gate_up[4, inter + 7] = float("nan")
    ours = KernelClampedSwiGLU(alpha, limit)(gate_up)
    theirs = ClampedSwiGLU(alpha, limit)(gate_up)
    assert ours.shape == (33, inter)
    assert torch.isnan(ours[3, 5]) and torch.isnan(ours[4, 7]) and torch.isnan(ours).sum() == 2
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6, equal_nan=True)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for rows in (1, 2, 7):
                got = KernelClampedSwiGLU(alpha, limit)(gate_up[:rows])
                torch.testing.assert_close(got, ours[:rows], rtol=0, atol=0, equal_nan=True)
    finally:
        torch.set_num_threads(before)
