"""PyTorch attention over the paged pool: the CPU path and the test oracle.

Each request attends on its own, over *views* of the pool wherever its K/V is contiguous, so a
step costs what it computes, not a copy of every request's whole K/V padded to the longest.
The pool is head-major ([layers, Hkv, slots, D]) so that a run of consecutive slots is, per
head, one contiguous matrix that SDPA and BLAS read in place. The allocator keeps a request's
blocks in few runs (`BlockAllocator.allocate(after=...)`); per request:

- one run: SDPA over the view;
- a few runs and few rows (decode, drafts): scores against each run, one softmax over their
  concatenation, then the runs' values weighted in place. Nothing is copied but the scores;
- otherwise (many runs, or a long prompt chunk whose arithmetic dwarfs a copy): gather the
  request's K/V once per layer, unpadded, and SDPA over it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from batchserve.attention.base import AttentionBackend, StepLayout

# A request in more runs than this is gathered: per-run matmuls cost a few ops each per layer.
MAX_RUNS = 8
# Above this many rows, per-run scores (rows x keys, materialized) cost more than one copy of
# the keys, and SDPA's fused kernel wins.
MAX_RUN_ROWS = 8


@dataclass(frozen=True, slots=True)
class _Seq:
    """How one request attends this step."""

    start: int  # its rows are [start, stop) of the packed step
    stop: int
    runs: tuple[tuple[int, int], ...]  # (first slot, slots) of its K/V, in logical order
    gather: torch.Tensor | None  # [kv_len] its slots, when it attends over a copy
    mask: torch.Tensor | None  # [q_len, kv_len] bool (True: may attend); None: every row sees every key
    step_mask: torch.Tensor | None  # [q_len, q_len] bool: the same, over this step's keys only


@dataclass(frozen=True, slots=True)
class TorchMetadata:
    backend: TorchReferenceBackend
    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    seqs: tuple[_Seq, ...]
    num_tokens: int
    windowed: dict[int, tuple[_Seq, ...]]  # the same requests under each sliding window of the layers


def slot_runs(blocks: np.ndarray, kv_len: int, block_size: int) -> list[tuple[int, int]]:
    """(first slot, slots) runs covering KV indices [0, kv_len) of a block table."""
    used = blocks[: -(-kv_len // block_size)]
    breaks = np.flatnonzero(np.diff(used) != 1) + 1  # a run starts where the next block is not adjacent
    firsts = np.concatenate(([0], breaks))
    lasts = np.concatenate((breaks, [len(used)]))
    runs = []
    for f, e in zip(firsts.tolist(), lasts.tolist()):
        start = int(used[f]) * block_size
        runs.append((start, min((e - f) * block_size, kv_len - f * block_size)))
    return runs


class TorchReferenceBackend(AttentionBackend):
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
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)  # [L, Hkv, slots, D]
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.device = torch.device(device)
        self.timed = self.device.type == "cpu"  # on CUDA the host clock sees only launches

    def build_metadata(self, step: StepLayout, slot_mapping: torch.Tensor) -> TorchMetadata:
        requests = range(len(step.q_len))
        seqs = tuple(self._seq(step, i) for i in requests)
        windowed = {w: tuple(self._seq(step, i, w) for i in requests) for w in self.windows}
        return TorchMetadata(self, slot_mapping.to(self.device), seqs, step.num_tokens, windowed)

    def _seq(self, step: StepLayout, i: int, window: int | None = None) -> _Seq:
        start, stop = int(step.qo_indptr[i]), int(step.qo_indptr[i + 1])
        q_len, kv_len = stop - start, int(step.kv_len[i])
        runs = slot_runs(step.block_table[i], kv_len, self.block_size)
        mask = step_mask = None
        full = np.ones((q_len, kv_len), dtype=bool)
        if q_len > 1:
            own = step.step_mask(i)  # [q_len, q_len]
            if not own.all():
                full[:, kv_len - q_len :] = own
                mask = torch.from_numpy(full).to(self.device)
                step_mask = torch.from_numpy(own).to(self.device)
        inside = step.in_window(i, window)
        if inside is not None:  # the whole mask: a row's window may end anywhere in the prefix
            mask, step_mask = torch.from_numpy(full & inside).to(self.device), None
        gather = None
        if inside is not None or len(runs) > MAX_RUNS or (len(runs) > 1 and q_len > MAX_RUN_ROWS):
            slots = np.concatenate([np.arange(s, s + n) for s, n in runs])
            gather = torch.from_numpy(slots).to(self.device)
        return _Seq(start, stop, tuple(runs), gather, mask, step_mask)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: TorchMetadata, scale: float
    ) -> torch.Tensor:
        t0 = time.perf_counter()
        k_cache, v_cache = self.k_cache[layer_idx], self.v_cache[layer_idx]  # [Hkv, slots, D]
        k_cache.index_copy_(1, metadata.slot_mapping, k)  # k: [Hkv, T, D]
        v_cache.index_copy_(1, metadata.slot_mapping, v)
        num_heads, head_dim = q.shape[0], q.shape[2]
        out = q.new_empty(num_heads, metadata.num_tokens, head_dim)  # [Hq, T, D]
        spec = self.layer(layer_idx)
        for s in metadata.seqs if spec.window is None else metadata.windowed[spec.window]:
            qs = q[:, s.start : s.stop]  # [Hq, q_len, D]
            if spec.softcap is not None or spec.sinks is not None:  # SDPA has neither: the scores written out
                slots = s.gather if s.gather is not None else _run_slots(s.runs, self.device)
                ks, vs = k_cache.index_select(1, slots), v_cache.index_select(1, slots)
                out[:, s.start : s.stop] = _attend_explicit(qs, ks, vs, s.mask, scale, spec.softcap, spec.sinks)
                continue
            if s.gather is not None:
                ks, vs = k_cache.index_select(1, s.gather), v_cache.index_select(1, s.gather)  # [Hkv, kv_len, D]
            elif len(s.runs) == 1:
                first, n = s.runs[0]
                ks, vs = k_cache[:, first : first + n], v_cache[:, first : first + n]  # views
            else:
                out[:, s.start : s.stop] = _attend_runs(qs, k_cache, v_cache, s, scale)
                continue
            o = F.scaled_dot_product_attention(
                qs[None], ks[None], vs[None], attn_mask=s.mask, scale=scale, enable_gqa=True
            )
            out[:, s.start : s.stop] = o[0]
        self.seconds += time.perf_counter() - t0
        return out.transpose(0, 1)  # [T, Hq, D]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        copy_pool_slots((self.k_cache, self.v_cache), src, dst)


def _run_slots(runs: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([np.arange(s, s + n) for s, n in runs])).to(device)


def _attend_explicit(
    qs: torch.Tensor,
    ks: torch.Tensor,
    vs: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: tuple[float, ...] | None,
) -> torch.Tensor:
    """[Hq, q_len, D]: one request's rows over its keys and values [Hkv, kv_len, D], each scaled
    score s capped to softcap * tanh(s / softcap) before the mask (Gemma 2's attention), and each
    head's sink logit in its softmax (gpt-oss's: a column with no value, as transformers adds it)."""
    group = qs.shape[0] // ks.shape[0]
    ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)  # [Hq, kv_len, D]
    scores = torch.bmm(qs, ks.transpose(1, 2)) * scale  # [Hq, q_len, kv_len]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.bmm(torch.softmax(scores, dim=-1), vs)
    sink = torch.tensor(sinks, dtype=scores.dtype, device=scores.device)[:, None, None].expand(-1, scores.shape[1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]  # [Hq, q_len, kv_len]
    return torch.bmm(probs, vs)


def copy_pool_slots(caches: tuple[torch.Tensor, ...], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Move slots `src` to `dst` in head-major pools [L, Hkv, slots, ...] (draft compaction)."""
    for cache in caches:
        # Advanced indexing gathers before it scatters, so overlapping src/dst are safe.
        cache[:, :, dst.to(cache.device)] = cache[:, :, src.to(cache.device)]


def _attend_runs(qs: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, s: _Seq, scale: float) -> torch.Tensor:
    """[Hq, q_len, D] attention of one request's few rows over K/V in several runs, in place."""
    num_heads, q_len, head_dim = qs.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    # Query head h reads KV head h // group: fold each group's heads into rows.
    qf = qs.reshape(num_kv_heads, group * q_len, head_dim)  # [Hkv, G * q_len, D]
    scores = torch.cat([torch.bmm(qf, k_cache[:, f : f + n].transpose(1, 2)) for f, n in s.runs], dim=-1)
    scores.mul_(scale)  # [Hkv, G * q_len, kv_len]
    if s.step_mask is not None:
        kv_len = scores.shape[-1]
        own = scores.view(num_kv_heads, group, q_len, kv_len)[..., kv_len - q_len :]
        own.masked_fill_(~s.step_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = None
    offset = 0
    for f, n in s.runs:
        part = torch.bmm(probs[..., offset : offset + n], v_cache[:, f : f + n])  # [Hkv, G * q_len, D]
        out = part if out is None else out.add_(part)
        offset += n
    assert out is not None
    return out.view(num_heads, q_len, head_dim)
