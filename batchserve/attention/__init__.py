"""Attention backends over the paged KV pool, and the choice between them."""

from __future__ import annotations

import importlib.util

import torch

from batchserve.attention.base import AttentionBackend, SeqLayout, StepLayout, slots_of
from batchserve.attention.torch_ref import TorchReferenceBackend
from batchserve.config import ATTENTION_BACKENDS

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "SeqLayout",
    "StepLayout",
    "TorchReferenceBackend",
    "make_backend",
    "resolve_backend",
    "slots_of",
]


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto`: FlashInfer on CUDA in float16/bfloat16 when the package is installed, the
    torch reference otherwise. Forcing FlashInfer where it cannot run is an error."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    usable = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    installed = importlib.util.find_spec("flashinfer") is not None
    if name == "auto":
        return "flashinfer" if usable and installed else "torch"
    if name == "flashinfer" and not usable:
        raise ValueError(f"the flashinfer attention backend needs CUDA and float16/bfloat16, got {device} {dtype}")
    if name == "flashinfer" and not installed:
        raise ValueError("the flashinfer attention backend needs `flashinfer-python` (pip install 'batchserve[gpu]')")
    return name


def make_backend(
    name: str,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    sm_scale: float | None = None,
) -> AttentionBackend:
    if resolve_backend(name, device, dtype) == "flashinfer":
        from batchserve.attention.flashinfer_backend import FlashInferBackend  # imports flashinfer

        return FlashInferBackend(
            num_layers, num_blocks, block_size, num_qo_heads, num_kv_heads, head_dim, dtype, device, sm_scale
        )
    return TorchReferenceBackend(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
