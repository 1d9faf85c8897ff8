"""Products for the start-up checks' tests: one invariant by construction, one that tiles rows;
and the tiny native model and engine they run in."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchserve.config import CacheConfig, DraftConfig, EngineConfig, ModelConfig
from batchserve.runner.layer_check import row_layers
from tests.conftest import make_tiny_model, make_tiny_tokenizer


def native() -> Any:
    from batchserve.model import choose_impl

    return choose_impl(make_tiny_model(), "auto")


def core_of(model: Any, num_blocks: int = 256) -> Any:
    from batchserve.engine import EngineCore

    config = EngineConfig(
        model=ModelConfig(), cache=CacheConfig(block_size=4, num_blocks=num_blocks), draft=DraftConfig(method="none")
    )
    return EngineCore(config, model, make_tiny_tokenizer())


TILE = 16


class TilesRows(nn.Module):
    """A product that computes whole tiles of 16 rows one way and the rows left over another (as
    oneDNN's bfloat16 product on AMX does): row 0 of every call agrees with a larger call, the rows
    past the last whole tile do not. Its in and out widths make the check take it for a product."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.inner = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        whole = x.shape[0] // TILE * TILE
        tiles = self.inner(x[:whole])  # [whole, out]
        rest = (x[whole:].double() @ self.inner.weight.double().T).float()  # [T - whole, out]: another order of sums
        if self.inner.bias is not None:
            rest = rest + self.inner.bias
        return torch.cat((tiles, rest))


class PerRow(nn.Module):
    """A product invariant by construction: one call per row, the same call for a row wherever it
    sits (the shipped products are third-party kernels here, whose invariance no test may assume)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.inner = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.inner(row) for row in x.split(1)])  # [T, out]


def swap(model: Any, name: str, wrapper: type[nn.Module]) -> None:
    parent, _, child = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    inner = getattr(owner, child)
    plain = nn.Linear(inner.in_features, inner.out_features, bias=False)
    with torch.no_grad():
        plain.weight.copy_(torch.randn_like(plain.weight) * 0.1)
    setattr(owner, child, wrapper(plain))


def per_row() -> Any:
    """The tiny native model with every product one call per row."""
    model = native()
    for name in [layer.name for layer in row_layers(model) if hasattr(layer.call, "in_features")]:
        swap(model, name, PerRow)
    model.batch_invariant_linears = True  # what the products' probe says of them: auto takes an invariant attention
    return model


def tiling(model: Any, name: str) -> Any:
    swap(model, name, TilesRows)
    return model
