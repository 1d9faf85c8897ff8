"""Batch-invariant attention on CPU by construction, on our kernel (kernels/csrc/attention.cpp).

A row's output is a function of its query and its visible keys in logical order alone, computed
by one thread in one fixed order (the kernel's header says how), so a draft node gets the bits
its token gets when decoded alone. The host plans, once per step for every layer, each row's
visible keys as pool slots: a prefix of its request's slots in logical order (committed keys,
then the chunk rows up to itself, or for a draft node the whole chunk), then a tail (a draft
node's ancestors and itself, by depth). The kernel writes the step's keys and values to the
pool and attends in one call per layer: no gathered copies of the keys, no padded products."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from batchserve import kernels
from batchserve.attention.base import AttentionBackend, LayerAttention, StepLayout
from batchserve.attention.torch_ref import copy_pool_slots


@dataclass(frozen=True, slots=True)
class KernelMetadata:
    backend: KernelBackend
    slot_mapping: torch.Tensor  # [T] int64: where each row's key and value are written
    slots: torch.Tensor  # int32: every request's slots for its logical positions 0..kv_len, back to back
    prefix_at: torch.Tensor  # [T] int32: where a row's prefix starts in `slots`
    prefix_len: torch.Tensor  # [T] int32
    tails: torch.Tensor  # int32: draft nodes' ancestor-and-self slots, ordered by position, back to back
    tail_at: torch.Tensor  # [T] int32
    tail_len: torch.Tensor  # [T] int32
    num_tokens: int
    window: int | None = None  # the sliding window these rows were planned for (`plan_rows`)
    # The same step's rows for the model's other layers' windows (None: plain), each planned once.
    windowed: dict[int | None, KernelMetadata] = dataclasses.field(default_factory=dict)

    def for_window(self, window: int | None) -> KernelMetadata:
        return self if window == self.window else self.windowed[window]


def plan_rows(step: StepLayout, block_size: int, window: int | None = None) -> tuple[np.ndarray, ...]:
    """(slots, prefix_at, prefix_len, tails, tail_at, tail_len) of a step (`KernelMetadata`). A row's
    keys are its positions 0..p in order, so a sliding `window` drops the leading ones (p - window
    and before): its prefix starts later, and a deep draft node's tail too."""
    t = step.num_tokens
    prefix_at, prefix_len = np.zeros(t, np.int32), np.zeros(t, np.int32)
    tail_at, tail_len = np.zeros(t, np.int32), np.zeros(t, np.int32)
    slots: list[np.ndarray] = []
    tails: list[np.ndarray] = []
    base = tail_base = 0
    for i in range(len(step.q_len)):
        start, q = int(step.qo_indptr[i]), int(step.q_len[i])
        cached, chunk, kv = int(step.num_cached[i]), int(step.num_chunk[i]), int(step.kv_len[i])
        logical = np.arange(kv)
        own = step.pool_slots(i, logical, block_size)  # [kv]
        slots.append(own)
        rows = slice(start, start + q)
        prefix_at[rows] = base
        chunk_rows = min(chunk, q)
        prefix_len[start : start + chunk_rows] = cached + 1 + np.arange(chunk_rows)  # causal: itself included
        if q > chunk_rows:  # draft nodes (and window rows): the whole chunk, then their own visible rows
            spec = step.step_mask(i)[chunk:, chunk:]  # [n, n]
            order = np.argsort(step.row_positions(i)[chunk:], kind="stable")  # their keys in logical order
            row, col = np.nonzero(spec[:, order])  # row-major: each row's visible keys, in that order
            prefix_len[start + chunk : start + q] = cached + chunk
            counts = np.bincount(row, minlength=q - chunk)
            tail_len[start + chunk : start + q] = counts
            tail_at[start + chunk : start + q] = tail_base + np.concatenate(([0], np.cumsum(counts)[:-1]))
            tails.append(own[cached + chunk + order[col]])
            tail_base += int(counts.sum())
        if window is not None:
            positions = step.row_positions(i)
            cut = np.maximum(positions - window + 1, 0)  # [q]: the first position each row sees
            dropped = np.minimum(cut, prefix_len[rows])
            prefix_at[rows] += dropped.astype(np.int32)
            prefix_len[rows] -= dropped.astype(np.int32)
            if q > chunk_rows:
                tail_pos = positions[chunk + order[col]]  # each tail key's position, in order
                gone = np.bincount(row, weights=tail_pos < cut[chunk + row], minlength=q - chunk).astype(np.int32)
                tail_at[start + chunk : start + q] += gone
                tail_len[start + chunk : start + q] -= gone
        base += kv
    flat = np.concatenate(slots) if slots else np.zeros(0, np.int64)
    tail = np.concatenate(tails) if tails else np.zeros(1, np.int64)  # never empty: a valid pointer
    return flat.astype(np.int32), prefix_at, prefix_len, tail.astype(np.int32), tail_at, tail_len


