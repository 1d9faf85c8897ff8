"""Bucketed steps over static buffers: what a CUDA graph replays, and the same code run eagerly.

A step without a prompt chunk (plain decode, tree verification) is padded to a bucket: its rows
rounded up to a row bucket and its requests to a request bucket. The padding rows form one more
request, the padding request, whose K/V go to a scratch block that no request owns and whose
outputs nobody reads. A bucket's inputs (ids, positions, pool slots, kept rows) live in static
device buffers that the host fills with one non-blocking copy from pinned memory; the attention
backend plans the step from host arrays into the bucket's own metadata, outside the graph; then
the bucket's graph replays every layer's kernels. Trees stay ragged: a bucket counts the step's
rows and requests, never a width per request.

On CUDA each bucket is captured once (at start-up, largest first, in one shared memory pool). On
CPU nothing is captured and the same path runs the forward eagerly: that is where its padding,
staging and planning are tested against the unpadded step.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from batchserve.attention.base import AttentionBackend, StepBucket, StepLayout
from batchserve.runner.batch import PackedStep

# Row buckets: fine where steps are common (decode at a few requests, small trees), then by 32.
SMALL_ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
ROW_STEP = 32
# Request buckets: the real requests a bucket's plan holds (plus the padding request).
REQUEST_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """Every row bucket up to the first that holds `max_rows` (the largest step the settings allow)."""
    out: list[int] = []
    for b in itertools.chain(SMALL_ROW_BUCKETS, itertools.count(SMALL_ROW_BUCKETS[-1] + ROW_STEP, ROW_STEP)):
        out.append(b)
        if b >= max_rows:
            return tuple(out)
    raise AssertionError("unreachable: the buckets grow without end")


def request_buckets(max_requests: int) -> tuple[int, ...]:
    """Every request bucket up to the first that holds `max_requests`."""
    out = [b for b in REQUEST_BUCKETS if b < max_requests]
    top = next((b for b in REQUEST_BUCKETS if b >= max_requests), max_requests)
    return (*out, top)


def eligible(step: StepLayout) -> bool:
    """Whether a step can replay a graph: no prompt chunk (every request computes one committed
    token: its last, the root of any draft). Steps with prompt chunks run eagerly."""
    return bool((step.num_chunk == 1).all())


def pad_step(step: PackedStep, rows: int, scratch_block: int, block_size: int) -> tuple[StepLayout, PaddedInputs]:
    """The step's layout and inputs padded to `rows` rows: the padding rows are one more request,
    causal over its own rows, whose block table is the scratch block repeated (its K/V land
    there and nobody reads them). The kept rows are padded with row 0 (their logits are dropped)."""
    layout = step.layout
    real = layout.num_tokens
    pad = rows - real
    if pad < 0:
        raise ValueError(f"a step of {real} rows does not fit a bucket of {rows}")
    if pad == 0:
        padded = layout
        slots = step.slot_mapping
        positions = step.positions
        ids = step.input_ids
    else:
        blocks = -(-pad // block_size)
        width = max(layout.block_table.shape[1], blocks)
        table = np.zeros((len(layout.num_cached) + 1, width), np.int64)
        table[:-1, : layout.block_table.shape[1]] = layout.block_table
        table[-1, :blocks] = scratch_block
        offsets = np.arange(pad)
        positions = np.concatenate((step.positions, offsets))
        padded = StepLayout(
            qo_indptr=np.append(layout.qo_indptr, rows),
            num_cached=np.append(layout.num_cached, 0),
            num_chunk=np.append(layout.num_chunk, pad),
            num_blocks=np.append(layout.num_blocks, blocks),
            block_table=table,
            spec_masks=(*layout.spec_masks, None),
            positions=positions,
        )
        slots = np.concatenate((step.slot_mapping, scratch_block * block_size + offsets % block_size))
        ids = np.concatenate((step.input_ids, np.zeros(pad, np.int64)))
    keep = np.zeros(rows, np.int64)
    keep[: len(step.keep)] = step.keep
    return padded, PaddedInputs(ids, positions, slots, keep)


class PaddedInputs(NamedTuple):
    """A padded step's model inputs, each [rows] int64 on the host."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    keep: np.ndarray  # the kept rows first, then row 0 up to the bucket's rows


