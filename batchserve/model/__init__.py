"""The native forward for the Llama family: our packed rows, our attention backends, fused
projections. transformers stays for configs, tokenizers, chat templates and weight loading."""

from typing import Any, NamedTuple

import torch
from torch import nn

from batchserve import kernels
from batchserve.model.bf16 import KernelBf16Linear, kernel_bf16_variance, our_bf16_here
from batchserve.model.fused import KernelDecoderLayers, why_not_fused
from batchserve.model.int4 import (
    Int4Linear,
    gguf_has_q4_1,
    int4_available,
    int4_fast_here,
    int4_products_invariant,
    load_gguf_embedding,
    load_gguf_head,
    load_gguf_int4,
)
from batchserve.model.layers import (
    Bf16Linear,
    PackedLinear,
    bf16_prepack_available,
    packed_products_invariant,
    prepack_available,
    use_kernel_layers,
)
from batchserve.model.llama import (
    SUPPORTED_ARCHITECTURES,
    NativeLlamaForCausalLM,
    native_from_hf,
    product_out_dtype,
    supports,
)
from batchserve.model.quant import Q4Linear, Q8Linear, quant_products_invariant

__all__ = [
    "Q4_1_MAX_SEATS",
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
    "our_q4_here",
    "pack_linears",
    "supports",
    "uses_our_kernels",
]


NATIVE_DEVICES = ("cpu", "cuda")  # where `auto` takes the native forward (tested on both)


def choose_impl(
    model: Any,
    impl: str,
    cpu_linear: str = "auto",
    cpu_weights: str = "auto",
    path: str | None = None,
    loaded_from_path: bool = False,
    max_num_seqs: int | None = None,
) -> Any:
    """The model the runner drives: `native` (raises ValueError where it is not supported),
    `transformers` (the model as loaded), or `auto`: native for the supported architectures on
    CPU and CUDA (its GPU tests passed on an H100: benchmarks/results/gpu-h100-native),
    transformers elsewhere. On CPU the native model's linear layers are `PackedLinear`
    (batch-invariant) unless `cpu_linear` is `torch` (torch's own kernels: its int4 one for
    `q4_1`); with `cpu_weights=bfloat16` every product is a `KernelBf16Linear` (our kernel),
    or where ours cannot be built oneDNN's `Bf16Linear`; with `q4_1` the layers' products are the
    GGUF file at `path`'s own Q4_1 blocks on our kernel (`Q4Linear`, the head a `Q8Linear` over
    the file's Q8_0 blocks), or where it cannot run on torch's int4 kernel (`Int4Linear`, the head
    in bfloat16 where that runs invariantly and fast: `bf16_fast_here`); `auto`
    takes what `choose_cpu_weights` says for a server of `max_num_seqs` seats. The native model's
    `cpu_weights` names what was chosen.
    A native model handed in (one engine's, reused by another: the bench and `tune` build many
    engines on one model) is returned as it is."""
    if getattr(model, "native", False):
        held = getattr(model, "cpu_weights", "float32")
        # Off the CPU ("-") cpu_weights means what it means for a model built there: auto and
        # float32 keep the model's dtype; q4_1 and bfloat16 are CPU weights.
        compatible = ("auto", held) if held != "-" else ("auto", "float32")
        if impl == "transformers" or cpu_weights not in compatible:
            raise ValueError(f"this native {model.cpu_weights} model cannot run as {impl}/{cpu_weights}")
        return model
    device = next(model.parameters()).device.type
    on_cpu = device == "cpu"
    unsupported = supports(model.config)
    if cpu_weights == "q4_1":
        _check_q4_1(on_cpu, impl, unsupported)
    if cpu_weights == "bfloat16":
        _check_bf16(on_cpu, impl, unsupported, cpu_linear, next(model.parameters()).dtype)
    if impl == "native" or (impl == "auto" and device in NATIVE_DEVICES and unsupported is None):
        native = native_from_hf(model)
        weights = cpu_weights
        weights, native.cpu_weights_reason = _weights_for(weights, on_cpu, path, max_num_seqs, loaded_from_path)
        if weights == "q4_1":
            _load_q4_1(native, path, ours=cpu_linear != "torch" and our_q4_here())
        native.cpu_weights = weights if on_cpu else "-"
        if weights == "bfloat16":
            pack_linears(native, KernelBf16Linear if our_bf16_here() else Bf16Linear)
            if loaded_from_path:
                _load_q8_embedding(native, path)
        elif on_cpu and cpu_linear != "torch" and prepack_available():
            # Beside Q4_1 layers, the LM head (and any product the file does not store as Q4_1)
            # in bfloat16 where it runs invariantly: half float32's bytes, 2x its speed.
            bf16 = bf16_layer_class() if weights == "q4_1" and bf16_fast_here() else None
            pack_linears(native, bf16 or PackedLinear)
        if weights == "q4_1" and why_not_fused(native.layers) is None:  # last: it holds the weights' addresses
            native.fused_layers = KernelDecoderLayers(native.layers)
        return native
    return model


