"""The kernels a native model's norm, silu*up and rotary layers run on: torch's ops or FlashInfer's.

Chosen once when the model is built (`choose_layer_kernels`); `LayerKernels` then builds the layers
of that choice: torch's from `batchserve.model.layers`, FlashInfer's fused ones from here. Tensors
are a step's packed rows, as in `batchserve.model.layers`: [T, ...], no batch dimension."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from batchserve.model.layers import RMSNorm, Rotary, SiluAndMul

# FlashInfer's fused layer ops: one kernel each where torch's ops take several (a bfloat16 RMSNorm with
# its residual add is 9 of torch's kernels, the rotation 4, silu*up 2). Its kernels round once, in
# float32, where torch's round between ops, so their bits are not torch's: used on CUDA only, in
# float16/bfloat16 (the only dtypes they take). The functions come from `flashinfer` or a stand-in
# with the same signatures (the CPU tests'): `library.norm.rmsnorm`, `library.norm.fused_add_rmsnorm`,
# `library.activation.silu_and_mul`, `library.rope.apply_rope_with_cos_sin_cache_inplace`.


class FlashInferRMSNorm(RMSNorm):
    """RMSNorm with the residual add fused in, one FlashInfer kernel per call: `norm(x)` ->
    normed; `norm(x, residual)` -> (normed, x + residual), computed in place.

    NOTE: `norm(x, residual)` overwrites both: `residual` with the sum and `x` with the normed rows,
    and returns them. The layers pass tensors nothing reads afterwards (a product's fresh output and
    the running residual)."""

    def __init__(self, hidden_size: int, eps: float, library: Any) -> None:
        super().__init__(hidden_size, eps)
        self._rmsnorm = library.norm.rmsnorm
        self._fused_add_rmsnorm = library.norm.fused_add_rmsnorm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._rmsnorm(x, self.weight, self.eps)  # [T, H]
        self._fused_add_rmsnorm(x, residual, self.weight, self.eps)  # residual += x; x = norm(residual)
        return x, residual


class FlashInferSiluAndMul(SiluAndMul):
    """silu(gate) * up over a merged [T, 2I] gate|up output -> [T, I], one FlashInfer kernel."""

    def __init__(self, library: Any) -> None:
        super().__init__()
        self._silu_and_mul = library.activation.silu_and_mul

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(gate_up)


class FlashInferRotary(Rotary):
    """Rotary embedding in one FlashInfer kernel per layer, q and k rotated in place inside the q|k|v
    product, from a float32 table of cos and sin per position (FlashInfer's cos_sin_cache: cos of
    the D/2 frequencies, then their sin), built from the same tables as `Rotary`'s."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, library: Any) -> None:
        super().__init__(inv_freq, scaling)
        self._rotate = library.rope.apply_rope_with_cos_sin_cache_inplace
        self._cos_sin = torch.empty(0, 2 * inv_freq.numel())  # [P, D] float32, grown with the tables

    def _grow(self, needed: int) -> None:
        super()._grow(needed)
        half = self._cos.shape[-1] // 2
        # The tables repeat the frequencies over both halves: the first half's cos, the second's (unsigned) sin.
        self._cos_sin = torch.cat((self._cos[:, :half], self._sin[:, half:]), dim=-1).contiguous()

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> FlashInferRotaryStep:  # type: ignore[override]
        """The step's rotation: its positions and the table (nothing computed per step)."""
        self._reserve_for(positions)
        return FlashInferRotaryStep(positions, self._cos_sin, self._rotate)


