"""The native forward for the Llama family: our packed rows, our attention backends, fused
projections. transformers stays for configs, tokenizers, chat templates and weight loading."""

import logging
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from batchserve import kernels
from batchserve.model.bf16 import KernelBf16Linear, kernel_bf16_variance, our_bf16_here
from batchserve.model.family import SINK_ARCHITECTURES
from batchserve.model.layers import (
    Bf16Linear,
    PackedLinear,
    bf16_prepack_available,
    packed_products_invariant,
    prepack_available,
)
from batchserve.model.llama import (
    SUPPORTED_ARCHITECTURES,
    NativeLlamaForCausalLM,
    native_from_hf,
    product_out_dtype,
    supports,
)
from batchserve.model.moe import Routing

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Bf16Linear",
    "KernelBf16Linear",
    "NativeLlamaForCausalLM",
    "WeightsChoice",
    "bf16_fast_here",
    "bf16_layer_class",
    "bf16_products_here",
    "choose_cpu_weights",
    "choose_impl",
    "cpu_weights_choice",
    "has_invariant_linears",
    "native_from_hf",
    "our_blocks_here",
    "pack_linears",
    "supports",
    "uses_our_kernels",
]

logger = logging.getLogger("batchserve")

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
    transformers elsewhere and for a mixture of experts off the CPU but gpt-oss (whose sinks need
    our forward; logged either way). On CPU the native model's linear layers are `PackedLinear`
    (batch-invariant) unless `cpu_linear` is `torch` (torch's own kernels); with
    `cpu_weights=bfloat16` every product is a `KernelBf16Linear` (our kernel), or where ours
    cannot be built oneDNN's `Bf16Linear`, the token embedding read row by row from the GGUF file
    the model came from; with `gguf` the model is the same file read from its own blocks
    (`gguf_native`: what the engine serves; the bench shares one transformers-loaded model among
    its engines); `auto` takes what `cpu_weights_choice` says. The native model's `cpu_weights`
    names what was chosen.
    A native model handed in (one engine's, reused by another: the bench and `tune` build many
    engines on one model) is returned as it is."""
    if getattr(model, "native", False):
        held = getattr(model, "cpu_weights", "float32")
        # Off the CPU ("-") cpu_weights means what it means for a model built there: auto and
        # float32 keep the model's dtype; gguf and bfloat16 are CPU weights.
        compatible = ("auto", held) if held != "-" else ("auto", "float32")
        if impl == "transformers" or cpu_weights not in compatible:
            raise ValueError(f"this native {model.cpu_weights} model cannot run as {impl}/{cpu_weights}")
        return model
    device = next(model.parameters()).device.type
    on_cpu = device == "cpu"
    unsupported = supports(model.config)
    if cpu_weights == "gguf":
        return _read_from_blocks(model, on_cpu, impl, cpu_linear)
    if cpu_weights == "bfloat16":
        _check_bf16(on_cpu, impl, unsupported, cpu_linear, next(model.parameters()).dtype)
    if impl == "auto" and not on_cpu and unsupported is None and Routing.of(model.config) is not None:
        if model.config.model_type not in SINK_ARCHITECTURES:
            logger.info(
                "%s: mixture-of-experts layers on %s run on transformers' modules (no MoE kernels of ours off"
                " the CPU yet)", model.config.model_type, device,
            )  # fmt: skip
            return model
        # transformers' attention modules would drop the sinks (refused): our forward computes them
        logger.info(
            "%s: its sinks need our forward on %s; its experts run there one by one on torch's products",
            model.config.model_type, device,
        )  # fmt: skip
    if impl == "native" or (impl == "auto" and device in NATIVE_DEVICES and unsupported is None):
        native = native_from_hf(model)
        weights, native.cpu_weights_reason = _weights_for(cpu_weights, on_cpu, path, loaded_from_path)
        native.cpu_weights = weights if on_cpu else "-"
        if weights == "bfloat16":
            pack_linears(native, KernelBf16Linear if our_bf16_here() else Bf16Linear)
            _file_embedding(native, getattr(model, "gguf_source", None))
        elif on_cpu and cpu_linear != "torch" and prepack_available():
            pack_linears(native, PackedLinear)
        return native
    return model


def _read_from_blocks(model: Any, on_cpu: bool, impl: str, cpu_linear: str) -> Any:
    """cpu_weights=gguf over a model transformers loaded: the GGUF file it came from, read again
    straight from its blocks (raises ValueError where it cannot be, saying why)."""
    from batchserve.model.gguf_native import load_gguf_native

    source = getattr(model, "gguf_source", None)
    if not on_cpu or impl == "transformers" or cpu_linear == "torch" or source is None:
        raise ValueError(
            "cpu_weights=gguf reads a GGUF file's own blocks, for the native forward on CPU with our kernels:"
            f" this model ({'from ' + source if source else 'not loaded from a GGUF file'}) runs {impl} on"
            f" {'cpu' if on_cpu else 'a device'} with cpu_linear={cpu_linear}"
        )
    return load_gguf_native(Path(source))[0]


def our_blocks_here() -> bool:
    """Whether our block kernels (`BlockLinear`: every GGUF type we read) build and run
    batch-invariantly here."""
    from batchserve.model.blocks import block_products_invariant

    return kernels.available() and block_products_invariant()


class WeightsChoice(NamedTuple):
    weights: str  # gguf, float32 or bfloat16
    why: str  # for the start-up log and GetModelInfo


def _weights_for(asked: str, on_cpu: bool, path: str | None, loaded_from_path: bool) -> WeightsChoice:
    """The weights `cpu_weights=asked` means for a model transformers loaded, and why."""
    if asked != "auto":
        return WeightsChoice(asked, f"cpu_weights={asked} was asked for")
    if not loaded_from_path:  # a model handed in keeps the weights it came with: only the engine knows its file
        return WeightsChoice("float32", "a model handed in keeps its float32 weights (only a file has others)")
    return cpu_weights_choice(on_cpu, path, direct=False)


def choose_cpu_weights(on_cpu: bool, gguf_path: str | None) -> str:
    """What `cpu_weights=auto` takes (`cpu_weights_choice`, without the reason)."""
    return cpu_weights_choice(on_cpu, gguf_path).weights


def cpu_weights_choice(on_cpu: bool, gguf_path: str | None, direct: bool = True) -> WeightsChoice:
    """What `cpu_weights=auto` takes for a native model the engine loads itself from `gguf_path`
    (None: the default model), and why, whatever the server's seat count:
    - `gguf`: a GGUF file read straight from its blocks, each tensor at its own type, wherever our
      block kernels run invariantly (`direct`: the engine reads the file itself; a model
      transformers loaded, where the file could not be read so, takes the choices below): they
      read each weight block once per step, and beat bfloat16 and float32 at 1 to 64 rows on
      AVX2-only and AVX-512 CPUs alike (benchmarks/README.md);
    - else `bfloat16` where bfloat16 products run invariantly and fast (`bf16_fast_here`);
    - else `float32`."""
    if not on_cpu:
        return WeightsChoice("float32", "not on the CPU: the model keeps its dtype")
    gguf = _is_gguf(gguf_path)
    if direct and gguf and our_blocks_here():
        return WeightsChoice("gguf", "the file's own blocks, each tensor at its own type, on our kernels")
    if not gguf:
        why = "a model directory has no blocks to read"
    elif not direct:
        why = "the file was loaded through transformers, not from its blocks"
    else:
        why = f"our block kernels do not run here ({kernels.unavailable_reason() or 'not batch-invariant'})"
    if bf16_fast_here():
        kernel = "our kernel" if bf16_layer_class() is KernelBf16Linear else "oneDNN's"
        return WeightsChoice("bfloat16", f"bfloat16 products run invariantly and fast here ({kernel}); {why}")
    return WeightsChoice("float32", f"no invariant bfloat16 products faster than float32 here; {why}")


def _is_gguf(path: str | None) -> bool:
    from batchserve.model.loader import resolve_model_path

    try:
        return resolve_model_path(path)[1] is not None
    except (OSError, ValueError):
        return False


def bf16_layer_class() -> type[KernelBf16Linear] | type[Bf16Linear] | None:
    """The layer bfloat16 products run invariantly on here: ours (`KernelBf16Linear`, invariant by
    construction) wherever our kernels build, else oneDNN's prepacked `Bf16Linear` where this CPU
    has it and its check passes (AMX tiles rows: it fails there); None where neither."""
    if our_bf16_here():
        return KernelBf16Linear
    if bf16_prepack_available() and packed_products_invariant(Bf16Linear):
        return Bf16Linear
    return None


def bf16_products_here() -> bool:
    """Whether bfloat16 products run batch-invariantly here (`bf16_layer_class`)."""
    return bf16_layer_class() is not None


def bf16_fast_here() -> bool:
    """Whether bfloat16 products run invariantly here and clearly beat float32's, for `auto` to
    take them: oneDNN's (AVX-512), or ours compiled for AVX-512 (16 columns a group: AVX512-BF16's
    dot products, or widening to float32 FMAs on AVX-512F), 1.1x to 2.9x oneDNN's float32 at 1 to
    64 rows. Ours on AVX2 runs (`cpu_weights=bfloat16` takes it), but was measured only with
    oneDNN held to AVX2 on an AVX-512 CPU: 1.8x float32 at 1-2 rows, even from 4 rows on; on
    Intel's AVX2 cores its widening shares the FMA ports, so `auto` keeps float32 there."""
    layer = bf16_layer_class()
    return layer is Bf16Linear or (layer is KernelBf16Linear and kernels.bf16_columns() == 16)


