"""oneDNN for the model's linear layers on CPU.

On CPU, a step of a small model is almost all matrix products. PyTorch sends float32
`nn.Linear` to its BLAS; oneDNN's linear kernel is faster on the same weights
(`benchmarks/compile_forward.py` measures it), with no compile and no start-up cost. Its sums
run in another order, so logits move in the last bits; greedy output stays the model's own.

oneDNN keeps state for every input shape it sees, so with the raw row count of each step a
server's memory grows without bound (torch's BLAS stays flat). Rows are therefore padded up to
one of a few bucket sizes (at most a quarter again as many from 3 rows on), so that state is
bounded by the number of buckets (`make soak` checks the memory stays flat). So it is the CPU
default (`auto`), and `torch` turns it off. Figures: benchmarks/README.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchserve.config import CPU_LINEAR
from batchserve.model.layers import row_bucket


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDNNLinear(nn.Linear):
    """A float32 `nn.Linear` whose product runs on oneDNN's linear kernel, its rows padded up to a
    bucket (`row_bucket`): the transformers forward's layer on CPU, over the same parameters."""

    @classmethod
    def sharing(cls, linear: nn.Linear) -> OneDNNLinear:
        """This layer over `linear`'s own weight and bias (tied weights stay tied)."""
        return _sharing(cls, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[-2]  # x: [..., T, in]
        padded = row_bucket(rows)
        if padded != rows:
            x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))  # [..., padded, in]
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")[..., :rows, :]


def _sharing(cls: type[nn.Linear], linear: nn.Linear) -> Any:
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = linear.in_features, linear.out_features
    layer.register_parameter("weight", linear.weight)
    layer.register_parameter("bias", linear.bias)
    return layer


def use_onednn_linear(model: Any, choice: str) -> bool:
    """Swap every `nn.Linear` of a float32 CPU model for a `OneDNNLinear` over the same parameters
    (`onednn`; `auto`: where it can run), or back (`torch`), in place. True if the model now uses
    oneDNN."""
    if choice not in CPU_LINEAR:
        raise ValueError(f"cpu_linear must be one of {CPU_LINEAR}, got {choice!r}")
    param = next(model.parameters())
    usable = param.device.type == "cpu" and param.dtype == torch.float32 and onednn_available()
    if choice == "onednn" and not usable:
        raise ValueError(f"cpu_linear=onednn needs a float32 CPU model and oneDNN, got {param.device} {param.dtype}")
    onednn = choice == "onednn" or (choice == "auto" and usable)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and onednn:
                setattr(parent, name, OneDNNLinear.sharing(child))
            elif type(child) is OneDNNLinear and not onednn:
                setattr(parent, name, _sharing(nn.Linear, child))  # torch's own layer again
    return onednn
