"""The native forward for the Llama family: our packed rows, our attention backends, fused
projections. transformers stays for configs, tokenizers, chat templates and weight loading."""

from batchserve.model.llama import SUPPORTED_ARCHITECTURES, NativeLlamaForCausalLM, native_from_hf, supports

__all__ = ["SUPPORTED_ARCHITECTURES", "NativeLlamaForCausalLM", "choose_impl", "native_from_hf", "supports"]


def choose_impl(model: object, impl: str) -> object:
    """The model the runner drives: `native` (raises ValueError where it is not supported),
    `transformers` (the model as loaded), or `auto`, which for now keeps transformers: the
    native forward becomes the default once its kernels are batch-invariant and measured
    faster on CPU (issue: the forward as the engine's own)."""
    if impl == "native":
        return native_from_hf(model)
    return model
