"""The native forward's norm and rotary: transformers' arithmetic bit for bit, row by row."""

from __future__ import annotations

import torch

from batchserve.model.layers import RMSNorm, Rotary


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