def _check_bf16(on_cpu: bool, impl: str, unsupported: str | None, cpu_linear: str, dtype: torch.dtype) -> None:
    if not on_cpu or impl == "transformers" or unsupported is not None or dtype != torch.float32:
        raise ValueError("cpu_weights=bfloat16 needs the native model on CPU, loaded in float32")
    if cpu_linear == "torch" or not (our_bf16_here() or bf16_prepack_available()):
        ours = kernel_bf16_variance() or "not asked for: cpu_linear=torch"
        raise ValueError(
            f"cpu_weights=bfloat16 needs our bfloat16 kernel ({ours}) or oneDNN's prepacked bfloat16 products"
            " (avx512 or avx_ne_convert)"
        )


@torch.no_grad()
def _file_embedding(native: nn.Module, source: str | None) -> None:
    """The token embedding read row by row from the GGUF file the model came from (`GGUFEmbedding`:
    the file's blocks, not a float32 copy), where every row equals what transformers loaded."""
    if source is None:
        return
    from batchserve.model.gguf_file import GGUFTensors
    from batchserve.model.gguf_native import GGUFEmbedding

    view = GGUFTensors(Path(source)).get("token_embd.weight")
    if view is None:
        return
    embedding, weight = GGUFEmbedding(view), native.embed_tokens.weight  # type: ignore[union-attr]
    chunks = torch.arange(weight.shape[0]).split(4096)  # compared a bounded copy at a time
    same = (embedding.num_embeddings, embedding.embedding_dim) == tuple(weight.shape) and all(
        torch.equal(embedding(ids), weight[ids].float()) for ids in chunks
    )
    if not same:  # transformers changed the values on loading: keep its copy, the rest of the model is its too
        logger.warning("%s's token embedding differs from transformers' load of it: kept as loaded", source)
        return
    native.embed_tokens = embedding


