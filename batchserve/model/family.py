"""What sets one model family's decoder apart from Llama's, read from a transformers config: the
native forward (`model.llama`) is one forward with these options, not a class per family.

Llama, Mistral, Qwen2 and Qwen3 differ by biases and Qwen3's per-head q/k norms. Gemma 2 and 3 add
(1 + w) RMSNorms (folded into the weight at load: the same product, `x * (1 + w)`), a norm after
attention and around the MLP, GeGLU with tanh GELU, an embedding scale of sqrt(hidden), a softmax
scale from `query_pre_attn_scalar`, logit soft-caps (Gemma 2) and, in Gemma 3, q/k norms and a
rotary of its own for the sliding-window layers. The routed-expert families (Qwen3-MoE, Qwen2-MoE,
Mixtral, OLMoE) add their `Routing` (`model.moe`); OLMoE norms q and k over the whole projection
and may clip q, k and v. gpt-oss adds a sink logit per query head to each attention's softmax, biases
on the router and experts, and the experts' clamped SwiGLU."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from batchserve.model.moe import Routing

GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text")
QK_NORM_ARCHITECTURES = ("qwen3", "qwen3_moe", "gemma3_text")  # an RMSNorm over each head of q and of k, before rotary
WHOLE_QK_NORM_ARCHITECTURES = ("olmoe",)
SINK_ARCHITECTURES = ("gpt_oss",)  # an RMSNorm over all of q and over all of k, before rotary
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # transformers' name -> our layer's


@dataclass(frozen=True, slots=True)
class Family:
    """The options of the one native decoder that a model's config selects."""

    qk_norm: bool  # RMSNorm over each head of q and k before rotary (Qwen3, Gemma 3)
    unit_offset_norms: bool  # every RMSNorm scales by (1 + w): w + 1 is stored (Gemma)
    sandwich_norms: bool  # a norm after attention and after the MLP, and one before it (Gemma)
    act: str  # silu or gelu_tanh: the gate's activation (times up)
    embed_scale: float | None  # the embeddings times this (Gemma: sqrt(hidden), rounded to float32)
    final_softcap: float | None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    local_rope: bool  # the sliding-window layers rotate by a rotary of their own (Gemma 3)
    scaling: float  # the softmax scale
    qk_norm_whole: bool = False  # the q/k norms span the whole projection, not each head (OLMoE)
    clip_qkv: float | None = None  # q, k (after their norms) and v clamped to +-this (OLMoE)
    moe: Routing | None = None  # routed experts in the sparse layers' MLPs
    sinks: bool = False  # a learned sink logit per query head in each attention's softmax (gpt-oss)

    @classmethod
    def of(cls, config: Any) -> Family:
        gemma = config.model_type in GEMMA_ARCHITECTURES
        d = head_dim(config)
        scalar = getattr(config, "query_pre_attn_scalar", None) if gemma else None
        return cls(
            qk_norm=config.model_type in (*QK_NORM_ARCHITECTURES, *WHOLE_QK_NORM_ARCHITECTURES),
            unit_offset_norms=gemma,
            sandwich_norms=gemma,
            act=ACTIVATIONS.get(activation(config), "unsupported"),
            embed_scale=config.hidden_size**0.5 if gemma else None,
            final_softcap=(getattr(config, "final_logit_softcapping", None) or None) if gemma else None,
            local_rope=config.model_type == "gemma3_text",
            scaling=float((scalar or d) ** -0.5),
            qk_norm_whole=config.model_type in WHOLE_QK_NORM_ARCHITECTURES,
            clip_qkv=getattr(config, "clip_qkv", None) or None,
            moe=Routing.of(config),
            sinks=config.model_type in SINK_ARCHITECTURES,
        )


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def activation(config: Any) -> str:
    """transformers' name of the gate's activation (Gemma's configs call it `hidden_activation`)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")


def rope_types(config: Any) -> list[str]:
    """The rope type of every rotary the model has (Gemma 3: one per kind of layer)."""
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    per_kind = [v for v in rope.values() if isinstance(v, dict)]
    return [r.get("rope_type", r.get("type", "default")) for r in (per_kind or [rope])]


def stored_norm(config: Any, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The weight our RMSNorm stores for checkpoint parameter `name`: Gemma's norms scale by
    (1 + w) in float32, so w + 1 in float32 (the same product, `normed * (1 + w)`)."""
    if config.model_type in GEMMA_ARCHITECTURES and name.endswith("norm.weight"):
        return tensor.float() + 1.0
    return tensor


def hf_rotaries(rope: Any) -> tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float] | None]:
    """((inv_freq, scaling) of the global layers, that of the sliding-window layers or None) from
    transformers' rotary module of the model."""
    if hasattr(rope, "inv_freq"):
        return (rope.inv_freq.detach().float().clone(), float(getattr(rope, "attention_scaling", 1.0))), None
    found = {
        kind: (getattr(rope, f"{kind}_inv_freq").detach().float().clone(),
               float(getattr(rope, f"{kind}_attention_scaling", 1.0)))
        for kind in ("full_attention", "sliding_attention")
        if hasattr(rope, f"{kind}_inv_freq")
    }  # fmt: skip
    if not found:
        raise ValueError(f"{type(rope).__name__} has no inv_freq for any layer type")
    # transformers makes only the kinds the model's layers have: a Gemma 3 of fewer than 6 layers
    # is all windowed (its global rotary then serves no layer, and is the windowed one's).
    return found.get("full_attention") or found["sliding_attention"], found.get("sliding_attention")


def rotary_for(config: Any, factors: np.ndarray | None) -> nn.Module:
    """The rope frequencies as transformers computes them for `config`, divided by llama.cpp's
    `rope_freqs` factors where the file stores them (its Llama 3.1 scaling)."""
    from batchserve.model.layer_kernels import TORCH_LAYERS

    (inv_freq, scaling), _ = hf_rotaries(_hf_rope(config))  # [D/2]
    if factors is not None:
        inv_freq = inv_freq / torch.from_numpy(factors.reshape(-1))
    return TORCH_LAYERS.rotary(inv_freq, scaling)


def local_rotary_for(config: Any) -> nn.Module | None:
    """The sliding-window layers' own rotary where the model has one (Gemma 3), else None."""
    from batchserve.model.layer_kernels import TORCH_LAYERS

    _, local = hf_rotaries(_hf_rope(config))
    return None if local is None else TORCH_LAYERS.rotary(*local)


def _hf_rope(config: Any) -> nn.Module:
    """transformers' rotary module for `config` (its frequencies as transformers computes them)."""
    name = config.model_type.removesuffix("_text")  # gemma3_text lives in gemma3's module
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    rotary_class = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    return rotary_class(config=config)
