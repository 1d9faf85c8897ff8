"""Layers over the GGUF file's own quantized blocks on our kernels (`batchserve.kernels`): `Q4Linear`
for the Q4_1 layers, `Q8Linear` for a Q8_0 LM head, and `Q8Embedding` looking rows up in the same
Q8_0 blocks (a tied head and embedding share one copy). Each reads every weight block once per
call whatever its row count, and gives a row the same bits in every call (`quant_products_invariant`).

The blocks keep the file's values, scales and mins (float16, as stored); only their byte order
changes: 8 output columns are interleaved 4 values at a time, the operand layout of the kernels'
integer products (batchserve/kernels/csrc/quant_gemm.cpp)."""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from batchserve import kernels
from batchserve.model.layers import in_checked_rows
from batchserve.model.row_check import rows_variance

GROUP = 32  # values per block
COLUMNS = 8  # output columns interleaved together


def group_q4_1(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 values q [N, K] (0..15), scales d and mins m [N, K/32] -> the kernel's layout: nibbles
    [N/8, K/32, 4, 32] uint8, d and m [N/8, K/32, 8] float16."""
    n, k = q.shape
    # [N/8, 8 cols, K/32, 4 chunks, 2 steps, 4 values] -> [N/8, K/32, 4, 2, 8, 4]
    steps = torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)).view(n // 8, 8, k // GROUP, 4, 2, 4)
    steps = steps.permute(0, 2, 3, 4, 1, 5)
    nibbles = (steps[:, :, :, 0] | (steps[:, :, :, 1] << 4)).reshape(n // 8, k // GROUP, 4, 32).contiguous()
    return nibbles, _group_scales(d), _group_scales(m)


def group_q8_0(q: np.ndarray, d: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 values q [N, K] int8 and scales d [N, K/32] -> values [N/8, K/32, 8, 32] int8 (step s,
    byte 4j + r: column j's value 4s + r of the block) and d [N/8, K/32, 8] float16."""
    n, k = q.shape
    steps = torch.from_numpy(np.ascontiguousarray(q, dtype=np.int8)).view(n // 8, 8, k // GROUP, 8, 4)
    return steps.permute(0, 2, 3, 1, 4).reshape(n // 8, k // GROUP, 8, 32).contiguous(), _group_scales(d)


def _group_scales(s: np.ndarray) -> torch.Tensor:
    n, blocks = s.shape
    half = torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32)).to(torch.float16)
    if not torch.equal(half.float(), torch.from_numpy(np.asarray(s, dtype=np.float32))):
        raise ValueError("a block scale is not a float16 value (the file stores them as float16)")
    return half.view(n // 8, 8, blocks).transpose(1, 2).contiguous()  # [N/8, K/32, 8]


def fits(out_features: int, in_features: int) -> bool:
    """Whether the kernels take a product of this shape (whole blocks, whole column groups)."""
    return in_features % GROUP == 0 and out_features % COLUMNS == 0


class Q4Linear(nn.Module):
    """A linear layer over Q4_1 weights as stored, on our kernel: activations are quantized per
    row and block of 32 to int8 inside the call (as llama.cpp does), the output is float32.
    Same constructor as `Int4Linear` (q [N, K] in 0..15, d and m [N, K/32])."""

    def __init__(
        self,
        q: np.ndarray,
        d: np.ndarray,
        m: np.ndarray,
        bias: torch.Tensor | None,
        sizes: tuple[int, ...],
        out_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        if not fits(self.out_features, self.in_features):
            raise ValueError(f"Q4Linear needs K % {GROUP} == 0 and N % {COLUMNS} == 0, got {q.shape}")
        self.sizes = sizes
        nibbles, scales, mins = group_q4_1(q, d, m)
        self.register_buffer("weight", nibbles)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = in_checked_rows(x.float().contiguous(), self._mm)  # [T, N]
        return out if self.bias is None else out + self.bias

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.q4_1_linear(x, self.weight, self.scales, self.mins)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q4_1, our kernel"


class Q8Blocks(nn.Module):
    """A Q8_0 matrix [N, K] in the kernel's layout, shared by the head's product and the
    embedding's lookup."""

    def __init__(self, q: np.ndarray, d: np.ndarray) -> None:
        super().__init__()
        self.rows, self.cols = q.shape
        if self.cols % GROUP:
            raise ValueError(f"Q8_0 rows are whole blocks of {GROUP}, got {self.cols} values")
        pad = -self.rows % COLUMNS  # zero rows up to whole column groups (a vocabulary need not be)
        if pad:
            q, d = np.pad(q, ((0, pad), (0, 0))), np.pad(d, ((0, pad), (0, 0)))
        values, scales = group_q8_0(q, d)
        self.register_buffer("values", values)  # [N/8, K/32, 8, 32] int8
        self.register_buffer("scales", scales)  # [N/8, K/32, 8] float16

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] dequantized, d * q in float32 [T, K]: exactly the file's values."""
        group, col = ids // COLUMNS, ids % COLUMNS
        blocks = self.cols // GROUP
        values = self.values.view(-1, blocks, 8, COLUMNS, 4)[group, :, :, col, :]  # [T, K/32, 8, 4]
        scales = self.scales[group, :, col].float()  # [T, K/32]
        out = values.reshape(ids.shape[0], blocks, GROUP).float() * scales[..., None]
        return out.view(ids.shape[0], self.cols)


class Q8Linear(nn.Module):
    """The LM head over Q8_0 blocks as stored, on our kernel (float32 out)."""

    def __init__(self, blocks: Q8Blocks) -> None:
        super().__init__()
        self.blocks = blocks
        self.out_features, self.in_features = blocks.rows, blocks.cols
        self.sizes = (blocks.rows,)
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return in_checked_rows(x.float().contiguous(), self._mm)  # [T, N]

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        out = kernels.q8_0_linear(x, self.blocks.values, self.blocks.scales)  # [T, N rounded up to 8]
        return out if out.shape[1] == self.out_features else out[:, : self.out_features]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q8_0, our kernel"


class Q8Embedding(nn.Module):
    """A token embedding over Q8_0 blocks as stored: a looked-up row is `d * q` in float32,
    exactly the value transformers dequantizes (an 8-bit value times a float16 scale needs 19 of
    float32's 24 bits). Tied to a `Q8Linear` head, both read one copy of the blocks."""

    def __init__(self, blocks: Q8Blocks) -> None:
        super().__init__()
        self.blocks = blocks
        self.num_embeddings, self.embedding_dim = blocks.rows, blocks.cols

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.blocks.lookup(ids)  # [T, H]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, Q8_0"


def random_q4_1(n: int, k: int, gen: torch.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random Q4_1 blocks (values, float16-exact scales and mins) for checks and tests."""
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8).numpy()
    d = (torch.rand(n, k // GROUP, generator=gen) / 8).half().float().numpy()
    m = (-torch.rand(n, k // GROUP, generator=gen) * 1.5).half().float().numpy()
    return q, d, m


@functools.cache
def quant_products_invariant() -> bool:
    """Whether our kernels give a row the same bits in calls of every row count and at every
    place in the call on this CPU (true by construction; measured, once per process)."""
    if not kernels.available():
        return False
    gen = torch.Generator().manual_seed(0)
    q4 = Q4Linear(*random_q4_1(48, 256, gen), None, (48,))
    q8 = Q8Linear(Q8Blocks(torch.randint(-128, 128, (48, 256), generator=gen, dtype=torch.int8).numpy(),
                           (torch.rand(48, 8, generator=gen) / 64).half().float().numpy()))  # fmt: skip
    x = torch.randn(300, 256, generator=gen)
    counts = (1, 2, 3, 5, 8, 17, 40, 64, 128, 299)
    return all(rows_variance(layer, x, counts) is None for layer in (q4, q8))
