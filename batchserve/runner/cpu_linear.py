"""oneDNN for the model's linear layers on CPU.

On CPU, a step of a small model is almost all matrix products (82% `aten::mm` in a profile
of a SmolLM2 decode step). PyTorch sends float32 `nn.Linear` to its BLAS; oneDNN's linear
kernel is 1.1-1.5x faster on the same weights (`benchmarks/compile_forward.py`), with no
compile and no start-up cost. Its sums run in another order, so logits move in the last
bits; greedy output stays the model's own.

oneDNN keeps state for every input shape it sees: with the raw row count of each step a
server's memory grew by about 400 MB over 150 mixed SmolLM2 requests (torch's BLAS stays
flat). Rows are therefore padded up to one of a few bucket sizes (at most a quarter again
as many from 3 rows on), so that state is bounded by the number of buckets: `make soak`
(32 users, 10 minutes) grew by 2.2% from minute 2 on. So it is the CPU default (`auto`), and `torch` turns it off.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from batchserve.config import CPU_LINEAR
from batchserve.model.layers import row_bucket


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.shape[-2]  # x: [..., T, in]
    padded = row_bucket(rows)
    if padded != rows:
        x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))  # [..., padded, in]
    return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")[..., :rows, :]


def use_onednn_linear(model: Any, choice: str) -> bool:
    """Route every `nn.Linear` of a float32 CPU model through oneDNN (`onednn`; `auto`: where it
    can run), or back to torch's own forward (`torch`), in place. True if the model now uses oneDNN."""
    if choice not in CPU_LINEAR:
        raise ValueError(f"cpu_linear must be one of {CPU_LINEAR}, got {choice!r}")
    param = next(model.parameters())
    usable = param.device.type == "cpu" and param.dtype == torch.float32 and onednn_available()
    if choice == "onednn" and not usable:
        raise ValueError(f"cpu_linear=onednn needs a float32 CPU model and oneDNN, got {param.device} {param.dtype}")
    onednn = choice == "onednn" or (choice == "auto" and usable)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            if onednn:
                module.forward = types.MethodType(_onednn_forward, module)
            else:
                module.__dict__.pop("forward", None)  # the class's forward again
    return onednn