# The most seats a server of a Q4_1 file may have for `auto` to keep Q4_1 on torch's int4 kernel
# where bfloat16 products run: its cost grows by 4-row blocks, so past 2 seats bfloat16 wins.
Q4_1_MAX_SEATS = 2


def our_q4_here() -> bool:
    """Whether our kernels (`Q4Linear`, `Q8Linear`) build and run batch-invariantly here."""
    return kernels.available() and quant_products_invariant()


class WeightsChoice(NamedTuple):
    weights: str  # float32, bfloat16 or q4_1
    why: str  # for the start-up log and GetModelInfo


def _weights_for(
    asked: str, on_cpu: bool, path: str | None, max_num_seqs: int | None, loaded_from_path: bool
) -> WeightsChoice:
    """The weights `cpu_weights=asked` means here, and why."""
    if asked != "auto":
        return WeightsChoice(asked, f"cpu_weights={asked} was asked for")
    if not loaded_from_path:  # a model handed in keeps the weights it came with: only the engine knows its file
        return WeightsChoice("float32", "a model handed in keeps its float32 weights (only a file has others)")
    return cpu_weights_choice(on_cpu, path, max_num_seqs, direct=False)


def choose_cpu_weights(on_cpu: bool, gguf_path: str | None, max_num_seqs: int | None = None) -> str:
    """What `cpu_weights=auto` takes (`cpu_weights_choice`, without the reason)."""
    return cpu_weights_choice(on_cpu, gguf_path, max_num_seqs).weights


def cpu_weights_choice(
    on_cpu: bool, gguf_path: str | None, max_num_seqs: int | None = None, direct: bool = True
) -> WeightsChoice:
    """What `cpu_weights=auto` takes for a native model the engine loaded itself from `gguf_path`
    (None: the default model) to serve `max_num_seqs` requests at once (None: unknown), and why.
    A GGUF file is read straight from its blocks (`gguf`) wherever our block kernels run
    invariantly (`direct`: the engine reads the file itself; a model transformers loaded from it,
    where the file could not be read so, takes the choices below). Else, for a GGUF whose layers
    are Q4_1:
    - `q4_1` on our kernels wherever they build, at every seat count: they read each weight block
      once per step, and beat bfloat16 and float32 at 1 to 64 rows on AVX2-only and AVX-512 CPUs
      alike (measured on both: benchmarks/README.md);
    - where only torch's int4 kernel runs (vectorized and invariant), `q4_1` up to
      Q4_1_MAX_SEATS seats, or at any count where bfloat16 products do not run: its cost grows by
      4-row blocks, so past 2 seats bfloat16 wins where it runs fast.
    Otherwise `bfloat16` where it runs invariantly and fast (`bf16_fast_here`), else `float32`."""
    if not on_cpu:
        return WeightsChoice("float32", "not on the CPU: the model keeps its dtype")
    if direct and _is_gguf(gguf_path) and our_blocks_here():
        return WeightsChoice("gguf", "the file's own blocks, each tensor at its own type, on our kernels")
    q4_file = _is_q4_1_gguf(gguf_path)
    bf16 = bf16_fast_here()
    if q4_file and our_q4_here():
        return WeightsChoice(
            "q4_1", "the file's Q4_1 blocks on our kernels: the fastest format at every seat count on AVX2 and AVX-512"
        )
    few_seats = max_num_seqs is not None and max_num_seqs <= Q4_1_MAX_SEATS
    if q4_file and int4_fast_here() and (few_seats or not bf16):
        why = f"{max_num_seqs} seats" if few_seats else "no bfloat16 products here"
        not_ours = kernels.unavailable_reason() or "not batch-invariant"
        return WeightsChoice("q4_1", f"our kernels do not run here ({not_ours}): torch's int4, {why}")
    if bf16:
        if not q4_file:
            why = "the file has no Q4_1 layers"
        elif not int4_fast_here():
            why = "no fast Q4_1 kernel here"
        else:
            why = f"torch's int4 kernel loses to them past {Q4_1_MAX_SEATS} seats"
        kernel = "our kernel" if bf16_layer_class() is KernelBf16Linear else "oneDNN's"
        return WeightsChoice("bfloat16", f"bfloat16 products run invariantly and fast here ({kernel}); {why}")
    return WeightsChoice("float32", "no Q4_1 kernel and no invariant bfloat16 products faster than float32 here")


