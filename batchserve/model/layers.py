"""Layers of the native forward, each a visible class: a kernel choice is a layer, not a patch.

Every tensor here is a step's packed rows: [T, ...], T = all requests' rows back to back (prompt
chunks, roots, draft nodes, window rows); no batch dimension, no padding between requests."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from batchserve import kernels
from batchserve.model.row_check import rows_variance
from batchserve.threads import rows_whole, torch_threads


class RMSNorm(nn.Module):
    """RMSNorm with the residual add fused in: `norm(x)` -> normed; `norm(x, residual)` ->
    (normed, x + residual), the sum being the next residual. Row-wise: a row's result never
    depends on the other rows. Arithmetic as transformers' (float32 inside, weight after)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op with the same bits as the steps below (checked by the tests), at half
            # their cost: a step runs 2 norms per layer.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()  # [T, H]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        summed = x + residual  # [T, H]
        return self._norm(summed), summed


class KernelRMSNorm(RMSNorm):
    """RMSNorm with the residual add in one call of our kernel (`kernels.rms_norm`): the same
    sum, the norm in the kernel's own order (so not transformers' bits: used beside our quantized
    products, whose model is its own reference). Row-wise, batch-invariant by construction."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        normed, summed = kernels.rms_norm(x.contiguous(), residual, self.weight, self.eps)
        return normed if summed is None else (normed, summed)


class MergedLinear(nn.Linear):
    """One matrix product for several projections of the same input (q|k|v, gate|up): their
    weights stacked by rows, loaded through `load_part`, the output split by `sizes`."""

    def __init__(self, in_features: int, sizes: tuple[int, ...], bias: bool) -> None:
        super().__init__(in_features, sum(sizes), bias=bias)
        self.sizes = sizes

    @torch.no_grad()
    def load_part(self, part: int, leaf: str, tensor: torch.Tensor) -> None:
        """Copy one projection's `weight` or `bias` into its rows of the merged one."""
        start = sum(self.sizes[:part])
        getattr(self, leaf)[start : start + self.sizes[part]].copy_(tensor)


# Row counts a oneDNN product is called with: a step's rows are padded up to the next one, so
# oneDNN's per-shape state stays bounded (raw row counts grow it without bound). Four buckets an
# octave from 8 on, so padding adds at most a quarter: past 8 rows a row costs about as much as
# the next, so coarser buckets pay for rows nobody asked for. (Figures in benchmarks/README.md,
# "Figures behind the code's choices": kept there, where a rerun updates them.)
ROW_BUCKETS = (
    *(1, 2, 3, 4, 6, 8, 10, 12, 14, 16),
    *(20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128),
    *(160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048),
)


