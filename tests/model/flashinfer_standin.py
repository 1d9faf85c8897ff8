"""Pure-torch stand-ins for the FlashInfer functions the fused layers call (`FlashInferRMSNorm`,
`FlashInferSiluAndMul`, `FlashInferRotary`): FlashInfer's signatures and semantics (in place where
it writes in place, float32 inside, one rounding to the tensor's dtype at the end), run on the CPU
in any float dtype. Each is one torch custom op, as FlashInfer's own ops are registered, so an op
count sees one kernel per call. `LIBRARY` has the modules' shape: `LIBRARY.norm.rmsnorm`, ..."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F


def _normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] float32 -> x / RMS(x) * weight, float32 (FlashInfer's order: x * rsqrt(...) * w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


@torch.library.custom_op("batchserve_standin::rmsnorm", mutates_args=("out",))
def _rmsnorm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    out.copy_(_normed(input.float(), weight, eps))


@torch.library.custom_op("batchserve_standin::fused_add_rmsnorm", mutates_args=("input", "residual"))
def _fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    # The kernel's order: the sum in float32, stored rounded as the residual; the norm of the float32 sum.
    summed = input.float() + residual.float()
    residual.copy_(summed)
    input.copy_(_normed(summed, weight, eps))


@torch.library.custom_op("batchserve_standin::silu_and_mul", mutates_args=("out",))
def _silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    gate, up = input.float().chunk(2, dim=-1)
    out.copy_(F.silu(gate) * up)


@torch.library.custom_op("batchserve_standin::rope", mutates_args=("q", "k"))
def _rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """q [T, Hq, D], k [T, Hkv, D] (any row and head strides) rotated in place, rotate-half layout."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each, float32
    cos, sin = cos[:, None], sin[:, None]
    half = cos.shape[-1]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """flashinfer.norm.rmsnorm"""
    if out is None:
        out = torch.empty_like(input)
    _rmsnorm(out, input, weight, eps)
    return out


def fused_add_rmsnorm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, enable_pdl: bool | None = None
) -> None:
    """flashinfer.norm.fused_add_rmsnorm: residual += input; input = rmsnorm(residual) * weight."""
    if input.dim() != 2 or residual.shape != input.shape or input.stride(-1) != 1 or residual.stride(-1) != 1:
        raise ValueError("fused_add_rmsnorm takes 2D input and residual of one shape, unit stride in a row")
    _fused_add_rmsnorm(input, residual, weight, eps)


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None) -> torch.Tensor:
    """flashinfer.activation.silu_and_mul: silu(input[..., :d]) * input[..., d:]"""
    if input.shape[-1] * input.dtype.itemsize % 16 != 0:
        raise ValueError("The pointers must be multiple of 16 bytes.")
    if out is None:
        out = torch.empty(*input.shape[:-1], input.shape[-1] // 2, dtype=input.dtype, device=input.device)
    _silu_and_mul(out, input)
    return out


def apply_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """flashinfer.rope.apply_rope_with_cos_sin_cache_inplace: query [T, Hq * D] and key [T, Hkv * D]
    rotated in place at `positions` by cos_sin_cache [P, D] float32 (cos of the D/2 angles, then sin)."""
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")
    if not is_neox:
        raise NotImplementedError("the stand-in rotates the rotate-half (neox) layout only")
    if cos_sin_cache.shape[-1] != head_size:
        raise ValueError("the stand-in rotates whole heads: rotary dim == head size")
    _rope(
        positions,
        query.view(query.shape[0], -1, head_size),
        key.view(key.shape[0], -1, head_size),
        cos_sin_cache,
    )


LIBRARY = SimpleNamespace(
    norm=SimpleNamespace(rmsnorm=rmsnorm, fused_add_rmsnorm=fused_add_rmsnorm),
    activation=SimpleNamespace(silu_and_mul=silu_and_mul),
    rope=SimpleNamespace(apply_rope_with_cos_sin_cache_inplace=apply_rope_with_cos_sin_cache_inplace),
)
