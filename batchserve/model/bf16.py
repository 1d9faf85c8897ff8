"""bfloat16 products on our kernel (batchserve/kernels/csrc/bf16_gemm.cpp): `KernelBf16Linear`.

A float32 model's products over bfloat16 copies of its weights: activations rounded to bfloat16
as they enter, products and sums in float32. Each output is one vector lane stepped through K in
one fixed order, whatever the call's row count, the row's place in it, the tile or the thread
count: batch-invariant by construction (`kernel_bf16_variance` measures it once per process all
the same). Where our kernels cannot be built, oneDNN's `layers.Bf16Linear` is the fallback, and
only where its own check passes (on AMX CPUs it tiles rows, and a row's bits follow the count)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from batchserve import kernels
from batchserve.model.layers import ROW_BUCKETS
from batchserve.model.row_check import rows_variance


class KernelBf16Linear(nn.Module):
    """A linear layer over a bfloat16 copy of a loaded `nn.Linear`'s weight (or `MergedLinear`'s,
    whose `sizes` it keeps), on our kernel: x [T, in] float32 -> [T, out] in `out_dtype`. float32
    keeps the kernel's float32 sums; bfloat16 (for a product whose only reader is the residual
    add, which widens it exactly) rounds them to nearest-even in the kernel. A bias is added in
    float32, so a layer with one leaves in float32 whatever it was asked. One kernel, one code
    path, for one row and for many."""

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.sizes: tuple[int, ...] = getattr(linear, "sizes", (linear.out_features,))
        self.register_buffer("weight", kernels.bf16_pack(linear.weight.detach()))  # 1-D, the kernel's layout
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self.out_dtype = torch.float32 if bias is not None else out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = kernels.bf16_linear(x.float().contiguous(), self.weight, self.out_features, self.out_dtype)  # [T, out]
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        out = str(self.out_dtype).removeprefix("torch.")
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, bfloat16 weights, {out} out, our kernel"


@functools.cache
def kernel_bf16_variance() -> str | None:
    """Where `KernelBf16Linear` gives a row other bits on this CPU (`row_check.rows_variance` over
    every row bucket and a few counts between, on a shape with a partial column group and an odd
    K): None where nowhere, else where (or why our kernels do not run). Once per process."""
    if not kernels.available():
        return f"our kernels do not run here: {kernels.unavailable_reason()}"
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(255, 100, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(100, 255, generator=gen))
    x = torch.randn(ROW_BUCKETS[-1], 255, generator=gen)
    return rows_variance(KernelBf16Linear(linear), x, (*ROW_BUCKETS, 3, 5, 17, 33, 100))


def our_bf16_here() -> bool:
    """Whether our bfloat16 kernel builds here and gives every row the same bits in every call."""
    return kernels.available() and kernel_bf16_variance() is None
