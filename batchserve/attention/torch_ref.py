"""PyTorch reference attention over the paged pool (CPU path and test oracle)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from batchserve.attention.base import AttentionBackend, StepLayout

# Cost model for splitting a step's requests into padded SDPA batches, in units of one
# (query row, key) pair: gathering a key from the pool costs about GATHER_COST pairs, and each
# extra batch (one more gather + SDPA + scatter per layer) about BATCH_COST pairs.
GATHER_COST = 2.0
BATCH_COST = 2048.0


def partition(q_len: np.ndarray, kv_len: np.ndarray) -> list[np.ndarray]:
    """Split requests (by index) into padded batches that minimize the modeled work.

    Requests sorted by rows are cut into runs; a run's padded work is its size times its
    longest KV times (its most rows + GATHER_COST). Cuts go only between distinct row counts,
    so this exact DP is quadratic in the number of distinct draft lengths, not of requests.
    One long prompt chunk thus never pads every decode row to its size, and a few requests
    with deep drafts do not pad the many without.
    """
    if not len(q_len):
        return []
    order = np.argsort(q_len, kind="stable")
    q, kv = q_len[order].tolist(), kv_len[order].tolist()
    # Runs of equal row count: run r is order[starts[r] : starts[r + 1]].
    starts = [0] + [i for i in range(1, len(q)) if q[i] != q[i - 1]] + [len(q)]
    num_runs = len(starts) - 1
    run_kv = [max(kv[starts[r] : starts[r + 1]]) for r in range(num_runs)]
    best = [0.0] + [float("inf")] * num_runs  # best[k]: cheapest split of runs [0, k)
    cut = [0] * (num_runs + 1)  # the first run of the last batch in that split
    for k in range(1, num_runs + 1):
        max_q, max_kv = q[starts[k] - 1], 0
        for j in range(k - 1, -1, -1):  # last batch = runs [j, k)
            max_kv = max(max_kv, run_kv[j])
            cost = best[j] + BATCH_COST + (starts[k] - starts[j]) * max_kv * (max_q + GATHER_COST)
            if cost < best[k]:
                best[k], cut[k] = cost, j
    groups = []
    k = num_runs
    while k:
        groups.append(order[starts[cut[k]] : starts[k]])
        k = cut[k]
    return groups[::-1]


@dataclass(frozen=True, slots=True)
class _Group:
    """Requests attended together as one padded batch."""

    kv_slots: torch.Tensor  # [B, max_kv] pool slots (padding points at slot 0, masked out)
    q_rows: torch.Tensor  # [B, max_q] rows of the packed step (padding repeats row 0)
    mask: torch.Tensor  # [B, 1, max_q, max_kv] bool
    out_rows: torch.Tensor  # [n_valid] packed rows this group produces
    valid: torch.Tensor  # [n_valid] indices into the flattened [B * max_q] output


@dataclass(frozen=True, slots=True)
class TorchMetadata:
    backend: TorchReferenceBackend
    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    groups: tuple[_Group, ...]
    num_tokens: int


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
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, Hkv, D]
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.device = torch.device(device)

    def build_metadata(self, step: StepLayout, slot_mapping: torch.Tensor) -> TorchMetadata:
        q_len, kv_len = step.q_len, step.kv_len
        groups = tuple(self._group(step, idx, q_len, kv_len) for idx in partition(q_len, kv_len))
        return TorchMetadata(self, slot_mapping.to(self.device), groups, step.num_tokens)

    def _group(self, step: StepLayout, idx: np.ndarray, q_len: np.ndarray, kv_len: np.ndarray) -> _Group:
        q = q_len[idx]
        max_q, max_kv = int(q.max()), int(kv_len[idx].max())
        offsets = np.arange(max_q)
        valid = offsets[None, :] < q[:, None]  # [B, max_q]
        q_rows = np.where(valid, step.qo_indptr[idx][:, None] + offsets, 0)  # padding repeats row 0
        mask = step.padded_masks(idx, max_q, max_kv)
        mask[:, :, 0] |= ~valid  # padding rows see one (ignored) key, so softmax stays finite
        flat_valid = np.flatnonzero(valid)
        dev = self.device
        return _Group(
            kv_slots=torch.from_numpy(step.kv_slots(idx, max_kv, self.block_size)).to(dev),
            q_rows=torch.from_numpy(q_rows).to(dev),
            mask=torch.from_numpy(mask).unsqueeze(1).to(dev),
            out_rows=torch.from_numpy(q_rows.reshape(-1)[flat_valid]).to(dev),
            valid=torch.from_numpy(flat_valid).to(dev),
        )

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: TorchMetadata, scale: float
    ) -> torch.Tensor:
        k_cache, v_cache = self.k_cache[layer_idx], self.v_cache[layer_idx]  # [slots, Hkv, D]
        k_cache.index_copy_(0, metadata.slot_mapping, k[0].transpose(0, 1))  # [T, Hkv, D]
        v_cache.index_copy_(0, metadata.slot_mapping, v[0].transpose(0, 1))
        num_heads, head_dim = q.shape[1], q.shape[3]
        out = q.new_empty(metadata.num_tokens, num_heads, head_dim)  # [T, Hq, D]
        for g in metadata.groups:
            qg = q[0][:, g.q_rows].transpose(0, 1)  # [B, Hq, max_q, D]
            kg = k_cache[g.kv_slots].transpose(1, 2)  # [B, Hkv, max_kv, D]
            vg = v_cache[g.kv_slots].transpose(1, 2)
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=True)
            og = og.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [B * max_q, Hq, D]
            out.index_copy_(0, g.out_rows, og[g.valid])
        return out.unsqueeze(0)  # [1, T, Hq, D]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        src, dst = src.to(self.device), dst.to(self.device)
        # Advanced indexing gathers before it scatters, so overlapping src/dst are safe.
        self.k_cache[:, dst] = self.k_cache[:, src]
        self.v_cache[:, dst] = self.v_cache[:, src]