class KernelBackend(AttentionBackend):
    """A head-major paged pool ([layers, Hkv, slots, D], float32, as the torch reference's) read
    in place by our kernel. Needs our CPU kernels (`kernels.available()`) and D % 8 == 0."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if not kernel_backend_runs(torch.device(device), dtype, head_dim):
            reason = kernels.unavailable_reason() or f"float32 on CPU, a head dim divisible by 8: {dtype} {head_dim}"
            raise ValueError(f"the kernel attention backend needs {reason}")
        self.block_size, self.num_blocks = block_size, num_blocks
        self.device = torch.device(device)
        self.timed = True  # it computes on the host's clock
        slots = num_blocks * block_size
        self.k_cache = torch.zeros(num_layers, num_kv_heads, slots, head_dim)
        self.v_cache = torch.zeros(num_layers, num_kv_heads, slots, head_dim)
        self._sinks: list[torch.Tensor | None] = []  # each layer's sinks [Hq] as the kernel reads them

    def set_layers(self, layers: tuple[LayerAttention, ...]) -> None:
        super().set_layers(layers)
        self._sinks = [None if s.sinks is None else torch.tensor(s.sinks, dtype=torch.float32) for s in self.layers]

    def build_metadata(self, step: StepLayout, slot_mapping: torch.Tensor) -> KernelMetadata:
        mapping = slot_mapping.to(torch.int64).contiguous()
        # Planned only for the windows some layer reads (a Mistral's every layer has one: no plain plan).
        needed: list[int | None] = [None] if self.unwindowed else []
        plans = [self._metadata(step, mapping, w) for w in (*needed, *self.windows)]
        first = plans[0]
        first.windowed.update((p.window, p) for p in plans[1:])
        return first

    def _metadata(self, step: StepLayout, mapping: torch.Tensor, window: int | None) -> KernelMetadata:
        planned = plan_rows(step, self.block_size, window)
        # The kernel indexes the pool with these unchecked: a slot outside it fails here, loudly.
        size = self.k_cache.shape[2]
        for slots in (planned[0], planned[3], mapping.numpy()):
            if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= size):
                raise ValueError(f"a K/V slot outside the pool of {size} slots")
        arrays = [torch.from_numpy(np.ascontiguousarray(a)) for a in planned]
        return KernelMetadata(self, mapping, *arrays, num_tokens=step.num_tokens, window=window)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: KernelMetadata, scale: float
    ) -> torch.Tensor:
        t0 = time.perf_counter()
        spec = self.layer(layer_idx)
        plan = metadata.for_window(spec.window)
        pool = self.k_cache[layer_idx], self.v_cache[layer_idx]
        sinks = self._sinks[layer_idx] if self._sinks else None
        out = kernels.attention(q, k, v, plan, *pool, scale, spec.softcap or 0.0, sinks)
        self.seconds += time.perf_counter() - t0
        return out  # [T, Hq, D]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        copy_pool_slots((self.k_cache, self.v_cache), src, dst)


def kernel_backend_runs(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel backend can run a model of this device, dtype and head dim here."""
    return device.type == "cpu" and dtype == torch.float32 and head_dim % 8 == 0 and kernels.available()
