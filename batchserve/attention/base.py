"""The attention backend interface and the backend-agnostic layout of one step."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from batchserve.trees import ancestor_mask, spec_mask, window_layout


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What one layer's attention applies beyond the step's mask (Gemma's, Mistral's, gpt-oss's options)."""

    window: int | None = None  # sliding window: a query at position p sees keys at p - window + 1 .. p
    softcap: float | None = None  # scores s (scaled) -> softcap * tanh(s / softcap), before the mask
    # Each query head's sink (gpt-oss): a learned logit in its softmax's max and denominator, with no value.
    sinks: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must hold at least one key, got {self.window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"a logit soft-cap must be positive, got {self.softcap}")
        if self.sinks is not None and not all(math.isfinite(s) for s in self.sinks):
            raise ValueError("attention sinks must be finite")


PLAIN = LayerAttention()


@dataclass(frozen=True, slots=True)
class SeqLayout:
    """One request's rows in the packed step, described without tensors of the pool."""

    q_start: int  # first row of this request in the packed [T] batch
    q_len: int  # rows: prompt chunk / last token, then draft nodes
    num_cached: int  # K/V slots filled before this step (the committed prefix)
    num_chunk: int  # committed tokens computed this step (causal among themselves)
    draft_parents: tuple[int | None, ...]  # parent of each draft node (None: child of the chunk's last token)
    block_ids: tuple[int, ...]  # the request's block table
    window: tuple[int, int] = (0, 0)  # (levels, width) of the Jacobi window rows after the draft nodes

    @property
    def kv_len(self) -> int:
        """Keys this request's rows may see: prefix plus every token of this step."""
        return self.num_cached + self.q_len

    def mask(self) -> torch.Tensor:
        """[q_len, kv_len] bool, True = may attend.

        Chunk rows are causal over prefix + chunk; a draft node sees the prefix, the whole
        chunk (its root is the chunk's last token), its ancestors and itself.
        """
        alone = StepLayout.from_seqs([replace(self, q_start=0)])
        return torch.from_numpy(alone.flat_masks().reshape(self.q_len, self.kv_len))