def in_checked_rows(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`product(x)` for x [T, in] in calls of at most ROW_BUCKETS[-1] rows (the most the kernel
    checks cover): a step larger than that (a long prompt chunk under a large token budget) is
    split, so every row still comes out of a checked call."""
    most = ROW_BUCKETS[-1]
    if x.shape[0] <= most:
        return product(x)
    return torch.cat([product(part) for part in x.split(most)])  # [T, out]


def row_bucket(rows: int, least: int = 1) -> int:
    """The bucket `rows` (at least `least`) is padded up to; beyond the last, `rows` itself."""
    rows = max(rows, least)
    i = bisect.bisect_left(ROW_BUCKETS, rows)
    return ROW_BUCKETS[i] if i < len(ROW_BUCKETS) else rows


def prepack_available() -> bool:
    """Whether torch can reorder float32 weights into oneDNN's layout on this build."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


# Fewest rows a prepacked oneDNN product is called with: a 1-row call takes another kernel (not
# batch-invariant), and on the CPUs measured 4 rows cost less than 1 or 2 (benchmarks/README.md).
LEAST_ROWS = 4


class PackedLinear(nn.Module):
    """A linear layer on oneDNN with its weight reordered once into oneDNN's blocked layout (what
    inductor's weight freezing does): about 2x torch's own product at 2 to 32 rows on SmolLM2's
    shapes, and batch-invariant: a row gets the same bits in every call of two or more rows (a
    one-row call takes another kernel, so rows are padded to a bucket of at least LEAST_ROWS).
    Built from a loaded `nn.Linear` (or `MergedLinear`, whose `sizes` it keeps), in its dtype."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.sizes: tuple[int, ...] = getattr(linear, "sizes", (linear.out_features,))
        weight = linear.weight.detach().to(dtype or linear.weight.dtype).contiguous()
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight, 16))  # opaque layout
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return in_checked_rows(x, lambda part: self._bucketed(part, bias))

    def _bucketed(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]  # x: [T, in], T at most the last bucket
        padded = row_bucket(rows, least=LEAST_ROWS)
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))  # [padded, in]
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")[:rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN prepacked"


class Bf16Linear(PackedLinear):
    """A prepacked oneDNN product over bfloat16 weights in a float32 model: activations enter in
    bfloat16 and leave in float32 (rounded to bfloat16 by the kernel), so norms, residuals, rotary
    and attention keep float32 (the dtype the invariant attention is checked in). Half of
    float32's bytes a step, and on AVX-512 CPUs 2x its speed at every row count."""

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(linear, torch.bfloat16)  # the bias stays the float32 model's
        # bfloat16: the kernel's output as it is, for a product whose only reader is the residual
        # add (it widens bfloat16 to float32 exactly: the same bits, one cast less per product).
        self.out_dtype = torch.float32 if linear.bias is not None else out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._product(x.to(torch.bfloat16), None)  # [T, out]
        if self.out_dtype is not torch.bfloat16:  # a call that changes nothing still costs a dispatch
            out = out.to(self.out_dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return super().extra_repr() + f", bfloat16 weights, {str(self.out_dtype).removeprefix('torch.')} out"


def bf16_prepack_available() -> bool:
    """Whether oneDNN reorders bfloat16 weights on this CPU (it needs avx512 or avx_ne_convert)."""
    if not prepack_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 16)
    except RuntimeError:
        return False
    return True


@functools.cache
def packed_products_variance(layer_class: type[PackedLinear] = PackedLinear) -> str | None:
    """Where `layer_class` gives a row other bits on this CPU (`row_check.rows_variance` over every
    row bucket and a few counts padded to one; a property of oneDNN's kernels, measured, not
    promised): None where nowhere. Checked once per process."""
    gen = torch.Generator().manual_seed(0)
    layer = nn.Linear(256, 128)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(128, 256, generator=gen))
    packed = layer_class(layer)
    x = torch.randn(ROW_BUCKETS[-1], 256, generator=gen)
    return rows_variance(packed, x, (*ROW_BUCKETS, 3, 5, 17, 33, 100))


def packed_products_invariant(layer_class: type[PackedLinear] = PackedLinear) -> bool:
    """Whether `layer_class` gives every row the same bits in every call on this CPU."""
    return packed_products_variance(layer_class) is None


class SiluAndMul(nn.Module):
    """silu(gate) * up over a merged [T, 2I] gate|up output -> [T, I], on as many threads as split
    it at whole rows (`batchserve.threads`): a row's bits depend on no other row, nor on the
    thread count."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        with rows_whole(gate.shape[0], gate.shape[1]):
            return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu(gate, tanh approximation) * up over a merged [T, 2I] gate|up output -> [T, I] (Gemma's
    GeGLU). torch's GELU splits its work into one chunk per thread (numel / threads, not its
    usual grain), so a chunk may start inside a row and give that row's first values the scalar
    tanh instead of the vector one: it runs on a thread count that divides the rows, so every
    chunk is whole rows, each computed as one thread computes it (the start-up check holds it)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] views: strided, so each row is its own inner loop
        rows, threads = gate.shape[0], torch.get_num_threads()
        with torch_threads(max(t for t in range(1, threads + 1) if rows % t == 0)):
            return F.gelu(gate, approximate="tanh") * up


class ClampedSwiGLU(nn.Module):
    """gpt-oss's experts' activation over a merged [T, 2I] gate|up output -> [T, I]: the gate
    clamped to at most `limit`, up to +-`limit`, then (up + 1) * gate * sigmoid(alpha * gate), as
    transformers computes it; elementwise, each row on one thread (`rows_whole`)."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        with rows_whole(gate.shape[0], gate.shape[1]):
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


