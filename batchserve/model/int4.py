"""The GGUF file's quantized blocks as stored: its Q4_1 layers through torch's int4 kernel (a
quarter of float32's bytes a step), its Q8_0 token embedding looked up row by row."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from batchserve.model.layers import in_checked_rows
from batchserve.model.llama import product_out_dtype
from batchserve.model.quant import Q4Linear, Q8Blocks, Q8Embedding, Q8Linear, fits
from batchserve.model.row_check import rows_variance

GROUP = 32  # values per Q4_1 block (and per int4 scale/zero group)
# GGUF tensor name (per layer) -> (our module under layers.{i}, part of it, rows permuted like heads of ...)
GGUF_LAYERS = {
    "attn_q": ("self_attn.qkv_proj", 0, "num_attention_heads"),
    "attn_k": ("self_attn.qkv_proj", 1, "num_key_value_heads"),
    "attn_v": ("self_attn.qkv_proj", 2, None),
    "attn_output": ("self_attn.o_proj", 0, None),
    "ffn_gate": ("mlp.gate_up_proj", 0, None),
    "ffn_up": ("mlp.gate_up_proj", 1, None),
    "ffn_down": ("mlp.down_proj", 0, None),
}


def decode_q4_1(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [rows, cols] uint8 in 0..15, d, m [rows, cols/32] float32) of Q4_1 blocks
    [rows, cols/32 * 20] bytes: each block is d, m (float16) and 32 4-bit values, the first 16
    in the low nibbles; a value is d * q + m."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // GROUP, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:]
    q = np.concatenate((packed & 0x0F, packed >> 4), axis=-1).reshape(rows, cols)
    return q, d, m


def unpermute_rows(x: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k projection rows in its rotary order: back to transformers' (per head,
    the interleaved pairs of halves)."""
    half = x.shape[0] // heads // 2
    return x.reshape(heads, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


class Int4Linear(nn.Module):
    """A linear layer over Q4_1 weights as stored, on `_weight_int4pack_mm_for_cpu`: a block's
    `d*q + m` is `(q - 8) * d + (m + 8d)`, the kernel's scale and zero (rounded to bfloat16).
    Activations enter in bfloat16 (the kernel's only vectorized path) and leave in float32. A
    row's result has the same bits whatever the number of rows (`int4_products_invariant`)."""

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
        self.sizes = sizes
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1)
        self.register_buffer("weight", packed)
        scale_zero = np.stack((d, m + 8 * d), axis=-1).transpose(1, 0, 2)  # [K/32, N, 2]
        self.register_buffer("scale_zero", torch.from_numpy(np.ascontiguousarray(scale_zero)).to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self.out_dtype = torch.float32 if bias is not None else out_dtype  # as Bf16Linear's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = in_checked_rows(x.to(torch.bfloat16), self._mm)
        if self.out_dtype is not torch.bfloat16:  # [T, N]; a call that changes nothing still costs a dispatch
            out = out.to(self.out_dtype)
        return out if self.bias is None else out + self.bias

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, GROUP, self.scale_zero)  # [T, N]

    def extra_repr(self) -> str:
        out = str(self.out_dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, Q4_1 as int4, {out} out"


def decode_q8_0(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(q [rows, cols] int8, d [rows, cols/32] float32) of Q8_0 blocks [rows, cols/32 * 34]
    bytes: each block is d (float16) and 32 int8 values; a value is d * q."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // GROUP, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return q, d


def _q8_blocks(gguf_path: str | Path, name: str, weight: torch.Tensor, what: str) -> Q8Blocks | None:
    """The file's Q8_0 tensor `name` as `Q8Blocks`, checked value for value against `weight`
    (what transformers loaded from the same file); None where the file does not store it so."""
    import gguf

    t = gguf_tensors(gguf_path).get(name)
    if t is None or t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
        return None
    cols, rows = (int(n) for n in t.shape)
    q, d = decode_q8_0(t.data, rows, cols)
    stored = torch.from_numpy(q.astype(np.float32) * np.repeat(d, GROUP, axis=1))
    if weight.shape != stored.shape or not torch.equal(weight.detach().float(), stored):
        raise ValueError(f"the GGUF's Q8_0 {name} does not match the loaded {what}")
    return Q8Blocks(q, d)


@torch.no_grad()
def load_gguf_embedding(model: nn.Module, gguf_path: str | Path) -> Q8Blocks | None:
    """Swap the native model's token embedding for a `Q8Embedding` of the GGUF's own Q8_0 blocks,
    in place, where the file stores it so; the blocks (None: nothing swapped). Every value must
    equal the weight transformers loaded from the same file. The LM head keeps its own weight
    unless `load_gguf_head` puts it on the same blocks."""
    blocks = _q8_blocks(gguf_path, "token_embd.weight", model.embed_tokens.weight, "token embedding")  # type: ignore[union-attr]
    if blocks is not None:
        model.embed_tokens = Q8Embedding(blocks)
    return blocks


@torch.no_grad()
def load_gguf_head(model: nn.Module, gguf_path: str | Path, embedding: Q8Blocks | None) -> bool:
    """Swap the LM head for a `Q8Linear` over the file's Q8_0 blocks where it stores them: its
    own `output.weight`, or for a tied head the embedding's blocks (one copy for both); whether
    it did."""
    head = model.lm_head  # type: ignore[union-attr]
    blocks = _q8_blocks(gguf_path, "output.weight", head.weight, "LM head")
    if blocks is None and "output.weight" not in gguf_tensors(gguf_path) and embedding is not None:
        if not torch.equal(head.weight.detach().float(), embedding.lookup(torch.arange(embedding.rows))):
            raise ValueError("the tied LM head does not match the GGUF's token embedding")
        blocks = embedding
    if blocks is None or getattr(head, "bias", None) is not None:
        return False
    model.lm_head = Q8Linear(blocks)
    return True


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@functools.cache
def int4_products_invariant() -> bool:
    """Whether the int4 kernel gives every row the same bits in calls of every row count and at
    every place in the call on this CPU (`row_check`)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 256), generator=gen).numpy().astype(np.uint8)
    d = torch.rand(64, 8, generator=gen).numpy() / 8
    layer = Int4Linear(q, d, -8 * d, None, (64,))
    x = torch.randn(2048, 256, generator=gen)
    return rows_variance(layer, x, (1, 2, 3, 5, 8, 17, 20, 40, 64, 128, 300, 512, 2048)) is None


def int4_fast_here() -> bool:
    """Whether the Q4_1 path is the fast invariant one on this CPU: torch has the int4 kernel,
    its vectorized (AVX2 or AVX-512) bfloat16 path runs here, and it is batch-invariant."""
    vectorized = torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX")
    return int4_available() and vectorized and int4_products_invariant()


def gguf_tensors(gguf_path: str | Path) -> dict[str, Any]:
    """The file's tensors by name (memory-mapped: data is read when used). Parsing a header
    costs seconds (gguf's reader walks the whole vocabulary), so the last file's is kept."""
    st = Path(gguf_path).stat()
    return _tensors(str(Path(gguf_path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _tensors(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    import gguf

    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def gguf_has_q4_1(gguf_path: str | Path) -> bool:
    """Whether a GGUF file stores its first layer's products as Q4_1."""
    import gguf

    first = {name: t.tensor_type for name, t in gguf_tensors(gguf_path).items() if name.startswith("blk.0.")}
    return bool(first) and all(
        first.get(f"blk.0.{name}.weight") == gguf.GGMLQuantizationType.Q4_1 for name in GGUF_LAYERS
    )


@torch.no_grad()
def load_gguf_int4(model: nn.Module, gguf_path: str | Path, layer_class: type[nn.Module] = Int4Linear) -> int:
    """Swap the native model's layer products (still `nn.Linear`s: before `pack_linears`) for
    `layer_class`es (`Int4Linear`: torch's kernel; `Q4Linear`: ours) of the GGUF's own Q4_1
    blocks, in place; the number swapped (from the first
    layer whose tensors are not all Q4_1 on, layers stay as they are). Each block's `d*q + m`
    must equal the weight transformers loaded from the same file (a wrong name or row order
    fails loudly, not quietly); every layer is checked before any is swapped, so a failure
    leaves the model as it was."""
    import gguf

    config: Any = model.config  # type: ignore[assignment]
    tensors = gguf_tensors(gguf_path)
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    for i, layer in enumerate(model.layers):  # type: ignore[union-attr]
        parts: dict[str, list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]] = {}
        for name, (module, part, heads) in GGUF_LAYERS.items():
            t = tensors.get(f"blk.{i}.{name}.weight")
            if t is None or t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
                parts = {}
                break
            cols, rows = (int(n) for n in t.shape)
            q, d, m = decode_q4_1(t.data, rows, cols)
            if heads is not None:
                n_heads = getattr(config, heads)
                q, d, m = (unpermute_rows(x, n_heads) for x in (q, d, m))
            parts.setdefault(module, []).append((part, q, d, m))
        if not parts:
            break
        for module, pieces in parts.items():
            pieces.sort(key=lambda p: p[0])
            swaps.append((layer, module, _int4_of(layer, module, pieces, layer_class)))
    for layer, module, int4 in swaps:
        parent, _, child = module.rpartition(".")
        setattr(layer.get_submodule(parent), child, int4)
    return len(swaps)


def _int4_of(
    layer: nn.Module,
    module: str,
    pieces: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]],
    layer_class: type[nn.Module],
) -> nn.Module:
    old = layer.get_submodule(module)
    q, d, m = (np.concatenate([p[k] for p in pieces]) for k in (1, 2, 3))
    weight = old.weight.detach().float()  # what transformers dequantized from the same blocks
    stored = torch.from_numpy(np.repeat(d, GROUP, axis=1) * q + np.repeat(m, GROUP, axis=1))
    if weight.shape != stored.shape or not torch.equal(weight, stored):
        raise ValueError(f"the GGUF's Q4_1 blocks do not match {module}'s loaded weight")
    sizes = getattr(old, "sizes", (q.shape[0],))
    if layer_class is Q4Linear and not fits(*q.shape):
        layer_class = Int4Linear  # our kernel takes whole column groups only
    return layer_class(q, d, m, getattr(old, "bias", None), sizes, product_out_dtype(module))