@dataclass(frozen=True, slots=True)
class StepLayout:
    """The whole packed step as host arrays: what every backend plans from.

    Request i owns rows [qo_indptr[i], qo_indptr[i + 1]): first its `num_chunk` committed
    tokens (causal among themselves), then its draft nodes (a tree hanging off the last chunk
    token), then any window rows. Every row sees the request's `num_cached` prefix slots.
    """

    qo_indptr: np.ndarray  # [B + 1] int64
    num_cached: np.ndarray  # [B] int64: K/V slots filled before this step
    num_chunk: np.ndarray  # [B] int64: committed tokens computed this step
    num_blocks: np.ndarray  # [B] int64: length of each request's block table
    block_table: np.ndarray  # [B, W] int64: block tables (W >= max num_blocks; entries past num_blocks unused)
    # Per request: [n, n] over its rows after the chunk (draft nodes: ancestor-or-self; window
    # rows: their own pattern; the two never see each other). None: no such rows.
    spec_masks: tuple[np.ndarray | None, ...]
    positions: np.ndarray | None = None  # [T] int64: each row's position (RoPE's); None: see row_positions

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def q_len(self) -> np.ndarray:  # [B]
        return np.diff(self.qo_indptr)

    @property
    def causal(self) -> bool:
        """Every row is a committed token (no draft or window rows): each request's rows are causal
        over its keys, aligned to their end, so the step needs no mask."""
        return all(m is None for m in self.spec_masks)

    @property
    def kv_len(self) -> np.ndarray:  # [B]: keys each request's rows may see (prefix + this step)
        return self.num_cached + self.q_len

    @classmethod
    def from_seqs(cls, seqs: list[SeqLayout]) -> StepLayout:
        """The same step from per-request layouts (which must be packed back to back)."""
        qo = [0]
        for s in seqs:
            if s.q_start != qo[-1]:
                raise ValueError(f"requests must be packed back to back: row {s.q_start}, expected {qo[-1]}")
            qo.append(qo[-1] + s.q_len)
        width = max((len(s.block_ids) for s in seqs), default=0)
        table = np.zeros((len(seqs), max(1, width)), np.int64)
        for i, s in enumerate(seqs):
            table[i, : len(s.block_ids)] = s.block_ids
        return cls(
            qo_indptr=np.array(qo, np.int64),
            num_cached=np.array([s.num_cached for s in seqs], np.int64),
            num_chunk=np.array([s.num_chunk for s in seqs], np.int64),
            num_blocks=np.array([len(s.block_ids) for s in seqs], np.int64),
            block_table=table,
            spec_masks=tuple(_spec_mask(s) for s in seqs),
        )

    def pool_slots(self, i: int, logical: np.ndarray, block_size: int) -> np.ndarray:
        """Pool slots of request i's logical KV positions `logical` (the CPU backends read the pool
        in place by these)."""
        return self.block_table[i, logical // block_size] * block_size + logical % block_size

    def step_mask(self, i: int) -> np.ndarray:
        """[q_len, q_len] bool: which of this step's own tokens request i's rows may see."""
        c, q = int(self.num_chunk[i]), int(self.qo_indptr[i + 1] - self.qo_indptr[i])
        mask = np.zeros((q, q), dtype=bool)
        mask[:c, :c] = np.tri(c, dtype=bool)
        mask[c:, :c] = True  # draft nodes and window rows see the whole chunk (its last token is their root)
        spec = self.spec_masks[i]
        if spec is not None:
            mask[c:, c:] = spec
        return mask

    def row_positions(self, i: int) -> np.ndarray:
        """[q_len] positions of request i's rows: given, or a chunk row's index and a spec row's
        root position plus the rows it sees among the spec rows (a draft node's depth)."""
        start, stop = int(self.qo_indptr[i]), int(self.qo_indptr[i + 1])
        if self.positions is not None:
            return self.positions[start:stop]
        cached, chunk = int(self.num_cached[i]), int(self.num_chunk[i])
        spec = self.spec_masks[i]
        below = spec.sum(axis=1) if spec is not None else np.zeros(0, np.int64)
        return np.concatenate((cached + np.arange(chunk), cached + chunk - 1 + below)).astype(np.int64)

    def key_positions(self, i: int) -> np.ndarray:
        """[kv_len] positions of the keys request i's rows see, in slot order (prefix, then its rows)."""
        return np.concatenate((np.arange(int(self.num_cached[i])), self.row_positions(i)))

    def in_window(self, i: int, window: int | None) -> np.ndarray | None:
        """[q_len, kv_len] bool: which of request i's keys lie inside each row's sliding window (by
        position: a draft node's as much as a decoded token's); None where every key does."""
        if window is None:
            return None
        rows = self.row_positions(i)
        if len(rows) == 0 or int(rows.max()) < window:  # no row reaches past its window
            return None
        return (rows[:, None] - self.key_positions(i)[None, :]) < window

    def flat_masks(self, window: int | None = None) -> np.ndarray:
        """[sum q_len * kv_len] bool: every request's [q_len, kv_len] mask, row-major, back to back
        (each row's sliding `window` applied too, if any)."""
        q, kv = self.q_len, self.kv_len
        sizes = q * kv
        flat = np.ones(int(sizes.sum()), dtype=bool)
        offsets = np.concatenate(([0], np.cumsum(sizes)))
        chunks, cached = self.num_chunk.tolist(), self.num_cached.tolist()
        for i in np.flatnonzero(q > 1).tolist():  # single rows see everything: all True already
            view = flat[offsets[i] : offsets[i + 1]].reshape(q[i], kv[i])
            if chunks[i] == 1:  # a decode step's request: its root, then its tree and window rows
                view[0, cached[i] + 1 :] = False  # the root sees none of them
                spec = self.spec_masks[i]
                if spec is not None:  # each sees the root (all True already) and what its mask says
                    view[1:, cached[i] + 1 :] = spec
            else:
                view[:, cached[i] :] = self.step_mask(i)
        if window is not None:
            for i in range(len(q)):
                inside = self.in_window(i, window)
                if inside is not None:
                    flat[offsets[i] : offsets[i + 1]] &= inside.reshape(-1)
        return flat


@dataclass(frozen=True, slots=True)
class StepBucket:
    """The static shape a step is padded to: one captured graph per bucket."""

    rows: int  # packed rows, padding rows included
    requests: int  # real requests the attention plan holds (the padding request comes on top)
    tree: bool  # some request has more than one row: the attention reads a custom mask


def _spec_mask(s: SeqLayout) -> np.ndarray | None:
    """[n, n] over a request's draft nodes then window rows; None if it has neither."""
    tree = ancestor_mask(s.draft_parents) if s.draft_parents else None
    levels, width = s.window
    return spec_mask(tree, window_layout(levels, width)[1] if levels * width else None)


def fa2_head_dim(head_dim: int) -> bool:
    """Whether FlashInfer's FA2 prefill kernels have a valid tile configuration for `head_dim`
    (none below 64: they fail with "Invalid configuration" after building a module for it)."""
    return head_dim >= 64 and head_dim % 16 == 0


def slots_of(block_ids: tuple[int, ...] | list[int], block_size: int, positions: torch.Tensor) -> torch.Tensor:
    """Physical pool slots of logical KV indices `positions` (int64) in a block table."""
    table = torch.tensor(block_ids, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


class AttentionBackend(ABC):
    """Owns the paged K/V storage and computes attention for a packed ragged step."""

    block_size: int  # KV slots per block
    num_blocks: int  # blocks in the pool
    # Backends that compute on the host's clock add their forward time here (the runner resets
    # it each step); asynchronous ones leave `timed` False.
    timed: bool = False
    seconds: float = 0.0
    # Whether a captured CUDA graph may replay this backend's kernels: `plan` with a bucket writes
    # the step into that bucket's fixed buffers, which the kernels read. A backend that builds its
    # metadata afresh each step would replay the capture's layout instead: never graphed.
    graph_safe: bool = False
    # Per layer, what its attention applies beyond the mask (`set_layers`); empty: plain everywhere.
    layers: tuple[LayerAttention, ...] = ()
    windows: tuple[int, ...] = ()  # the layers' distinct sliding windows (a step is planned for each)
    unwindowed: bool = True  # whether some layer has no window (the step's plain plan is read)

    def set_layers(self, layers: tuple[LayerAttention, ...]) -> None:
        """Give each layer its sliding window and soft-cap (before the first step is planned). A
        backend that cannot apply them raises ValueError with the reason."""
        self.layers = tuple(layers)
        self.windows = tuple(sorted({spec.window for spec in self.layers if spec.window is not None}))
        self.unwindowed = not self.layers or any(spec.window is None for spec in self.layers)

    def layer(self, layer_idx: int) -> LayerAttention:
        return self.layers[layer_idx] if self.layers else PLAIN

    @abstractmethod
    def build_metadata(self, step: StepLayout, slot_mapping: torch.Tensor) -> Any:
        """Per-step metadata, built once and shared by every layer.

        `slot_mapping` [num_tokens] gives the pool slot each new token's K/V is written to.
        """

    def plan(self, step: StepLayout, slot_mapping: torch.Tensor, bucket: StepBucket | None = None) -> Any:
        """The step's metadata, planned from its host arrays. `bucket`: the step is padded to it and
        replays (or, without a graph, runs) that bucket's static buffers; a backend whose kernels
        run inside a graph plans into the bucket's own metadata, the same object every step (the
        one the graph captured). The others plan afresh, as for any step."""
        return self.build_metadata(step, slot_mapping)

    @abstractmethod
    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any, scale: float
    ) -> torch.Tensor:
        """Write this step's k/v into the pool, attend, return [T, Hq, D].

        q is [Hq, T, D]; k and v are [Hkv, T, D]: the step's packed rows, head-major, no batch
        dimension (this step's tokens only, RoPE applied).
        """

    @abstractmethod
    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move K/V of pool slots `src` to `dst` in every layer (draft compaction)."""
