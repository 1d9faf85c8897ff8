"""Layers of the native forward, each a visible class: a kernel choice is a layer, not a patch.

Every tensor here is a step's packed rows: [T, ...], T = all requests' rows back to back (prompt
chunks, roots, draft nodes, window rows); no batch dimension, no padding between requests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm with the residual add fused in: `norm(x)` -> normed; `norm(x, residual)` ->
    (normed, x + residual), the sum being the next residual. Row-wise: a row's result never
    depends on the other rows. Arithmetic as transformers' (float32 inside, weight after)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()  # [T, H]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        summed = x + residual  # [T, H]
        return self._norm(summed), summed


class MergedLinear(nn.Linear):
    """One matrix product for several projections of the same input (q|k|v, gate|up): their
    weights stacked by rows, loaded through `load_part`, the output split by `sizes`."""

    def __init__(self, in_features: int, sizes: tuple[int, ...], bias: bool) -> None:
        super().__init__(in_features, sum(sizes), bias=bias)
        self.sizes = sizes

    @torch.no_grad()
    def load_part(self, part: int, leaf: str, tensor: torch.Tensor) -> None:
        """Copy one projection's `weight` or `bias` into its rows of the merged one."""
        start = sum(self.sizes[:part])
        getattr(self, leaf)[start : start + self.sizes[part]].copy_(tensor)

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(self(x).split(self.sizes, dim=-1))


class SiluAndMul(nn.Module):
    """silu(gate) * up over a merged [T, 2I] gate|up output -> [T, I]."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class Rotary(nn.Module):
    """Rotary embedding (the rotate-half layout transformers' Llama uses) at each row's own
    position, which for a draft node is its prefix length plus its depth in the tree.
    `inv_freq` and `scaling` come from the model's rope config (llama3, linear, ... scaling)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = scaling

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] for positions [T], computed once per step for every layer."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
