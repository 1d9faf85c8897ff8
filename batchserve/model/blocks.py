"""Products over a GGUF file's own weight blocks of the types llama.cpp's usual files store
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, and gpt-oss's MXFP4),
on our kernels (csrc/block_gemm.cpp).

`BlockLinear` takes one or more parts (the file's bytes of a tensor each, any of those types, the
same in_features) and computes them as one product: the activations are quantized once per call
and each part writes its own output columns, so q|k|v and gate|up run as one call even where the
file stores attn_v as Q6_K and attn_q as Q4_K. The file's bytes are repacked once, in C++, into
the kernels' column-interleaved layout (csrc/blocks.h): the same values, scales and mins (a
K-quant's 6-bit scales unpacked to bytes), within 3% of the file's size (MXFP4: 6%, its exponent
a float16); nothing float is kept.

A row's output has the same bits whatever the call's row count, the row's place in it and the
thread count (`block_products_invariant` checks it once per process)."""

from __future__ import annotations

import functools
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from torch import nn

from batchserve import kernels
from batchserve.model.layers import in_checked_rows
from batchserve.model.row_check import rows_variance

NATIVE_TYPES: frozenset[int] = frozenset(
    int(t) for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS)
) | {int(T.MXFP4)}
# MXFP4's E8M0 exponents our kernel takes: its scale 2^(e - 128) exact as a float16 (csrc/block_pack.cpp).
MXFP4_EXPONENTS = (104, 143)
# Where a type's fp16 scale d (and min dmin, m) sit in its block, and a scale that keeps random
# blocks' weights about the size of a real model's (random_blocks).
D_FIELD = {T.Q6_K: 208, T.Q3_K: 108, T.Q2_K: 80}
MIN_FIELD = {T.Q4_1: 2, T.Q5_1: 2, T.Q4_K: 2, T.Q5_K: 2, T.Q2_K: 82}
RANDOM_SCALE = {T.Q8_0: 1 / 256, T.Q6_K: 1 / 512, T.Q4_K: 1 / 256, T.Q5_K: 1 / 512, T.Q3_K: 1 / 512,
                T.Q2_K: 1 / 128, T.IQ4_NL: 1 / 2048, T.IQ4_XS: 1 / 32768}  # fmt: skip
ALIGN = 64  # each part's packed weights start on a cache line
HUGE_PAGE = 2 << 20


@dataclass(frozen=True, slots=True)
class BlockPart:
    """One tensor's blocks as the file stores them: raw [rows, row bytes] uint8 (rows = output
    features; GGUFReader's `tensor.data`, read only), its GGMLQuantizationType and in_features."""

    raw: np.ndarray
    qtype: int
    cols: int

    @property
    def rows(self) -> int:
        return int(self.raw.shape[0])


def check_part(part: BlockPart) -> None:
    """Raise ValueError unless our kernels take `part` as it is."""
    if part.qtype not in NATIVE_TYPES:
        raise ValueError(f"our block kernels do not run {T(part.qtype).name} weights")
    values, size = GGML_QUANT_SIZES[T(part.qtype)]
    if part.cols <= 0 or part.cols % values:
        raise ValueError(f"{T(part.qtype).name} rows are whole blocks of {values} values, got {part.cols}")
    want = part.cols // values * size
    raw = part.raw
    if raw.ndim != 2 or raw.dtype != np.uint8 or raw.shape[0] < 1 or raw.shape[1] != want or raw.strides[1] != 1:
        raise ValueError(f"a {T(part.qtype).name} part of {part.cols} columns is uint8 [rows >= 1, {want}], got "
                         f"{raw.dtype} {raw.shape}")  # fmt: skip
    if not scales_fit(part.qtype, raw):
        low, high = MXFP4_EXPONENTS
        raise ValueError(f"MXFP4 scales past 2^{low - 128}..2^{high - 128} do not fit our kernel's float16 scale")


