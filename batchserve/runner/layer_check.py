"""The batch-invariance contract checked layer by layer on the loaded model, before READY.

A toy-shape probe of a kernel (`packed_products_invariant`) can pass while the same kernel at
the model's shapes does not, and a whole-model comparison can only say that some row moved. So
every row-wise layer of the model (its products, norms and silu*up or gelu*up) is called on its own, at its
real widths and the configured thread count, with every row count the engine calls it with (the
row buckets up to the step's token budget, prompt-chunk sizes between them; the LM head up to the
most rows a step keeps) at the first, middle and last offsets, and every row compared with the
same row of one call over all of them (`row_check.rows_variance`). The first layer, in the
forward's order, that gives a row other bits is named with the call that showed it.

Layers of one kind (class, widths, output dtype; a `BlockLinear`'s block types too) run one kernel:
the first of each kind is checked at every row count, the others at a few (their weights differ,
their code does not). A sparse layer (routed experts) is checked as one row-wise layer, router,
experts and ordered sum together; its experts' products, thousands in a large model, beyond the
first of each kind are called once for finite outputs (their rows were compared through the layer).
A layer whose rows are computed alone in small tiles says how many rows
cover its paths (`check_rows`: `BlockLinear`'s 64), and is checked up to that. The attention
is not row-wise (it reads the KV cache), so the model-level check (`self_check`) covers it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from batchserve.model.layers import ROW_BUCKETS, ClampedSwiGLU, GeluTanhAndMul, RMSNorm, SiluAndMul
from batchserve.model.moe import SparseMoE
from batchserve.model.row_check import rows_variance

# Prompt-chunk sizes between the buckets: a chunk is as long as what is left of its prompt, so any
# count runs; these leave each remainder of an 8-row tile, and cross the kernels' block sizes.
CHUNK_SIZES = (3, 5, 7, 13, 17, 21, 33, 100, 257)
SPOT_COUNTS = (1, 3, 17)  # the counts the second and later layers of a kind are checked at
SPOT_ROWS = 64  # and the rows of their whole call
ACTIVATIONS = (SiluAndMul, GeluTanhAndMul, ClampedSwiGLU)  # row-wise over a gate|up product's output


@dataclass(frozen=True, slots=True)
class LayerVerdict:
    """What the layer-by-layer check found."""

    invariant: bool  # every checked layer gave every row the same bits in every call
    layers: int  # layers checked
    counts: int  # row counts the first layer of each kind was checked at
    seconds: float
    detail: str  # the first layer that broke and how ("" when none did)
    finite: bool = True  # every layer's outputs were finite (False: the first that was not is named)


@dataclass(frozen=True, slots=True)
class RowLayer:
    """One row-wise layer as the check calls it: [T, width] float32 -> [T, ...]."""

    name: str  # its path in the model, e.g. "layers.3.mlp.gate_up_proj"
    kind: tuple[str, int, int, str]  # (class, in and out widths, output dtype): one kernel per kind
    width: int
    call: Callable[[torch.Tensor], torch.Tensor]
    head: bool  # the LM head: called with a step's kept rows only
    most: int | None = None  # the most rows its kernel's paths need (a layer's `check_rows`); None: the step's
    expert: bool = False  # one routed expert's layer: checked through its sparse layer (see `check_layers`)


def row_counts(max_rows: int) -> tuple[int, ...]:
    """The row counts the engine calls a layer with, up to `max_rows`: the row buckets, the
    chunk sizes between them and `max_rows` itself (and one less: a full budget but one row)."""
    counts = {c for c in (*ROW_BUCKETS, *CHUNK_SIZES) if c <= max_rows} | {max_rows, max(1, max_rows - 1)}
    return tuple(sorted(counts))


def row_layers(model: nn.Module, intermediate: int | None = None) -> Iterator[RowLayer]:
    """The model's row-wise layers in the forward's order (each module once: tied ones are one)."""
    seen: set[int] = set()
    inside = "\0"  # the last product's path: its own submodules are its internals, checked through it
    gate_up: dict[str, int] = {}  # an MLP's path -> its gate|up product's width (an expert's is its own)
    for name, m in model.named_modules():
        if id(m) in seen or name.startswith(inside + "."):
            continue
        seen.add(id(m))
        parent = name.rpartition(".")[0]
        if isinstance(m, SparseMoE):  # routing, the experts and their ordered sum: row-wise as a whole
            width = int(m.gate.in_features)
            yield RowLayer(name, (type(m).__name__, width, width, "float32"), width, m.forward, False, m.check_rows)
        elif isinstance(m, RMSNorm):
            width = int(m.weight.shape[0])
            yield RowLayer(name, (type(m).__name__, width, width, "float32"), width, _norm_call(m), False)
        elif isinstance(m, (SiluAndMul, GeluTanhAndMul, ClampedSwiGLU)) and (
            parent in gate_up or intermediate is not None
        ):
            width = gate_up.get(parent) or 2 * int(intermediate or 0)
            kind = (type(m).__name__, width, width // 2, "float32")
            yield RowLayer(name, kind, width, m, False, expert=".experts." in name)
        elif isinstance(getattr(m, "in_features", None), int) and isinstance(getattr(m, "out_features", None), int):
            out = str(getattr(m, "out_dtype", "float32")).removeprefix("torch.")
            head = name.rpartition(".")[2] == "lm_head"
            kind = (getattr(m, "check_kind", type(m).__name__), int(m.in_features), int(m.out_features), out)
            inside = name
            if name.endswith("gate_up_proj"):
                gate_up[parent] = int(m.out_features)
            expert = ".experts." in name
            yield RowLayer(name, kind, int(m.in_features), m, head, getattr(m, "check_rows", None), expert)


def _norm_call(norm: RMSNorm) -> Callable[[torch.Tensor], torch.Tensor]:
    """The norm with its residual add, both results side by side: [T, H] -> [T, 2H]."""

    def call(x: torch.Tensor) -> torch.Tensor:
        normed, summed = norm(x, x.flip(-1))
        return torch.cat((normed, summed), dim=-1)

    return call


def check_layers(model: nn.Module, max_rows: int, max_kept_rows: int, seed: int = 0) -> LayerVerdict:
    """Check every row-wise layer of `model` (see the module's docstring) for steps of at most
    `max_rows` rows of which at most `max_kept_rows` reach the LM head."""
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    checked: set[tuple[str, int, int, str]] = set()
    layers = counts = 0
    intermediate = getattr(getattr(model, "config", None), "intermediate_size", None)
    for layer in row_layers(model, intermediate):
        most = max(1, max_kept_rows if layer.head else max_rows)
        most = most if layer.most is None else min(most, layer.most)
        full = layer.kind not in checked
        checked.add(layer.kind)
        rows = most if full else min(most, SPOT_ROWS)
        wanted = row_counts(most) if full else tuple(c for c in SPOT_COUNTS if c <= rows)
        if layer.expert and not full:  # its sparse layer's check ran it at every count: finite is what is left
            rows, wanted = 1, ()
        x = torch.randn(rows, layer.width, generator=gen)  # [rows, width]
        layers += 1
        counts = max(counts, len(wanted))
        with torch.no_grad():
            finite = bool(torch.isfinite(layer.call(x)).all())
        if not finite:  # a dequantized fallback gone wrong, say: never served
            detail = f"layer {layer.name or '(the model)'} ({layer.kind[0]}): NaN or Inf outputs from finite inputs"
            return LayerVerdict(False, layers, counts, time.perf_counter() - t0, detail, finite=False)
        where = rows_variance(layer.call, x, wanted)
        if where is not None:
            kind = f"{layer.kind[0]}, {layer.kind[1]} -> {layer.kind[2]}, {layer.kind[3]} out"
            detail = f"layer {layer.name or '(the model)'} ({kind}): {where}"
            return LayerVerdict(False, layers, counts, time.perf_counter() - t0, detail)
    return LayerVerdict(True, layers, counts, time.perf_counter() - t0, "")