@dataclass(slots=True)
class Captured:
    """One bucket's graph and what it reads and writes."""

    graph: Any  # torch.cuda.CUDAGraph
    metadata: Any  # the backend's per-bucket metadata the graph's kernels read
    logits: torch.Tensor  # [rows, V]: the graph's output buffer


class CaptureReport(NamedTuple):
    graphs: int
    seconds: float
    bytes: int  # device memory the graphs' pool took


@dataclass(slots=True)
class StepGraphs:
    """Static input buffers for the largest bucket, the buckets the settings allow, and (on CUDA,
    after `capture`) one graph per bucket. `prepare` stages and plans a padded step, `forward`
    runs it: replayed where its bucket is captured, eagerly otherwise (always on CPU)."""

    model: Any
    backend: AttentionBackend
    device: torch.device
    scratch_block: int  # a pool block outside every request's: the padding rows' K/V
    rows: tuple[int, ...]  # row buckets
    requests: tuple[int, ...]  # request buckets
    max_rows: int = 0  # the largest step the settings allow (0: the largest row bucket)
    max_requests: int = 0  # the most requests in a step (0: the largest request bucket)
    _inputs: torch.Tensor = field(init=False)  # [4, max rows] int64 on the device: the four below
    input_ids: torch.Tensor = field(init=False)  # [max rows] int64 (views of _inputs)
    positions: torch.Tensor = field(init=False)
    slot_mapping: torch.Tensor = field(init=False)
    keep: torch.Tensor = field(init=False)
    _staging: torch.Tensor = field(init=False)  # [4, max rows] host (pinned on CUDA)
    captured: dict[StepBucket, Captured] = field(default_factory=dict)
    _pool: Any = None  # the graphs' shared memory pool

    def __post_init__(self) -> None:
        n = self.rows[-1]
        buffers = torch.zeros(4, n, dtype=torch.int64, device=self.device)
        self.input_ids, self.positions, self.slot_mapping, self.keep = buffers.unbind(0)
        self._inputs = buffers
        staging = torch.zeros(4, n, dtype=torch.int64)
        self._staging = staging.pin_memory() if self.device.type == "cuda" else staging

    @classmethod
    def for_settings(
        cls, model: Any, backend: AttentionBackend, scratch_block: int, max_rows: int, max_requests: int
    ) -> StepGraphs:
        device = next(model.parameters()).device
        rows, requests = row_buckets(max_rows), request_buckets(max_requests)
        return cls(model, backend, device, scratch_block, rows, requests, max_rows, max_requests)

    def bucket_for(self, layout: StepLayout) -> StepBucket | None:
        """The bucket a step pads to; None where it has a prompt chunk or exceeds every bucket.

        NOTE: a bucket never holds more requests than rows. FlashInfer's graph-mode planner sizes
        its query tile for `rows - requests` rows per request (the ragged worst case) in unsigned
        arithmetic: more requests than rows wraps around to the largest tile, 128 query rows, for
        steps of one row per request."""
        if not eligible(layout):
            return None
        rows, requests = layout.num_tokens, len(layout.num_cached)
        i, j = bisect.bisect_left(self.rows, rows), bisect.bisect_left(self.requests, requests)
        if i == len(self.rows) or j == len(self.requests):
            return None
        return StepBucket(self.rows[i], min(self.requests[j], self.rows[i]), tree=rows > requests)

    def all_buckets(self) -> list[StepBucket]:
        """Every bucket `bucket_for` can return, largest first (captures share memory best that way)."""
        out = set()
        top_rows, top_requests = self.max_rows or self.rows[-1], self.max_requests or self.requests[-1]
        for i, rows in enumerate(self.rows):
            rows_after = self.rows[i - 1] if i else 0  # a step in this bucket has more rows than this
            for j, requests in enumerate(self.requests):
                requests_after = self.requests[j - 1] if j else 0
                most_rows, most_requests = min(rows, top_rows), min(requests, top_requests)
                held = min(requests, rows)
                if requests_after < most_requests and requests_after + 1 < most_rows and rows_after < most_rows:
                    out.add(StepBucket(rows, held, tree=True))  # n requests, more rows than n
                if max(rows_after, requests_after) < min(most_rows, most_requests):  # n rows, one per request
                    out.add(StepBucket(rows, held, tree=False))
        return sorted(out, key=lambda b: (b.rows, b.requests, b.tree), reverse=True)

    def stage(self, step: PackedStep, bucket: StepBucket) -> tuple[StepLayout, int]:
        """Pad the step to `bucket`, fill the static input buffers (one host-to-device copy) and
        return the padded layout and the number of kept rows."""
        layout, inputs = pad_step(step, bucket.rows, self.scratch_block, self.backend.block_size)
        staged = self._staging[:, : bucket.rows]
        # The last step's copy has been read (its results came back to the host since).
        for row, array in zip(staged, inputs):
            row.numpy()[:] = array
        self._inputs[:, : bucket.rows].copy_(staged, non_blocking=True)
        return layout, len(step.keep)

    def prepare(self, step: PackedStep, bucket: StepBucket) -> tuple[Any, int]:
        """Stage the step in `bucket`'s buffers and plan its attention (outside any graph):
        (the metadata the forward reads, the number of kept rows)."""
        layout, kept = self.stage(step, bucket)
        return self.backend.plan(layout, self.slot_mapping[: bucket.rows], bucket), kept

    def forward(self, bucket: StepBucket, metadata: Any, kept: int) -> torch.Tensor:
        """[K, V] logits of the step's kept rows: the bucket's graph replayed, or the same
        forward run eagerly over the static buffers where none is captured (always on CPU)."""
        captured = self.captured.get(bucket)
        if captured is not None:
            captured.graph.replay()
            return captured.logits[:kept]
        return self._forward(bucket, metadata)[:kept]

    def _forward(self, bucket: StepBucket, metadata: Any) -> torch.Tensor:
        rows = bucket.rows
        out = self.model(
            input_ids=self.input_ids[None, :rows],
            position_ids=self.positions[None, :rows],
            logits_to_keep=self.keep[:rows],
            attn_metadata=metadata,
            use_cache=False,
        )
        return out.logits[0]  # [rows, V]

    def capture(self, buckets: list[StepBucket] | None = None) -> CaptureReport:
        """Capture a graph per bucket (CUDA only), largest first in one shared pool. Each bucket is
        planned with a step of padding rows only, run twice eagerly (lazy inits), then captured."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {self.device}")
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        for bucket in buckets if buckets is not None else self.all_buckets():
            self.captured[bucket] = self._capture_one(bucket)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        used = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        return CaptureReport(len(self.captured), seconds, used)

    @torch.inference_mode()
    def _capture_one(self, bucket: StepBucket) -> Captured:
        layout = filler_layout(bucket, self.scratch_block, self.backend.block_size)
        n = bucket.rows
        self._inputs[:, :n].zero_()
        self.slot_mapping[:n].copy_(
            torch.from_numpy(self.scratch_block * self.backend.block_size + np.arange(n) % self.backend.block_size)
        )
        metadata = self.backend.plan(layout, self.slot_mapping[:n], bucket)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(bucket, metadata)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(bucket, metadata)
        return Captured(graph, metadata, logits)


def filler_layout(bucket: StepBucket, scratch_block: int, block_size: int) -> StepLayout:
    """A step of the bucket's shape made of padding alone (capture and its warm-up): one-row
    requests over the scratch block, then the remaining rows as the padding request."""
    reqs = min(bucket.requests, bucket.rows - 2 if bucket.tree else bucket.rows)  # a tree: a 2+ row request
    pad = bucket.rows - reqs
    blocks = -(-pad // block_size)
    q_len = np.array([1] * reqs + [pad] * (pad > 0), np.int64)
    n = len(q_len)
    return StepLayout(
        qo_indptr=np.concatenate(([0], np.cumsum(q_len))),
        num_cached=np.zeros(n, np.int64),
        num_chunk=q_len.copy(),
        num_blocks=np.array([1] * reqs + [blocks] * (pad > 0), np.int64),
        block_table=np.full((n, max(1, blocks)), scratch_block, np.int64),
        spec_masks=(None,) * n,
        positions=np.concatenate((np.ones(reqs, np.int64), np.arange(pad))),
    )