def scales_fit(qtype: int, raw: np.ndarray) -> bool:
    """Whether every block's scale of `raw` ([rows, row bytes] of `qtype`) fits our kernel: always,
    but for MXFP4, whose E8M0 exponents must lie in MXFP4_EXPONENTS (gpt-oss's do)."""
    if qtype != T.MXFP4:
        return True
    exponents = raw.reshape(-1, GGML_QUANT_SIZES[T.MXFP4][1])[:, 0]
    return bool(((exponents >= MXFP4_EXPONENTS[0]) & (exponents <= MXFP4_EXPONENTS[1])).all())


class BlockLinear(nn.Module):
    """One product y = x @ W.T where W is the row-concatenation of `parts` (the same cols, any of
    NATIVE_TYPES each, any row count each): output columns are the parts' rows in order. x [T, K]
    any float dtype -> [T, N] float32, plus `bias` if given. `sizes` (the merged projections' widths,
    as the other linear layers carry them) defaults to each part's rows."""

    # The start-up check (`runner.layer_check`) calls it with every count up to this many rows, not
    # up to the step's budget: a row's output depends on its own activations only (quantized row by
    # row; the threads split the columns, never the rows) and comes out of a tile of 8, 4, 2 or 1
    # rows with the same per-lane arithmetic, so every path a larger count takes is among these
    # (each tile size at each row position). On the 8B the budget's counts took 61 s of a start.
    check_rows = 64

    def __init__(self, parts: Sequence[BlockPart], bias: torch.Tensor | None = None,
                 sizes: tuple[int, ...] | None = None, arena: PackArena | None = None) -> None:  # fmt: skip
        """`arena`: where the packed weights go (many small products in one huge-page mapping: a
        sparse layer's experts), else a buffer of their own."""
        super().__init__()
        if not parts:
            raise ValueError("a BlockLinear needs at least one part")
        for part in parts:
            check_part(part)
        if len({part.cols for part in parts}) != 1:
            raise ValueError(f"the parts' in_features differ: {[part.cols for part in parts]}")
        self.in_features = parts[0].cols
        self.out_features = sum(part.rows for part in parts)
        self.sizes = tuple(part.rows for part in parts) if sizes is None else tuple(sizes)
        if sum(self.sizes) != self.out_features:
            raise ValueError(f"sizes {self.sizes} do not add up to the parts' {self.out_features} rows")
        self.qtypes = tuple(part.qtype for part in parts)
        self.rows = tuple(part.rows for part in parts)
        spans = [kernels.block_packed_size(part.qtype, part.rows, part.cols) for part in parts]
        self.offsets = tuple(int(o) for o in np.cumsum([0] + [-(-s // ALIGN) * ALIGN for s in spans]))
        # every part's layout, one after the other
        packed = _aligned(self.offsets[-1]) if arena is None else arena.take(self.offsets[-1])
        for part, start, span in zip(parts, self.offsets, spans, strict=False):
            kernels.block_pack(part.raw, part.qtype, part.rows, part.cols, packed[start : start + span])
        self.register_buffer("packed", packed)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self._desc_base = -1
        self._desc = torch.empty(0, dtype=torch.int64)

    @property
    def desc(self) -> torch.Tensor:
        """The kernels' descriptor of this product (csrc/blocks.h), int64 [3 + 3 P]: rebuilt if the
        packed buffer moved (the descriptor holds its address)."""
        base = self.packed.data_ptr()
        if base != self._desc_base:
            fields = [self.in_features, self.out_features, len(self.qtypes)]
            for qtype, rows, start in zip(self.qtypes, self.rows, self.offsets, strict=False):
                fields += [qtype, rows, base + start]
            self._desc, self._desc_base = torch.tensor(fields, dtype=torch.int64), base
        return self._desc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = in_checked_rows(x.float().contiguous(), self._mm)  # [T, N]
        return out if self.bias is None else out + self.bias

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.block_linear(x, self.desc, self.out_features)  # [T, N]

    @property
    def check_kind(self) -> str:
        """Its kernel as the start-up check groups layers: one per mix of block types."""
        return f"BlockLinear[{','.join(T(q).name for q in self.qtypes)}]"

    def extra_repr(self) -> str:
        kinds = "|".join(f"{T(q).name}[{r}]" for q, r in zip(self.qtypes, self.rows, strict=False))
        return f"in_features={self.in_features}, out_features={self.out_features}, {kinds}, our kernel"


def packed_bytes(parts: Sequence[BlockPart]) -> int:
    """What a `BlockLinear` over `parts` packs into (its own buffer, or its share of an arena)."""
    return sum(-(-kernels.block_packed_size(p.qtype, p.rows, p.cols) // ALIGN) * ALIGN for p in parts)


class PackArena:
    """One buffer (huge pages, `_aligned`) cut into many products' packed weights: a sparse layer's
    experts are a few MB each, under a huge page, and each in a buffer of its own would stream
    through 4 KB pages (a TLB miss every 4 KB; measured: a 30B-A3B file's one-request decoding ...)."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = _aligned(nbytes)
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """The next `nbytes` (a view: it keeps the buffer alive), starting on an ALIGN boundary."""
        start = -(-self.used // ALIGN) * ALIGN
        if start + nbytes > self.buffer.numel():
            left = self.buffer.numel() - start
            raise ValueError(f"the arena of {self.buffer.numel()} bytes has {left} left, not {nbytes}")
        self.used = start + nbytes
        return self.buffer[start : start + nbytes]


def _aligned(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` whose data starts on an ALIGN-byte boundary (a view into a
    slightly larger one: the view keeps it alive). One of a huge page or more is anonymous memory
    asked for in huge pages before it is written: a one-row step streams every weight once, and
    on 4 KB pages that is a TLB miss every 4 KB (the kernel's `madvise` mode gives none unasked)."""
    if nbytes >= HUGE_PAGE:
        area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            area.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # only a hint
            pass
        return torch.frombuffer(area, dtype=torch.uint8)  # page-aligned; the tensor keeps `area` alive
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + nbytes]


def random_blocks(qtype: int, rows: int, cols: int, gen: torch.Generator) -> np.ndarray:
    """Valid random blocks [rows, row bytes] of `qtype` for checks and tests: random bytes with the
    float16 fields (d, m, dmin) set to sane finite values (mins negative, as quantizers make them)."""
    values, size = GGML_QUANT_SIZES[T(qtype)]
    blocks = cols // values
    raw = torch.randint(0, 256, (rows, blocks, size), generator=gen, dtype=torch.uint8)

    def put(offset: int, field: torch.Tensor) -> None:  # field [rows, blocks] float32
        raw[:, :, offset : offset + 2] = field.half().view(torch.uint8).view(rows, blocks, 2)

    if qtype == T.MXFP4:  # E8M0 exponents: scales of 2^-8 .. 2^-5, weights about 0.01
        raw[:, :, 0] = torch.randint(120, 124, (rows, blocks), generator=gen, dtype=torch.uint8)
        return raw.view(rows, blocks * size).numpy()
    scale = RANDOM_SCALE.get(T(qtype), 1 / 32)
    d = (torch.rand(rows, blocks, generator=gen) + 0.05) * scale
    put(D_FIELD.get(T(qtype), 0), d)
    if qtype in MIN_FIELD:
        put(MIN_FIELD[T(qtype)], -torch.rand(rows, blocks, generator=gen) * scale * 8)
    return raw.view(rows, blocks * size).numpy()


@functools.cache
def block_products_invariant() -> bool:
    """Whether our block kernels give a row the same bits in calls of every row count and at every
    place in the call on this CPU, for every native type and a mixed-part product (true by
    construction; measured once per process)."""
    if not kernels.available():
        return False
    gen = torch.Generator().manual_seed(0)
    k = 512  # two K-quant super-blocks, 16 blocks of 32
    layers = [BlockLinear([BlockPart(random_blocks(q, 41, k, gen), q, k)]) for q in sorted(NATIVE_TYPES)]
    mixed = [BlockPart(random_blocks(q, rows, k, gen), q, k) for q, rows in ((T.Q4_K, 24), (T.Q6_K, 5), (T.Q5_0, 19))]
    layers.append(BlockLinear(mixed))
    x = torch.randn(300, k, generator=gen)
    counts = (1, 2, 3, 5, 8, 17, 40, 64, 128, 299)
    return all(rows_variance(layer, x, counts) is None for layer in layers)
