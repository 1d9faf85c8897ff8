"""Every decoder layer of a model on our kernels in one call (`kernels.decoder_layers`): the
same kernels, in the same order, as the layers' own forwards, so the same bits, without the ~20
Python-level calls and fresh tensors a layer otherwise costs a step (most of a one-row step's
time outside the products, benchmarks/README.md).

It runs where every layer is ours end to end: products over the file's blocks (`BlockLinear` of
any native GGUF types, a product's parts in several types), our RMSNorm and silu*up, rotary on
our kernel, and the step's attention on the kernel backend; anywhere else (another backend's
step, a product the file stores in a type without a kernel of ours) the model runs its layers
one by one. The layer table holds the weights' addresses, so the layers' tensors are kept here
too: they must not be replaced after it is built (the loader builds it last)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchserve import kernels
from batchserve.attention.kernel import KernelMetadata
from batchserve.model.blocks import BlockLinear
from batchserve.model.layers import KernelRMSNorm, KernelSiluAndMul
from batchserve.model.moe import KernelRouter, KernelSparseMoE, SparseMoE

# The products of a layer in the table's order (csrc/layers.cpp's Field).
PRODUCTS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def why_not_fused(layers: nn.ModuleList) -> str | None:
    """None if every layer runs in `KernelDecoderLayers`, else why not."""
    if not kernels.available():
        return kernels.unavailable_reason()
    kinds = {isinstance(layer.mlp, SparseMoE) for layer in layers}
    if len(kinds) > 1:
        return "some layers' MLPs are routed experts and some dense (the layers run one by one)"
    sparse = kinds == {True}
    if sparse and (why := _why_not_fused_moe([layer.mlp for layer in layers])) is not None:
        return why
    for i, layer in enumerate(layers):
        for name in PRODUCTS[: 2 if sparse else 4]:
            if type(layer.get_submodule(name)) is not BlockLinear:
                return f"layer {i}'s {name} is not a product over GGUF blocks on our kernels"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        dense_act = not sparse and type(layer.mlp.act) is not KernelSiluAndMul  # (the experts': `_why_not_fused_moe`)
        if any(type(n) is not KernelRMSNorm for n in norms) or dense_act:
            return f"layer {i}'s norms or activation are not our kernels'"
        head_norms = (layer.self_attn.q_norm, layer.self_attn.k_norm)
        if head_norms[0] is not None and any(type(n) is not KernelRMSNorm or n.eps != norms[0].eps for n in head_norms):
            return f"layer {i}'s q/k norms are not our kernel's at the layer's eps"
        if layer.self_attn.head_dim % 16 or norms[0].eps != layers[0].input_layernorm.eps:
            return f"layer {i}: head dim {layer.self_attn.head_dim} (rotary takes multiples of 16) or its own eps"
    return None


def _why_not_fused_moe(moes: list[SparseMoE]) -> str | None:
    """None if these sparse layers' MLPs run in the fused call: each a `KernelSparseMoE` over our
    router, silu * up, no shared expert, and one routing for all."""
    for i, moe in enumerate(moes):
        if type(moe) is not KernelSparseMoE or type(moe.gate) is not KernelRouter:
            return f"layer {i}'s routed experts or router are not on our kernels"
        if moe.shared_expert is not None or moe.clamp is not None:
            return f"layer {i}'s MoE has a shared expert or the clamped SwiGLU (the layers run one by one)"
        if moe.routing != moes[0].routing:
            return f"layer {i} routes otherwise than layer 0"
    return None


class KernelDecoderLayers(nn.Module):
    """The model's decoder layers as one kernel call per step (see the module's docstring)."""

    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__()
        why = why_not_fused(layers)
        if why is not None:
            raise ValueError(f"the layers do not run fused: {why}")
        attn, mlp = layers[0].self_attn, layers[0].mlp
        hidden = attn.qkv_proj.in_features
        r = mlp.routing if isinstance(mlp, SparseMoE) else None
        inter = r.intermediate if r is not None else mlp.down_proj.in_features
        # (H, Hq, Hkv, D, I); the sparse layers' (E, k, route flags), (0, 0, 0) for none
        self.shape = (hidden, attn.num_heads, attn.num_kv_heads, attn.head_dim, inter)
        self.routing = (0, 0, 0) if r is None else (r.experts, r.top_k, int(r.softmax_first) | int(r.renormalize) << 1)
        self.eps, self.scale = float(layers[0].input_layernorm.eps), float(attn.scaling)
        self.kept: list[torch.Tensor] = []  # every tensor the table points into, alive as long as it
        rows = [self._row(layer) for layer in layers]
        self.table = torch.tensor(rows, dtype=torch.int64)  # [L, fields]
        if self.table.shape[1] != kernels.layer_fields():
            raise ValueError("the layer table does not match the kernels' build")

    def _row(self, layer: nn.Module) -> list[int]:
        row = [self._address(layer.input_layernorm.weight), self._address(layer.post_attention_layernorm.weight)]
        moe = layer.mlp if isinstance(layer.mlp, KernelSparseMoE) else None
        for name in PRODUCTS[: 2 if moe is not None else 4]:
            product = layer.get_submodule(name)
            self.kept.append(product.packed)  # its descriptor holds the parts' types, rows and weights' address
            row += [self._address(product.desc), 0 if product.bias is None else self._address(product.bias)]
        row += [0, 0, 0, 0] if moe is not None else []  # a sparse layer's gate|up and down: its experts'
        attn = layer.self_attn  # Qwen3's per-head norms of q and k, or none
        row += [0, 0] if attn.q_norm is None else [self._address(attn.q_norm.weight), self._address(attn.k_norm.weight)]
        if moe is None:
            return [*row, 0, 0, 0]
        bias = moe.gate.bias  # (the experts' table points into their products, which the model keeps)
        router = [self._address(moe.gate.weight), 0 if bias is None else self._address(bias)]
        return [*row, *router, self._address(moe.table)]

    def _address(self, t: torch.Tensor) -> int:
        t = t.detach()
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("the fused layers read contiguous CPU tensors")
        self.kept.append(t)
        return t.data_ptr()

    @staticmethod
    def runs(metadata: Any) -> bool:
        """Whether this step's attention is the kernel backend's (the pool and plan it reads), with
        one kind of attention in every layer (a window the plan holds, no soft-cap, no sinks)."""
        if not isinstance(metadata, KernelMetadata):
            return False
        kinds = set(metadata.backend.layers)
        return len(kinds) <= 1 and all(kind.softcap is None and kind.sinks is None for kind in kinds)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata: KernelMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (the embeddings) -> (the last layer's output, the residual beside it), [T, H] each."""
        backend = metadata.backend
        plan = metadata.for_window(backend.layer(0).window)  # every layer's (`runs`)
        out, residual, seconds = kernels.decoder_layers(
            self.table, x.float().contiguous(), self.shape, self.routing, self.eps, cos.contiguous(), sin.contiguous(),
            plan, backend.k_cache, backend.v_cache, self.scale,
        )  # fmt: skip
        backend.seconds += seconds
        return out, residual

    def extra_repr(self) -> str:
        return f"{self.table.shape[0]} layers in one call of our kernels"