def our_blocks_here() -> bool:
    """Whether our block kernels (`BlockLinear`: every GGUF type we read) build and run
    batch-invariantly here."""
    from batchserve.model.blocks import block_products_invariant

    return kernels.available() and block_products_invariant()


def _is_gguf(path: str | None) -> bool:
    from batchserve.model.loader import resolve_model_path

    try:
        return resolve_model_path(path)[1] is not None
    except (OSError, ValueError):
        return False


def _is_q4_1_gguf(gguf_path: str | None) -> bool:
    from batchserve.model.loader import resolve_model_path

    try:
        directory, gguf_file = resolve_model_path(gguf_path)
    except (OSError, ValueError):
        return False
    return gguf_file is not None and gguf_has_q4_1(directory / gguf_file)


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


def _load_q8_embedding(native: nn.Module, path: str | None) -> None:
    """The token embedding on the GGUF file's own Q8_0 blocks where the model came from such a file
    (exact: the values transformers loaded), a quarter of float32's bytes."""
    from batchserve.model.loader import resolve_model_path

    directory, gguf_file = resolve_model_path(path)
    if gguf_file is not None:
        load_gguf_embedding(native, directory / gguf_file)


def _check_q4_1(on_cpu: bool, impl: str, unsupported: str | None) -> None:
    if not on_cpu or impl == "transformers" or unsupported is not None:
        raise ValueError("cpu_weights=q4_1 needs the native model on CPU")
    if not int4_available() and not our_q4_here():
        reason = kernels.unavailable_reason() or "they are not batch-invariant here"
        raise ValueError(f"cpu_weights=q4_1 needs our kernels ({reason}) or torch's int4 kernel")


def _load_q4_1(native: nn.Module, path: str | None, ours: bool) -> None:
    """The file's Q4_1 layers on our kernel (and its Q8_0 head, where it stores one, tied or
    not), else (`cpu_linear=torch`, or ours cannot run) on torch's int4 kernel; the Q8_0 token
    embedding either way."""
    from batchserve.model.loader import resolve_model_path

    directory, gguf_file = resolve_model_path(path)
    if gguf_file is None:
        raise ValueError("cpu_weights=q4_1 reads a GGUF model file; this model is a directory")
    if load_gguf_int4(native, directory / gguf_file, Q4Linear if ours else Int4Linear) == 0:
        raise ValueError(f"{gguf_file} has no Q4_1 layers")
    embedding = load_gguf_embedding(native, directory / gguf_file)  # its Q8_0 blocks, where the file has them
    if ours:
        load_gguf_head(native, directory / gguf_file, embedding)
        use_kernel_layers(native)  # norms and silu*up in one call each: beside our products only


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
    int4 = any(isinstance(m, Int4Linear) for m in model.modules())
    ours = any(isinstance(m, (Q4Linear, Q8Linear)) for m in model.modules())
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
    model.batch_invariant_linears = (
        dtype == torch.float32
        and (our_bf16_here() if ours_bf16 else packed_products_invariant(layer_class))
        and (not int4 or int4_products_invariant())
        and (not ours or quant_products_invariant())
    )
    return True


def uses_our_kernels(model: Any) -> bool:
    """Whether the model's products run on our kernels (`BlockLinear`, `Q4Linear`, `Q8Linear`,
    `KernelBf16Linear`): its costs, and so its cost profile, differ from the same weights on
    torch's int4 kernel or oneDNN's."""
    ours = (Q4Linear, Q8Linear, KernelBf16Linear)
    return any(isinstance(m, ours) or type(m).__name__ == "BlockLinear" for m in model.modules())


def has_invariant_linears(model: Any) -> bool:
    return bool(getattr(model, "batch_invariant_linears", False)) and torch.backends.mkldnn.is_available()
