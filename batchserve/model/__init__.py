"""The native forward for the Llama family: our packed rows, our attention backends, fused
projections. transformers stays for configs, tokenizers, chat templates and weight loading."""

from typing import Any

from batchserve.model.llama import SUPPORTED_ARCHITECTURES, NativeLlamaForCausalLM, native_from_hf, supports

__all__ = ["SUPPORTED_ARCHITECTURES", "NativeLlamaForCausalLM", "choose_impl", "native_from_hf", "supports"]


def choose_impl(model: Any, impl: str) -> Any:
    """The model the runner drives: `native` (raises ValueError where it is not supported),
    `transformers` (the model as loaded), or `auto`: native for the supported architectures on
    CPU, transformers elsewhere. On CUDA, auto keeps transformers until the native forward's
    GPU tests (CUDA graphs) have passed on a device."""
    if impl == "native":
        return native_from_hf(model)
    if impl == "auto" and next(model.parameters()).device.type == "cpu" and supports(model.config) is None:
        return native_from_hf(model)
    return model
