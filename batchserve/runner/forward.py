"""The forward, chosen once: what runs every step, part by part, and why each part was chosen.

`choose_forward` turns the settings (`ModelConfig`: model_impl, cpu_weights, cpu_linear,
attention_backend, cuda_graphs) and the machine (its device, what our kernels and oneDNN run
here, whether flashinfer is installed) into one frozen `ForwardChoice`:

    impl       native (our layers over packed rows) or transformers (the model as loaded)
    weights    gguf (the file's own blocks), float32 or bfloat16 on the CPU; off it ("-") the model
               keeps its dtype
    linear     the kernels the products run on (ours over the file's blocks or bfloat16, oneDNN, torch)
    attention  kernel, invariant, torch or flashinfer
    graphs     on (replayed CUDA graphs), eager (the same bucketed steps uncaptured) or off
    fused      whether every decoder layer runs in one kernel call (CPU), or its norms, silu*up and
               rotary on FlashInfer's fused kernels (`flashinfer`, CUDA: `model.layer_kernels`)

The weights are loaded as chosen (only the file says which formats it holds, and probes of this
CPU say which kernels run invariantly), then the runner is built from the record (`build.py`).
The start-up log prints it in one line; GetModelInfo and /v1/models report it. A fallback (the
start-up self-check finds the invariant attention not invariant on the model) is a new record
with the part changed and the reason said (`ForwardChoice.fallback`), never a silent rebuild.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchserve.attention import AttentionBackend, backend_choice, backend_class
from batchserve.config import EngineConfig
from batchserve.model import NATIVE_DEVICES, choose_impl, has_invariant_linears, supports
from batchserve.model.fused import why_not_fused
from batchserve.runner.cpu_linear import use_onednn_linear

PARTS = ("impl", "weights", "linear", "attention", "graphs", "fused")

# What each kind of product layer runs on, by class name (the `linear` part names the classes).
_PRODUCTS = {
    "BlockLinear": "the file's own blocks, each tensor at its own type, on our kernels",
    "KernelBf16Linear": "bfloat16 copies on our kernel",
    "Bf16Linear": "bfloat16 copies on oneDNN's prepacked kernel",
    "PackedLinear": "float32 on oneDNN's prepacked kernel",
    "KernelRouter": "float32 routers on our kernel",
    "OneDNNLinear": "oneDNN's linear kernel, rows padded to buckets",
    "MergedLinear": "torch's own kernel",
    "Linear": "torch's own kernel",
}


@dataclass(frozen=True, slots=True)
class Part:
    """One part of the forward: what was chosen, and why."""

    choice: str
    why: str


@dataclass(frozen=True, slots=True)
class ForwardChoice:
    """What runs every step (see the module's docstring for each part)."""

    impl: Part
    weights: Part
    linear: Part
    attention: Part
    graphs: Part
    fused: Part

    @property
    def name(self) -> str:
        """What runs a step, short: `native gguf weights on our kernels, kernel attention`."""
        attention = f"{self.attention.choice} attention"
        if self.impl.choice != "native":
            return f"transformers {self.weights.choice}, {attention}"
        kinds = self.linear.choice.split("+")
        ours = " on our kernels" if {"BlockLinear", "KernelBf16Linear"} & set(kinds) else ""
        return f"native {self.weights.choice} weights{ours}, {attention}"

    def parts(self) -> dict[str, Part]:
        return {p: getattr(self, p) for p in PARTS}

    def line(self) -> str:
        """Every part and its reason, in one line (the start-up log)."""
        return "; ".join(f"{p} {part.choice} ({part.why})" for p, part in self.parts().items())

    def fallback(self, part: str, choice: str, why: str) -> ForwardChoice:
        """This record with `part` changed to `choice` for the reason `why`."""
        if part not in PARTS:
            raise ValueError(f"no forward part {part!r}; parts: {', '.join(PARTS)}")
        return dataclasses.replace(self, **{part: Part(choice, why)})


def choose_forward(model: Any, config: EngineConfig, loaded_from_path: bool) -> tuple[Any, ForwardChoice]:
    """The model as the runner will drive it (its weights loaded and its products swapped as
    chosen) and the record of every choice. `loaded_from_path`: the engine loaded `model` from
    `config.model.path` (only then may `cpu_weights=auto` read the file's other formats)."""
    mc = config.model
    handed_native = getattr(model, "native", False)
    model = choose_impl(model, mc.model_impl, mc.cpu_linear, mc.cpu_weights, mc.path, loaded_from_path)
    param = next(model.parameters())
    native = getattr(model, "native", False)
    use_onednn_linear(model, mc.cpu_linear)  # the runner's own swap finds it done
    impl = Part("native" if native else "transformers", _impl_why(model, mc.model_impl, handed_native, native))
    if native:
        weights = Part(model.cpu_weights, getattr(model, "cpu_weights_reason", "") or "the model as handed in")
    else:
        weights = Part(str(param.dtype).removeprefix("torch."), "transformers' model as loaded")
    invariant = has_invariant_linears(model)
    mc_ = model.config
    head_dim = getattr(mc_, "head_dim", None) or mc_.hidden_size // mc_.num_attention_heads
    sinks = bool(getattr(getattr(model, "family", None), "sinks", False))  # gpt-oss: computed by our forward only
    attention = Part(*backend_choice(mc.attention_backend, param.device, param.dtype, invariant, head_dim, sinks))
    graphs = Part(*graphs_choice(mc.cuda_graphs, param.device, native, backend_class(attention.choice)))
    choice = ForwardChoice(impl, weights, _linear_part(model, invariant), attention, graphs, _fused_part(model))
    return model, choice


def _impl_why(model: Any, asked: str, handed_native: bool, native: bool) -> str:
    if getattr(model, "cpu_weights", None) == "gguf":
        return "read straight from the GGUF file's blocks (no transformers model)"
    if handed_native:
        return "a native model handed in"
    if asked != "auto":
        return f"model_impl={asked} was asked for"
    device = next(model.parameters()).device.type
    if native:
        return f"auto: {model.config.model_type} runs natively on {device}"
    if device not in NATIVE_DEVICES:
        return f"auto: the native forward runs on {', '.join(NATIVE_DEVICES)}, not {device}"
    return f"auto: the native forward does not run {supports(model.config)}"


def _linear_part(model: nn.Module, invariant: bool) -> Part:
    kinds = product_layers(model)
    why = "; ".join(f"{k}: {_PRODUCTS[k]}" for k in kinds) or "no product layers"
    return Part("+".join(kinds) or "-", why + ("; batch-invariant" if invariant else "; not batch-invariant"))


def _fused_part(model: Any) -> Part:
    if getattr(model, "fused_layers", None) is not None:
        return Part("on", "every decoder layer in one kernel call")
    kernels = getattr(model, "layer_kernels", None)  # chosen with the model: FlashInfer's layer ops or torch's, why
    if kernels is not None and (kernels.name != "torch" or kernels.device != "cpu"):
        return Part(kernels.name if kernels.name != "torch" else "off", kernels.why)
    layers = getattr(model, "layers", None)
    if not getattr(model, "native", False) or layers is None:
        return Part("off", "only the native model's layers fuse")
    return Part("off", why_not_fused(layers) or "the layers fuse, but were not fused")


def graphs_choice(setting: str, device: torch.device, native: bool, backend: type[AttentionBackend]) -> tuple[str, str]:
    """`on`, `eager` or `off` for the cuda_graphs setting, and why: auto is on for the native model
    on CUDA (the forward whose Python makes no data-dependent decision) over a backend that
    declares its kernels safe to replay (`graph_safe`), off elsewhere. `on` where no graph can be
    captured, or replayed correctly, is an error; `eager` runs the bucketed steps on any backend."""
    why_not = graphs_refused(device, native, backend)
    if setting == "auto":
        if why_not:
            return "off", f"auto: {why_not}"
        return "on", "auto: the native model on CUDA over a backend safe to replay"
    if setting == "on" and why_not:
        raise ValueError(f"cuda_graphs=on: {why_not} (eager runs the same bucketed steps without capture)")
    return setting, f"cuda_graphs={setting} was asked for"


def graphs_refused(device: torch.device, native: bool, backend: type[AttentionBackend]) -> str | None:
    """Why no CUDA graph may be captured here; None where one may."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, the model is on {device}"
    if not native:
        return "CUDA graphs need the native model (model_impl native or auto)"
    if not backend.graph_safe:
        return (
            f"the {backend.__name__} attention builds its metadata afresh each step, so a captured graph"
            " would replay the capture's layout"
        )
    return None


def product_layers(model: nn.Module) -> list[str]:
    """The class names of the model's product layers (what the `linear` part is read from)."""
    return sorted({type(m).__name__ for m in model.modules() if type(m).__name__ in _PRODUCTS})
