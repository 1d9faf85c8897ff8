"""A sparse layer read from a GGUF file's blocks (`gguf_native`'s builder takes it as a mixin):
the router in float32 (with Qwen2-MoE's shared-expert gate as its last output, gpt-oss's bias),
each expert's products over its own rows of the stacked `ffn_{gate,up,down}_exps` tensors, packed
into one huge-page arena per layer, gpt-oss's experts' biases, and a shared expert."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from batchserve import kernels
from batchserve.model.gguf_file import FLOAT_TYPES, GGUFRefused, GGUFTensors, TensorView, dequantized
from batchserve.model.gguf_memory import ROUTER
from batchserve.model.moe import KernelRouter, SparseMoE


def native(view: TensorView) -> bool:
    """Whether our block kernels run this tensor as stored (its type, and for MXFP4 its scales)."""
    from batchserve.model.blocks import NATIVE_TYPES, scales_fit

    return view.qtype in NATIVE_TYPES and scales_fit(view.qtype, view.data)


def _rows(view: TensorView, start: int, count: int) -> TensorView:
    """Rows [start, start + count) of a tensor: one expert's of an `_exps` tensor (a view, no copy)."""
    row_bytes = view.nbytes // view.shape[0]
    return TensorView(f"{view.name}[{start}:{start + count}]", view.qtype, (count, view.shape[1]),
                      view.data[start : start + count], view.offset + start * row_bytes, count * row_bytes)  # fmt: skip


def _as_matrix(view: TensorView, rows: int) -> TensorView:
    """A tensor as [rows, cols] (a shared expert's gate is stored as one vector)."""
    if len(view.shape) == 2:
        return view
    cols = view.shape[0] // rows
    return TensorView(view.name, view.qtype, (rows, cols), view.data.reshape(rows, -1), view.offset, view.nbytes)


class ExpertsReader:
    """The builder's sparse-layer methods; the builder gives `tensors`, `config`, `report` and the
    products' and vectors' readers."""

    tensors: GGUFTensors
    config: Any
    report: Any

    def _product(self, name: str, views: list[TensorView], bias: torch.Tensor | None,
                 sizes: tuple[int, ...] | None = None, arena: Any = None) -> nn.Module:  # fmt: skip
        raise NotImplementedError

    def _mlp(self, mlp: nn.Module, i: int, suffix: str = "", path: str = "mlp") -> None:
        raise NotImplementedError

    def _vector(self, name: str) -> nn.Parameter:
        raise NotImplementedError

    def _progress(self, view: TensorView) -> None:
        raise NotImplementedError

    def _experts(self, moe: SparseMoE, i: int) -> None:
        """A sparse layer: its router, each expert's products over its own rows of the file's
        `ffn_{gate,up,down}_exps` tensors (every expert's, stacked), and a shared expert where the
        model has one."""
        blk, routing, hidden = f"blk.{i}.", moe.routing, self.config.hidden_size
        router = [_as_matrix(self.tensors[f"{blk}{ROUTER}.weight"], routing.experts)]
        if moe.shared_expert is not None:  # its gate's one logit: the router's last output
            router.append(_as_matrix(self.tensors[f"{blk}{ROUTER}_shexp.weight"], 1))
        bias = self.tensors.get(f"{blk}{ROUTER}.bias")  # gpt-oss's
        moe.gate = self._router(f"layers.{i}.mlp.gate", router, None if bias is None else self._vector(bias.name).data)
        stacked = {p: self.tensors[f"{blk}ffn_{p}_exps.weight"] for p in ("gate", "up", "down")}
        rows = {"gate": routing.intermediate, "up": routing.intermediate, "down": hidden}
        for part, view in stacked.items():
            if view.shape[0] != routing.experts * rows[part]:
                raise GGUFRefused(f"{view.name} has {view.shape[0]} rows, not {routing.experts} experts x {rows[part]}")
        parts = ("gate", "up", "down")
        views = [[_rows(stacked[p], e * rows[p], rows[p]) for p in parts] for e in range(len(moe.experts))]
        arena = self._arena([[g, u] for g, u, _ in views] + [[d] for _, _, d in views])
        biases = self._expert_biases(blk) if routing.expert_bias else None
        for e, (expert, (g, u, d)) in enumerate(zip(moe.experts, views, strict=True)):
            gate_up_bias, down_bias = (None, None) if biases is None else (biases[0][e], biases[1][e])
            name = f"layers.{i}.mlp.experts.{e}"
            expert.gate_up_proj = self._product(f"{name}.gate_up_proj", [g, u], gate_up_bias, arena=arena)
            expert.down_proj = self._product(f"{name}.down_proj", [d], down_bias, arena=arena)
        if moe.shared_expert is not None:
            self._mlp(moe.shared_expert, i, "_shexp", "mlp.shared_expert")

    def _expert_biases(self, blk: str) -> tuple[torch.Tensor, torch.Tensor]:
        """gpt-oss's experts' biases: gate|up [E, 2I] (the gate's first, as our products' rows) and down [E, H]."""
        gate, up, down = (self._matrix(f"{blk}ffn_{p}_exps.bias") for p in ("gate", "up", "down"))
        return torch.cat((gate, up), dim=1), down

    def _matrix(self, name: str) -> torch.Tensor:
        view = self.tensors[name]
        values = view.data if view.qtype == 0 else dequantized(view)
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(view.shape))

    def _router(self, name: str, views: list[TensorView], bias: torch.Tensor | None = None) -> nn.Module:
        """A router's product (and its shared expert's gate, a last output): float32 as llama.cpp
        computes it from a float tensor (which expert a row takes must not move with a rounding of
        ours), on our kernel (`KernelRouter`), else oneDNN's prepacked product where that is
        batch-invariant here, else on the file's blocks or bfloat16 like any other product."""
        from batchserve.model.layers import MergedLinear, PackedLinear, packed_products_invariant, prepack_available

        floats = all(v.qtype in FLOAT_TYPES for v in views)
        ours = kernels.available() and views[0].shape[1] % 8 == 0
        if not floats or not (ours or (prepack_available() and packed_products_invariant())):
            return self._product(name, views, bias)
        weight = torch.from_numpy(np.concatenate([np.asarray(v.data, dtype=np.float32) for v in views]))  # [E(+1), H]
        if ours:
            self.report.float_routers += 1
            for view in views:
                self._progress(view)
            return KernelRouter(weight, bias, tuple(v.shape[0] for v in views))
        linear = MergedLinear(weight.shape[1], tuple(v.shape[0] for v in views), bias=bias is not None)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if bias is not None:
                linear.bias.copy_(bias)
        self.report.float_routers += 1
        for view in views:
            self._progress(view)
        return PackedLinear(linear)

    def _arena(self, products: list[list[TensorView]]) -> Any:
        """One huge-page buffer for these products' packed weights (a sparse layer's experts),
        where every one of them runs on our kernels; None where some do not."""
        from batchserve.model.blocks import ALIGN, BlockPart, PackArena, packed_bytes

        if not all(native(v) for views in products for v in views):
            return None
        parts = [[BlockPart(v.data, v.qtype, v.shape[1]) for v in views] for views in products]
        return PackArena(sum(packed_bytes(p) + ALIGN for p in parts))
