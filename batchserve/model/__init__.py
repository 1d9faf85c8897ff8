"""The native forward for the Llama family: our packed rows, our attention backends, fused
projections. transformers stays for configs, tokenizers, chat templates and weight loading."""

from typing import Any

import torch
from torch import nn

from batchserve.model.layers import PackedLinear, packed_products_invariant, prepack_available
from batchserve.model.llama import SUPPORTED_ARCHITECTURES, NativeLlamaForCausalLM, native_from_hf, supports

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "NativeLlamaForCausalLM",
    "choose_impl",
    "has_invariant_linears",
    "native_from_hf",
    "pack_linears",
    "supports",
]


def choose_impl(model: Any, impl: str, cpu_linear: str = "auto") -> Any:
    """The model the runner drives: `native` (raises ValueError where it is not supported),
    `transformers` (the model as loaded), or `auto`: native for the supported architectures on
    CPU, transformers elsewhere. On CUDA, auto keeps transformers until the native forward's
    GPU tests (CUDA graphs) have passed on a device. On CPU the native model's linear layers
    are `PackedLinear` (batch-invariant) unless `cpu_linear` is `torch`."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    if impl == "native" or (impl == "auto" and on_cpu and supports(model.config) is None):
        native = native_from_hf(model)
        if on_cpu and cpu_linear != "torch" and prepack_available():
            pack_linears(native)
        return native
    return model


def pack_linears(model: nn.Module) -> bool:
    """Swap every `nn.Linear` of `model` for a `PackedLinear` of the same weights, in place.
    False (and nothing swapped) where oneDNN cannot reorder the model's dtype on this CPU
    (bfloat16 without avx512 or avx_ne_convert)."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        packed = {name: PackedLinear(m) for name, m in linears}
    except RuntimeError:
        return False
    for name, layer in packed.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    # Every product of the model is a PackedLinear's: batch-invariant where this CPU's oneDNN is
    # (checked in float32, the only dtype the invariant attention is checked in).
    dtype = next(iter(packed.values())).weight.dtype if packed else torch.float32
    model.batch_invariant_linears = dtype == torch.float32 and packed_products_invariant()
    return True


def has_invariant_linears(model: Any) -> bool:
    return bool(getattr(model, "batch_invariant_linears", False)) and torch.backends.mkldnn.is_available()