class FlashInferRotaryStep(NamedTuple):
    """A step's rotation on FlashInfer's kernel (`FlashInferRotary.for_step`)."""

    positions: torch.Tensor  # [T] int64, each row's position
    cos_sin: torch.Tensor  # [P, D] float32: cos, then sin, of each position's D/2 angles
    rotate: Callable[..., None]  # flashinfer.rope.apply_rope_with_cos_sin_cache_inplace

    def split_heads(
        self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q|k|v product [T, (Hq + 2 Hkv) * D], its q and k rotated in place (one kernel) ->
        q, k and v as [heads, T, D] views of it (the backends' layout)."""
        t, hq, hkv, d = qkv.shape[0], num_heads, num_kv_heads, head_dim
        q, k = qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d]  # [T, Hq * D], [T, Hkv * D] views
        self.rotate(self.positions, q, k, d, self.cos_sin, True)  # is_neox: the rotate-half layout
        heads = qkv.view(t, hq + 2 * hkv, d).transpose(0, 1)  # [heads, T, D] view
        q, k, v = heads.split((hq, hkv, hkv))
        return q, k, v


# Head dims FlashInfer's rotary kernel is compiled for.
FLASHINFER_ROPE_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True, slots=True)
class LayerKernels:
    """The kernels a native model's decoder layers (and its final norm) run on, chosen once when the
    model is built (`choose_layer_kernels`): a layer class per choice, `RMSNorm`, `SiluAndMul` and
    `Rotary` on torch's ops, or `FlashInferRMSNorm`, `FlashInferSiluAndMul` and `FlashInferRotary`
    on FlashInfer's fused kernels. The q|k|v and gate|up products are one product each either way."""

    name: str  # torch or flashinfer
    why: str  # for the start-up log and GetModelInfo (the forward's `fused` part)
    device: str  # the device type it was chosen for
    library: Any = None  # flashinfer (its norm, activation and rope modules), or a stand-in with their functions

    def norm(self, hidden_size: int, eps: float) -> RMSNorm:
        if self.name == "flashinfer":
            return FlashInferRMSNorm(hidden_size, eps, self.library)
        return RMSNorm(hidden_size, eps)

    def act(self) -> SiluAndMul:
        return FlashInferSiluAndMul(self.library) if self.name == "flashinfer" else SiluAndMul()

    def rotary(self, inv_freq: torch.Tensor, scaling: float) -> Rotary:
        if self.name == "flashinfer":
            return FlashInferRotary(inv_freq, scaling, self.library)
        return Rotary(inv_freq, scaling)


TORCH_LAYERS = LayerKernels("torch", "torch's ops", "cpu")


def flashinfer_layers(library: Any, why: str, device: str = "cuda") -> LayerKernels:
    """The FlashInfer choice over `library` (flashinfer, or a stand-in with its functions)."""
    return LayerKernels("flashinfer", why, device, library)


def load_flashinfer() -> Any:
    """The `flashinfer` package with the modules the layers call (raises where it cannot be imported)."""
    import flashinfer.activation
    import flashinfer.norm
    import flashinfer.rope

    return flashinfer


def choose_layer_kernels(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    intermediate_size: int,
    load: Callable[[], Any] = load_flashinfer,
) -> LayerKernels:
    """FlashInfer's fused layer ops on CUDA in float16/bfloat16 where flashinfer imports and its
    kernels take the model's shape; torch's ops elsewhere (on the CPU always: their bits are the ones
    the tests hold to transformers and to batch invariance), each with the reason."""
    if device.type != "cuda":
        return LayerKernels("torch", f"on {device.type}: torch's ops (transformers' arithmetic)", device.type)

    def torch_ops(why: str) -> LayerKernels:
        return LayerKernels("torch", f"torch's ops: {why}", device.type)

    if dtype not in (torch.float16, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        return torch_ops(f"FlashInfer's layer ops take float16/bfloat16, the model is {name}")
    if head_dim not in FLASHINFER_ROPE_HEAD_DIMS:
        return torch_ops(f"FlashInfer's rotary kernel takes head dims {FLASHINFER_ROPE_HEAD_DIMS}, not {head_dim}")
    if intermediate_size * torch.finfo(dtype).bits % 64:
        return torch_ops(f"FlashInfer's silu*up needs 16-byte rows; intermediate size {intermediate_size}")
    try:
        library = load()
    except Exception as e:  # not installed, or it does not import here: the layers run torch's ops
        return torch_ops(f"flashinfer does not import ({type(e).__name__}: {e})")
    why = "CUDA in 16-bit floats with flashinfer: residual add + RMSNorm, silu*up and rotary one kernel each"
    return flashinfer_layers(library, why, device.type)