class KernelSiluAndMul(SiluAndMul):
    """silu(gate) * up in one call of our kernel (its own exp: not torch's bits; beside our
    quantized products only). Row-wise, batch-invariant by construction."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return kernels.silu_mul(gate_up.contiguous())


def use_kernel_layers(model: nn.Module) -> int:
    """Swap the model's RMSNorms and SiluAndMuls for our kernels' (whole groups of 8 values only),
    in place; the number swapped."""
    swaps: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if type(m) is RMSNorm and m.weight.shape[0] % 8 == 0:
            norm = KernelRMSNorm(m.weight.shape[0], m.eps)
            norm.weight = m.weight
            swaps.append((name, norm))
        elif type(m) is SiluAndMul:
            swaps.append((name, KernelSiluAndMul()))
    for name, layer in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    return len(swaps)


class Rotary(nn.Module):
    """Rotary embedding (the rotate-half layout transformers' Llama uses) at each row's own
    position, which for a draft node is its prefix length plus its depth in the tree.
    `inv_freq` and `scaling` come from the model's rope config (llama3, linear, ... scaling).
    cos and sin come from a table computed once per position: a row's rotation has the same
    bits in any step, whatever the other rows' positions. The sin table carries the rotation's
    sign (-sin on the first half), so a rotation is two products and a sum over the halves
    swapped: the same bits as transformers' `x*cos + rotate_half(x)*sin`, in fewer ops."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = scaling
        self._cos = self._sin = torch.empty(0, 2 * inv_freq.numel())  # [P, D] float32, grown on demand

    def _grow(self, needed: int) -> None:
        size = max(256, 1 << (needed - 1).bit_length())
        positions = torch.arange(size, dtype=torch.float32, device=self.inv_freq.device)
        freqs = positions[:, None] * self.inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        sin = emb.sin() * self.scaling
        half = sin.shape[-1] // 2
        self._cos, self._sin = emb.cos() * self.scaling, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    def reserve(self, positions: int) -> None:
        """Tables for `positions` now: on CUDA the lookup then reads no size back from the device
        (a CUDA graph replays no Python decision); on CPU they grow on demand."""
        if self._cos.shape[0] < positions:
            self._grow(positions)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, D] for positions [T], looked up once per step for every layer."""
        self._reserve_for(positions)
        return self._cos[positions].to(dtype), self._sin[positions].to(dtype)

    def _reserve_for(self, positions: torch.Tensor) -> None:
        if positions.device.type == "cpu":
            self.reserve(int(positions.max()) + 1 if positions.numel() else 1)

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryStep:
        """The step's rotation, made once per step for every layer: cos and signed sin [T, D]."""
        return RotaryStep(*self.cos_sin(positions, dtype))

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [heads, T, D] (any strides, e.g. a head-major view of the q|k|v product) rotated,
        contiguous head-major [heads, T, D]: the layout the attention backends read. On CPU in
        float32 one call of our kernel where it runs (`kernels.rotary`: the same arithmetic, so
        the same bits as the torch ops below, which it saves four dispatches of)."""
        if x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] % 16 == 0 and kernels.available():
            return kernels.rotary(x, cos, sin)
        swapped = x.roll(x.shape[-1] // 2, -1)  # the halves swapped, contiguous [heads, T, D]: one op, not three
        return swapped.mul_(sin).add_(x * cos)  # in place: each new tensor costs as much as the arithmetic


class RotaryStep(NamedTuple):
    """A step's rotation on torch's ops (`Rotary.for_step`): every layer rotates its q and k by it."""

    cos: torch.Tensor  # [T, D] in the activations' dtype
    sin: torch.Tensor  # [T, D], signed (-sin on the first half)

    def split_heads(
        self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q|k|v product [T, (Hq + 2 Hkv) * D] -> q and k rotated, contiguous, and v, each
        [heads, T, D] (the backends' layout)."""
        t, hq, hkv = qkv.shape[0], num_heads, num_kv_heads
        qk, v = qkv.view(t, hq + 2 * hkv, head_dim).transpose(0, 1).split((hq + hkv, hkv))  # [heads, T, D] views
        r = self.cos.shape[-1]
        if r < head_dim:  # a partial rotary (Phi's): the first r dims of each head rotate, the rest pass
            qk = torch.cat((Rotary.apply(qk[..., :r], self.cos, self.sin), qk[..., r:]), dim=-1)
        else:
            qk = Rotary.apply(qk, self.cos, self.sin)  # [Hq + Hkv, T, D] contiguous: q and k in one rotation
        q, k = qk.split((hq, hkv))
        return q, k, v
