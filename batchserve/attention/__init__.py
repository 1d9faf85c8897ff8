"""Attention backends over the paged KV pool, and the choice between them."""

from __future__ import annotations

import importlib.util

import torch

from batchserve import kernels
from batchserve.attention.base import AttentionBackend, LayerAttention, SeqLayout, StepLayout, fa2_head_dim, slots_of
from batchserve.attention.invariant import InvariantBackend
from batchserve.attention.invariant_check import checked_backend, kernels_invariant
from batchserve.attention.kernel import KernelBackend, kernel_backend_runs
from batchserve.attention.torch_ref import TorchReferenceBackend
from batchserve.config import ATTENTION_BACKENDS

# The CPU backends that compute a row's output batch-invariantly (checked on the model at start-up).
INVARIANT_BACKENDS = ("kernel", "invariant")

__all__ = [
    "ATTENTION_BACKENDS",
    "INVARIANT_BACKENDS",
    "AttentionBackend",
    "InvariantBackend",
    "KernelBackend",
    "LayerAttention",
    "SeqLayout",
    "StepLayout",
    "TorchReferenceBackend",
    "backend_choice",
    "backend_class",
    "kernels_invariant",
    "make_backend",
    "resolve_backend",
    "slots_of",
]


def resolve_backend(
    name: str, device: torch.device, dtype: torch.dtype, invariant_model: bool = False, head_dim: int = 64
) -> str:
    """The backend the `attention_backend` setting `name` takes here (`backend_choice`, without why)."""
    return backend_choice(name, device, dtype, invariant_model, head_dim)[0]


def backend_choice(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    invariant_model: bool = False,
    head_dim: int = 64,
    sinks: bool = False,
) -> tuple[str, str]:
    """The backend for the setting `name`, and why. `auto`: FlashInfer on CUDA in float16/bfloat16
    when the package is installed and its kernels take the head dim (64 or more); on CPU, for a
    model whose products are batch-invariant too (the native model's packed and quantized
    layers), our kernel (`kernel`: invariant by construction) where it builds and runs the
    model (float32, a head dim divisible by 8), else the torch-op batch-invariant backend (the
    fallback where ours cannot be built) where this CPU's kernels pass `kernels_invariant` (at the
    model's `head_dim`); the torch reference otherwise, and on CUDA for a model with attention
    `sinks` until the GPU check has compared FlashInfer's (added from its log-sum-exp,
    `flashinfer_backend.add_sinks`) with the reference's on a device: `flashinfer` forced runs them.
    Forcing a backend where it cannot run is an error."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    usable = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and fa2_head_dim(head_dim)
    installed = importlib.util.find_spec("flashinfer") is not None
    if name == "auto":
        if usable and installed and not sinks:
            return "flashinfer", "auto: CUDA in 16-bit floats with flashinfer installed"
        if device.type != "cpu":
            if not usable:
                return "torch", f"auto: flashinfer cannot run {dtype}"
            if not installed:
                return "torch", "auto: flashinfer is not installed"
            return "torch", "auto: the model's attention sinks (FlashInfer's not yet checked on a device)"
        if not invariant_model:
            return "torch", "auto: the model's products are not batch-invariant, so no attention need be"
        if kernel_backend_runs(device, dtype, head_dim):
            return "kernel", "auto: our kernels build and run here, batch-invariant by construction"
        why = kernels.unavailable_reason() or f"our kernels do not take {dtype} or head dim {head_dim}"
        if kernels_invariant(head_dim):
            return "invariant", f"auto: our kernels do not run ({why}); torch's ops pass the invariance check here"
        return "torch", f"auto: our kernels do not run ({why}) and torch's ops fail the invariance check here"
    if name == "kernel" and not kernel_backend_runs(device, dtype, head_dim):
        raise ValueError(
            f"the kernel attention backend needs our CPU kernels ({kernels.unavailable_reason() or 'built here'}),"
            f" float32 on CPU and a head dim divisible by 8, got {device} {dtype} head dim {head_dim}"
        )
    if name == "invariant" and (device.type != "cpu" or not torch.backends.mkldnn.is_available()):
        raise ValueError(f"the invariant attention backend runs on CPU with oneDNN, got {device}")
    if name == "flashinfer" and not usable:
        raise ValueError(
            "the flashinfer attention backend needs CUDA, float16/bfloat16 and a head dim of 64 or more (a multiple"
            f" of 16), got {device} {dtype} head dim {head_dim}"
        )
    if name == "flashinfer" and not installed:
        raise ValueError("the flashinfer attention backend needs `flashinfer-python` (pip install 'batchserve[gpu]')")
    return name, f"attention_backend={name} was asked for"


def backend_class(name: str) -> type[AttentionBackend]:
    """The class of a resolved backend (FlashInfer's is imported only when named: it imports flashinfer)."""
    if name == "flashinfer":
        from batchserve.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend
    classes: dict[str, type[AttentionBackend]] = {
        "kernel": KernelBackend,
        "invariant": InvariantBackend,
        "torch": TorchReferenceBackend,
    }
    return classes[name]


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
    max_model_len: int = 0,
    layers: tuple[LayerAttention, ...] = (),
) -> AttentionBackend:
    """The backend `name` names, resolved already (`resolve_backend`, which the runner calls once
    with what it knows of the model); `auto` alone is resolved here, as for a model that
    claims no invariant products. `layers`: each layer's sliding window and soft-cap, if any."""
    if name == "auto":
        name = resolve_backend(name, device, dtype, head_dim=head_dim)
    backend: AttentionBackend
    if name == "kernel":  # query heads per KV head come from q's shape each step
        backend = KernelBackend(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    elif name == "invariant":
        backend = checked_backend(
            num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, num_qo_heads=num_qo_heads
        )
    elif name == "flashinfer":
        from batchserve.attention.flashinfer_backend import FlashInferBackend  # imports flashinfer

        backend = FlashInferBackend(
            num_layers,
            num_blocks,
            block_size,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            dtype,
            device,
            sm_scale,
            max_model_len,
        )
    else:
        backend = TorchReferenceBackend(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    if layers:
        if len(layers) != num_layers:
            raise ValueError(f"{len(layers)} layers' attention kinds for {num_layers} layers")
        backend.set_layers(layers)
    return backend
