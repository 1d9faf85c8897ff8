"""Packing one step's requests into flat host arrays, in a few vectorized operations."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from batchserve.attention.base import StepLayout
from batchserve.records import ScheduledRequest


class BlockTables:
    """Every running request's block table as one persistent [rows, width] array.

    A request keeps its row from its first step until it is released. The scheduler only
    appends blocks, trims them from the tail or (on preemption) starts over, so a step
    copies in only the blocks added since the last one; a table that changed otherwise is
    rewritten whole.
    """

    def __init__(self, rows: int = 16, width: int = 64) -> None:
        self.array = np.zeros((rows, width), np.int64)  # [rows, width]
        self._row: dict[str, int] = {}
        self._known: dict[str, tuple[int, ...]] = {}  # the block ids each row holds
        self._free: list[int] = list(range(rows - 1, -1, -1))

    def rows(self, requests: Sequence[ScheduledRequest]) -> np.ndarray:
        """[B] the row of each request, after bringing the rows up to date."""
        out = np.empty(len(requests), np.int64)
        for i, r in enumerate(requests):
            row = self._row.get(r.request_id)
            if row is None:
                row = self._row[r.request_id] = self._take_row()
                self._known[r.request_id] = ()
            known, new = self._known[r.request_id], r.block_ids
            if new is not known and new != known:
                self._grow(len(new))
                n = len(known)
                start = n if len(new) > n and new[:n] == known else 0
                self.array[row, start : len(new)] = new[start:]
                self._known[r.request_id] = new
            out[i] = row
        return out

    def release(self, request_id: str) -> None:
        row = self._row.pop(request_id, None)
        if row is not None:
            del self._known[request_id]
            self._free.append(row)

    def _take_row(self) -> int:
        if not self._free:
            rows = len(self.array)
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()

    def _grow(self, width: int) -> None:
        if width > self.array.shape[1]:
            wider = np.zeros((len(self.array), max(width, 2 * self.array.shape[1])), np.int64)
            wider[:, : self.array.shape[1]] = self.array
            self.array = wider


@dataclass(frozen=True, slots=True)
class PackedStep:
    """A step's model inputs as host arrays ([T] = the step's rows, requests back to back)."""

    layout: StepLayout  # the attention view of the same step
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64: RoPE position (below the root: a node's depth, a window row's offset)
    slot_mapping: np.ndarray  # [T] int64: pool slot each row's K/V is written to
    keep: np.ndarray  # [K] int64: rows whose logits verification needs, request by request
    logit_start: np.ndarray  # [B] int64: first of request i's kept rows (its root, draft nodes, window outputs)
    # keep[:num_verify] are the rows above; the rest score prompt tokens (`ScheduledRequest.score_targets`),
    # request by request, after every row verification reads so that none of its indices move.
    num_verify: int


def pack(requests: Sequence[ScheduledRequest], tables: BlockTables, block_size: int) -> PackedStep:
    """Flatten the scheduled requests: rows are each request's chunk, then its draft nodes, then
    its window rows (computed, never verified)."""
    b = len(requests)
    cached = np.fromiter((r.num_computed_tokens for r in requests), np.int64, b)
    chunk = np.fromiter((len(r.token_ids) for r in requests), np.int64, b)
    spec = np.fromiter((r.num_spec_rows for r in requests), np.int64, b)  # draft nodes + window rows
    nodes = np.fromiter((0 if r.draft is None else len(r.draft) for r in requests), np.int64, b)
    # Window rows whose logits nobody reads (all but the last level's): skipped by the LM head.
    unread = np.fromiter(
        (0 if r.window is None else len(r.window) - r.window.num_outputs for r in requests), np.int64, b
    )
    sample = np.fromiter((r.sample for r in requests), bool, b)
    q_len = chunk + spec
    qo_indptr = np.zeros(b + 1, np.int64)
    np.cumsum(q_len, out=qo_indptr[1:])
    num_tokens = int(qo_indptr[-1])

    rows = tables.rows(requests)
    num_blocks = np.fromiter((len(r.block_ids) for r in requests), np.int64, b)
    block_table = tables.array[rows, : max(1, int(num_blocks.max()))]  # [B, W]

    owner = np.repeat(np.arange(b), q_len)  # [T] request of each row
    offset = np.arange(num_tokens) - qo_indptr[owner]  # [T] row within its request
    logical = cached[owner] + offset  # [T] KV index: chunk, draft nodes, window rows, consecutively
    slot_mapping = block_table[owner, logical // block_size] * block_size + logical % block_size
    positions = logical.copy()
    is_spec = offset >= chunk[owner]
    if is_spec.any():
        below = np.fromiter(itertools.chain.from_iterable(r.spec_offsets() for r in requests), np.int64)
        # A draft node sits `depth` below the root, the chunk's last token; a window row, its offset.
        positions[is_spec] = (cached + chunk - 1)[owner[is_spec]] + below
    input_ids = np.fromiter(
        itertools.chain.from_iterable(itertools.chain(r.token_ids, r.spec_tokens()) for r in requests),
        np.int64,
        num_tokens,
    )
    window_start = (chunk + nodes)[owner]  # [T]
    unread_row = (offset >= window_start) & (offset < window_start + unread[owner])
    keep = np.flatnonzero(sample[owner] & (offset >= chunk[owner] - 1) & ~unread_row)
    kept = np.where(sample, spec - unread + 1, 0)
    logit_start = np.cumsum(kept) - kept
    num_verify = len(keep)
    scored = [
        qo_indptr[i] + r.score_from + np.arange(len(r.score_targets)) for i, r in enumerate(requests) if r.score_targets
    ]
    if scored:  # prompt logprobs: rare, so a step without them builds nothing here
        keep = np.concatenate([keep, *scored])
    layout = StepLayout(
        qo_indptr=qo_indptr,
        num_cached=cached,
        num_chunk=chunk,
        num_blocks=num_blocks,
        block_table=block_table,
        spec_masks=tuple(r.spec_mask() for r in requests),
        positions=positions,
    )
    return PackedStep(layout, input_ids, positions, slot_mapping, keep, logit_start, num_verify)
