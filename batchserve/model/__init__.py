"""The native forward for the Llama family: our packed rows, our attention backends, fused
projections. transformers stays for configs, tokenizers, chat templates and weight loading."""

from typing import Any

import torch
from torch import nn

from batchserve.model.int4 import (
    Int4Linear,
    gguf_has_q4_1,
    int4_available,
    int4_fast_here,
    int4_products_invariant,
    load_gguf_embedding,
    load_gguf_int4,
)
from batchserve.model.layers import PackedLinear, packed_products_invariant, prepack_available
from batchserve.model.llama import SUPPORTED_ARCHITECTURES, NativeLlamaForCausalLM, native_from_hf, supports

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "NativeLlamaForCausalLM",
    "choose_cpu_weights",
    "choose_impl",
    "has_invariant_linears",
    "native_from_hf",
    "pack_linears",
    "supports",
]


NATIVE_DEVICES = ("cpu", "cuda")  # where `auto` takes the native forward (tested on both)


def choose_impl(
    model: Any,
    impl: str,
    cpu_linear: str = "auto",
    cpu_weights: str = "auto",
    path: str | None = None,
    loaded_from_path: bool = False,
) -> Any:
    """The model the runner drives: `native` (raises ValueError where it is not supported),
    `transformers` (the model as loaded), or `auto`: native for the supported architectures on
    CPU and CUDA (its GPU tests passed on an H100: benchmarks/results/gpu-h100-native),
    transformers elsewhere. On CPU the native model's linear layers
    are `PackedLinear` (batch-invariant) unless `cpu_linear` is `torch`; with `cpu_weights=q4_1`
    the layers' products are the GGUF file at `path`'s own Q4_1 blocks (`Int4Linear`), and
    `auto` takes them where `choose_cpu_weights` says. The native model's `cpu_weights` names
    what was chosen. A native model handed in (one engine's, reused by another: the bench and
    `tune` build many engines on one model) is returned as it is."""
    if getattr(model, "native", False):
        held = getattr(model, "cpu_weights", "float32")
        # Off the CPU ("-") the weights are the model's own dtype: only q4_1 asks for something else.
        compatible = ("auto", held) if held != "-" else ("auto", "float32")
        if impl == "transformers" or cpu_weights not in compatible:
            raise ValueError(f"this native {model.cpu_weights} model cannot run as {impl}/{cpu_weights}")
        return model
    device = next(model.parameters()).device.type
    on_cpu = device == "cpu"
    unsupported = supports(model.config)
    if cpu_weights == "q4_1":
        _check_q4_1(on_cpu, impl, unsupported)
    if impl == "native" or (impl == "auto" and device in NATIVE_DEVICES and unsupported is None):
        native = native_from_hf(model)
        weights = cpu_weights
        if weights == "auto":
            # A model handed in keeps the weights it came with: only the engine knows its file.
            weights = choose_cpu_weights(on_cpu, path) if loaded_from_path else "float32"
        if weights == "q4_1":
            _load_q4_1(native, path)
        native.cpu_weights = weights if on_cpu else "-"
        if on_cpu and cpu_linear != "torch" and prepack_available():
            pack_linears(native)
        return native
    return model


def choose_cpu_weights(on_cpu: bool, gguf_path: str | None) -> str:
    """What `cpu_weights=auto` takes for a native model: `q4_1` where its file is a GGUF whose
    layers are Q4_1 (`gguf_path`: None for the default model) and
    this CPU runs torch's int4 kernel vectorized and batch-invariantly; else `float32`. On the
    CPUs measured the Q4_1 step is faster at every batch size (docs/design.md)."""
    if not on_cpu or not int4_fast_here():
        return "float32"
    from batchserve.runner.model_loader import resolve_model_path

    try:
        directory, gguf_file = resolve_model_path(gguf_path)
    except (OSError, ValueError):
        return "float32"
    return "q4_1" if gguf_file is not None and gguf_has_q4_1(directory / gguf_file) else "float32"


def _check_q4_1(on_cpu: bool, impl: str, unsupported: str | None) -> None:
    if not on_cpu or impl == "transformers" or unsupported is not None or not int4_available():
        raise ValueError("cpu_weights=q4_1 needs the native model on CPU and torch's int4 kernel")


def _load_q4_1(native: nn.Module, path: str | None) -> None:
    from batchserve.runner.model_loader import resolve_model_path

    directory, gguf_file = resolve_model_path(path)
    if gguf_file is None:
        raise ValueError("cpu_weights=q4_1 reads a GGUF model file; this model is a directory")
    if load_gguf_int4(native, directory / gguf_file) == 0:
        raise ValueError(f"{gguf_file} has no Q4_1 layers")
    load_gguf_embedding(native, directory / gguf_file)  # its Q8_0 blocks, where the file has them


def pack_linears(model: nn.Module) -> bool:
    """Swap every `nn.Linear` of `model` for a `PackedLinear` of the same weights, in place.
    False (and nothing swapped) where oneDNN cannot reorder the model's dtype on this CPU
    (bfloat16 without avx512 or avx_ne_convert)."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        packed = {name: PackedLinear(m) for name, m in linears}
    except RuntimeError:
        return False
    int4 = any(isinstance(m, Int4Linear) for m in model.modules())
    for name, layer in packed.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    # Every product of the model is a PackedLinear's: batch-invariant where this CPU's oneDNN is
    # (checked in float32, the only dtype the invariant attention is checked in).
    dtype = next(iter(packed.values())).weight.dtype if packed else torch.float32
    model.batch_invariant_linears = (
        dtype == torch.float32 and packed_products_invariant() and (not int4 or int4_products_invariant())
    )
    return True


def has_invariant_linears(model: Any) -> bool:
    return bool(getattr(model, "batch_invariant_linears", False)) and torch.backends.mkldnn.is_available()
