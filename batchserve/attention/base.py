"""The attention backend interface and the backend-agnostic layout of one step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class SeqLayout:
    """One request's rows in the packed step, described without tensors of the pool."""

    q_start: int  # first row of this request in the packed [T] batch
    q_len: int  # rows: prompt chunk / last token, then draft nodes
    num_cached: int  # K/V slots filled before this step (the committed prefix)
    num_chunk: int  # committed tokens computed this step (causal among themselves)
    draft_parents: tuple[int | None, ...]  # parent of each draft node (None: child of the chunk's last token)
    block_ids: tuple[int, ...]  # the request's block table

    @property
    def kv_len(self) -> int:
        """Keys this request's rows may see: prefix plus every token of this step."""
        return self.num_cached + self.q_len

    def mask(self) -> torch.Tensor:
        """[q_len, kv_len] bool, True = may attend.

        Chunk rows are causal over prefix + chunk; a draft node sees the prefix, the whole
        chunk (its root is the chunk's last token), its ancestors and itself.
        """
        p, c, n = self.num_cached, self.num_chunk, len(self.draft_parents)
        mask = torch.zeros(c + n, p + c + n, dtype=torch.bool)
        mask[:, :p] = True
        mask[:c, p : p + c] = torch.ones(c, c, dtype=torch.bool).tril_()
        if n:
            mask[c:, p : p + c] = True
            tree = mask[c:, p + c :]  # [n, n] view: ancestor-or-self
            for i, parent in enumerate(self.draft_parents):
                if parent is not None:
                    tree[i] = tree[parent]
                tree[i, i] = True
        return mask


def slots_of(block_ids: tuple[int, ...] | list[int], block_size: int, positions: torch.Tensor) -> torch.Tensor:
    """Physical pool slots of logical KV indices `positions` (int64) in a block table."""
    table = torch.tensor(block_ids, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


class AttentionBackend(ABC):
    """Owns the paged K/V storage and computes attention for a packed ragged step."""

    block_size: int  # KV slots per block
    num_blocks: int  # blocks in the pool

    @abstractmethod
    def build_metadata(self, seqs: list[SeqLayout], num_tokens: int, slot_mapping: torch.Tensor) -> Any:
        """Per-step metadata, built once and shared by every layer.

        `slot_mapping` [num_tokens] gives the pool slot each new token's K/V is written to.
        """

    @abstractmethod
    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any, scale: float
    ) -> torch.Tensor:
        """Write this step's k/v into the pool, attend, return [1, T, Hq, D].

        q is [1, Hq, T, D]; k and v are [1, Hkv, T, D] (this step's tokens only, RoPE applied).
        """

    @abstractmethod
    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move K/V of pool slots `src` to `dst` in every layer (draft compaction)."""