def pack_linears(model: nn.Module, layer_class: type[PackedLinear] | type[KernelBf16Linear] = PackedLinear) -> bool:
    """Swap every `nn.Linear` of `model` for a `layer_class` (`PackedLinear`: the same weights;
    `Bf16Linear`, `KernelBf16Linear`: bfloat16 copies) in place. False (and nothing swapped)
    where the layer cannot be built here (oneDNN's bfloat16 without avx512 or avx_ne_convert, ours
    without our kernels)."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        if issubclass(layer_class, (Bf16Linear, KernelBf16Linear)):
            packed = {name: layer_class(m, product_out_dtype(name)) for name, m in linears}
        else:
            packed = {name: layer_class(m) for name, m in linears}
    except RuntimeError:
        return False
    for name, layer in packed.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    # Every product of the model is a packed layer's: batch-invariant where this CPU's oneDNN is
    # (ours: where its check passes, as it must). The activations between products must be float32
    # (the only dtype the invariant attention is checked in): a float32 model, whose bfloat16
    # products enter bfloat16 and leave float32 (o_proj and down_proj leave bfloat16 for the
    # residual add alone, which widens it exactly).
    dtype = next(model.parameters()).dtype
    ours_bf16 = issubclass(layer_class, KernelBf16Linear)
    model.batch_invariant_linears = dtype == torch.float32 and (
        our_bf16_here() if ours_bf16 else packed_products_invariant(layer_class)
    )
    return True


def uses_our_kernels(model: Any) -> bool:
    """Whether the model's products run on our kernels (`BlockLinear`, `KernelBf16Linear`): its
    costs, and so its cost profile, differ from oneDNN's or torch's over the same weights."""
    return any(isinstance(m, KernelBf16Linear) or type(m).__name__ == "BlockLinear" for m in model.modules())


def has_invariant_linears(model: Any) -> bool:
    return bool(getattr(model, "batch_invariant_linears", False)) and torch.backends.mkldnn.is_available()
