"""Our attention inside transformers' own modules (a model the native forward does not run): the
attention function transformers calls, handing each layer's q/k/v to the step's backend, and the
terms such a module hands it that our backends do not compute, for which the model is refused."""

from __future__ import annotations

from typing import Any

import torch

ATTN_IMPL = "batchserve"


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    attn_metadata: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention hook: hand the layer's q/k/v to the step's backend."""
    if attn_metadata is None:
        raise RuntimeError("batchserve attention called without attn_metadata (use ModelRunner)")
    for term, what in UNSERVED_TERMS.items():
        if kwargs.get(term) is not None:  # never computed without it: a wrong answer is worse than none
            raise RuntimeError(f"the model's attention has {what}, which our attention does not compute")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # transformers' [1, H, T, D] in and [1, T, Hq, D] out; the backends take the packed rows.
    out = attn_metadata.backend.forward(module.layer_idx, query[0], key[0], value[0], attn_metadata, scale)
    return out[None], None


# Terms a transformers attention module hands its attention function that our backends do not
# compute (the keyword -> what it is): a model that uses one is refused, never served without it.
UNSERVED_TERMS = {"s_aux": "attention sinks (a learned per-head logit in the softmax's denominator)"}
UNSERVED_PARAMETERS = {"sinks": UNSERVED_TERMS["s_aux"]}  # the attention module's parameter behind each


def unserved_attention(model: Any) -> str | None:
    """Why our attention cannot serve this transformers model's attention modules exactly, else
    None: one of them holds a term our backends do not compute (gpt-oss's sinks)."""
    for name, module in model.named_modules():
        for attr, what in UNSERVED_PARAMETERS.items():
            if isinstance(getattr(module, attr, None), torch.Tensor):
                return f"{name} has {what}, which our attention does not compute"
    return None


def register_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPL, _attention)
    # Our backend builds its own masks; HF must not materialize a dense one.
    AttentionMaskInterface.register(ATTN_IMPL, lambda *args, **kwargs: None)
