"""FlashInfer attention over the paged pool (CUDA, float16/bfloat16).

Same slot numbering and semantics as the torch reference (the pool here is NHD pages, the
reference's is head-major): K/V of the step are written by slot mapping, then every request's
rows attend to its pages under its own boolean mask (prompt chunks causal, drafts as trees) in
one `BatchPrefillWithPagedKVCacheWrapper` call per layer; a step without drafts (prompt chunks and
decodes) runs FlashInfer's causal mode and no mask.
The wrapper is planned once per step and created with `backend="fa2"`: custom masks run only
on the FA2 kernels. RoPE stays in the HF model (positions from tree depth), so the kernel
runs with `pos_encoding_mode="NONE"`.

Attention sinks (gpt-oss: a learned logit per query head in the softmax's denominator, with no
value) are added after the kernel from the log-sum-exp it returns (`add_sinks`), so every kernel
variant (mask, window, soft-cap, graph buckets) takes them without a variant of its own, and a
row's result is still its own (an elementwise scale).

Planning never waits for the device: the mask is bit-packed on the host (`build_plan`), and the
plan's arrays reach plan() as pinned host indptrs and device page indices and packed mask, filled
by non-blocking copies (`flashinfer_staging`, which says what plan() does with each).

`flashinfer` is imported only when this backend is built (the `gpu` extra); `build_plan` is
plain torch so that the index and mask construction is tested on any machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from batchserve.attention.base import (
    PLAIN,
    AttentionBackend,
    LayerAttention,
    StepBucket,
    StepLayout,
    fa2_head_dim,
)
from batchserve.attention.flashinfer_staging import PlanStaging, pack_masks

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-KV workspace
LN2 = math.log(2.0)


def add_sinks(out: torch.Tensor, lse2: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The attention `out` [T, Hq, D] (computed without sinks) with each head's sink logit `sinks`
    [Hq] float32 in its softmax's denominator, from the rows' log-sum-exp `lse2` [T, Hq] float32 in
    base 2 (FlashInfer's): with L = lse2 * ln 2, softmax over [scores, s] keeps e^L / (e^L + e^s)
    of each row's mass, sigmoid(L - s). A row that sees no key (L = -inf) stays 0."""
    keep = torch.sigmoid(lse2 * LN2 - sinks)  # [T, Hq] float32
    return (out.float() * keep.unsqueeze(-1)).to(out.dtype)  # [T, Hq, D]


def planned_kind(spec: LayerAttention) -> LayerAttention:
    """What a wrapper is planned for: the window and the soft-cap; the sinks are `add_sinks`'s."""
    return replace(spec, sinks=None)


@dataclass(frozen=True, slots=True)
class PagedPlan:
    """FlashInfer's inputs for one step, in its CSR page-table form (CPU tensors)."""

    qo_indptr: torch.Tensor  # [B + 1] int32: request i's rows are [qo_indptr[i], qo_indptr[i + 1])
    kv_indptr: torch.Tensor  # [B + 1] int32: request i's pages are kv_indices[kv_indptr[i]:kv_indptr[i + 1]]
    kv_indices: torch.Tensor  # [num pages used] int32: physical page ids, in logical order
    kv_last_page_len: torch.Tensor  # [B] int32 in [1, page_size]: valid slots of each request's last page
    custom_mask: torch.Tensor  # [sum q_len_i * kv_len_i] bool: each request's [q_len, kv_len] mask, row-major
    packed_mask: torch.Tensor  # [sum ceil(q_len_i * kv_len_i / 8)] uint8: custom_mask per request, bits little-endian
    mask_indptr: torch.Tensor  # [B + 1] int32: request i's mask is packed_mask[mask_indptr[i]:mask_indptr[i + 1]]


def _int32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))


def build_plan(
    step: StepLayout, page_size: int, num_requests: int | None = None, window: int | None = None, masked: bool = True
) -> PagedPlan:
    """The page table and flattened masks of a packed step, in a few array operations.
    `num_requests`: pad with requests of no rows (one key on page 0, never read) up to this many:
    a graph's plan has a fixed batch size. `window`: a sliding window the masks apply by each
    row's own position (a draft node's is its depth's, which FlashInfer's `window_left` cannot know).
    `masked=False`: a plan for a wrapper that reads no mask (its three mask arrays empty)."""
    if num_requests is not None and num_requests > len(step.num_cached):
        step = pad_requests(step, num_requests)
    kv_len = step.kv_len
    num_pages = -(-kv_len // page_size)  # [B]
    short = np.flatnonzero(num_pages > step.num_blocks)
    if len(short):
        i = int(short[0])
        raise ValueError(f"{kv_len[i]} KV slots need {num_pages[i]} pages, the block table has {step.num_blocks[i]}")
    used = np.arange(step.block_table.shape[1])[None, :] < num_pages[:, None]  # [B, W]
    if masked:
        mask = step.flat_masks(window)  # [sum q_len * kv_len] bool
        packed, mask_indptr = pack_masks(mask, step.q_len * kv_len)
    else:
        mask, packed, mask_indptr = np.zeros(0, bool), np.zeros(0, np.uint8), np.zeros(0, np.int32)
    return PagedPlan(
        qo_indptr=_int32(step.qo_indptr),
        kv_indptr=_int32(np.concatenate(([0], np.cumsum(num_pages)))),
        kv_indices=_int32(step.block_table[used]),  # row-major: each request's pages in logical order
        kv_last_page_len=_int32(kv_len - (num_pages - 1) * page_size),
        custom_mask=torch.from_numpy(mask),
        packed_mask=torch.from_numpy(packed),
        mask_indptr=torch.from_numpy(mask_indptr),
    )


def pad_requests(step: StepLayout, num_requests: int) -> StepLayout:
    """The same step with requests of no rows appended up to `num_requests` (one cached key each,
    on page 0: FlashInfer needs a last page of 1 to page_size slots; no row reads it)."""
    extra = num_requests - len(step.num_cached)
    table = np.zeros((num_requests, step.block_table.shape[1]), np.int64)
    table[: len(step.num_cached)] = step.block_table
    return StepLayout(
        qo_indptr=np.concatenate((step.qo_indptr, np.full(extra, step.qo_indptr[-1]))),
        num_cached=np.concatenate((step.num_cached, np.ones(extra, np.int64))),
        num_chunk=np.concatenate((step.num_chunk, np.zeros(extra, np.int64))),
        num_blocks=np.concatenate((step.num_blocks, np.ones(extra, np.int64))),
        block_table=table,
        spec_masks=(*step.spec_masks, *(None,) * extra),
        positions=step.positions,
    )


@dataclass(frozen=True, slots=True)
class FlashInferMetadata:
    backend: FlashInferBackend
    wrapper: Any  # the planned BatchPrefillWithPagedKVCacheWrapper of the first kind of layer
    slot_mapping: torch.Tensor  # [T] pool slot of each new token (on the device)
    num_tokens: int
    # One planned wrapper per kind of layer (sliding window, soft-cap): FlashInfer plans them.
    wrappers: dict[LayerAttention, Any]


class FlashInferBackend(AttentionBackend):
    graph_safe = True  # a bucket's wrapper reads its plan from fixed buffers (use_cuda_graph)

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        sm_scale: float | None = None,
        max_model_len: int = 0,
        library: Any = None,
    ) -> None:
        """`max_model_len`: the longest context, which sizes a graph bucket's page and mask buffers.
        `library`: the `flashinfer` module (imported here by default), or a stand-in with its
        interface, which may run on the CPU (the contract tests' double)."""
        device = torch.device(device)
        if library is None and device.type != "cuda":
            raise ValueError(f"the FlashInfer backend needs a CUDA device, got {device}")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the FlashInfer backend runs float16 or bfloat16, got {dtype}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"query heads ({num_qo_heads}) must be a multiple of KV heads ({num_kv_heads})")
        if not fa2_head_dim(head_dim):
            raise ValueError(f"FlashInfer's FA2 kernels need a head dim of 64 or more (multiple of 16), not {head_dim}")
        if library is None:
            try:
                import flashinfer as library
            except ImportError as e:
                raise ValueError(
                    "the FlashInfer backend needs the `flashinfer-python` package (pip install 'batchserve[gpu]')"
                ) from e
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.sm_scale = sm_scale if sm_scale is not None else head_dim**-0.5
        # [L, pages, page_size, Hkv, D]: FlashInfer's NHD layout, and the same memory as the
        # reference's [L, slots, Hkv, D] viewed page by page.
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self._flashinfer = library
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._kinds: tuple[LayerAttention, ...] = (PLAIN,)  # the distinct kinds of layer (`set_layers`)
        self._sinks: list[torch.Tensor | None] = []  # each layer's sinks [Hq] (`set_layers`)
        self._wrappers = {PLAIN: library.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2")}
        # Graph-replayed steps: one wrapper per bucket over its own fixed buffers (they share the
        # workspace: one step runs at a time).
        self._buckets: dict[StepBucket, FlashInferMetadata] = {}
        self.max_model_len = max_model_len
        self._staging: dict[Any, PlanStaging] = {}  # per wrapper: its inputs' host and device buffers

    def set_layers(self, layers: tuple[LayerAttention, ...]) -> None:
        """One wrapper per kind of layer (FlashInfer plans the window and the soft-cap with the step),
        and each layer's sinks [Hq] float32 on the device, made once (fixed inputs of a graph)."""
        if self._buckets:
            raise ValueError("set_layers comes before the first planned step")
        for spec in layers:
            if spec.sinks is not None and len(spec.sinks) != self.num_qo_heads:
                raise ValueError(f"{len(spec.sinks)} attention sinks for {self.num_qo_heads} query heads")
        super().set_layers(layers)
        self._sinks = [
            None if spec.sinks is None else torch.tensor(spec.sinks, dtype=torch.float32, device=self.device)
            for spec in layers
        ]
        self._kinds = tuple(dict.fromkeys(planned_kind(spec) for spec in layers)) or (PLAIN,)
        make = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper
        self._wrappers = {kind: make(self._workspace, "NHD", backend="fa2") for kind in self._kinds}

    def build_metadata(self, step: StepLayout, slot_mapping: torch.Tensor) -> FlashInferMetadata:
        # A step without drafts (prompt chunks and decodes: `none`'s step) is causal and needs no
        # mask: none built, packed or read.
        masked = not step.causal
        for kind, wrapper in self._wrappers.items():
            plan = build_plan(step, self.block_size, window=kind.window, masked=masked)
            self._plan(wrapper, plan, masked=masked, kind=kind)
        first = self._wrappers[self._kinds[0]]
        return FlashInferMetadata(self, first, slot_mapping.to(self.device), step.num_tokens, self._wrappers)

    def plan(
        self, step: StepLayout, slot_mapping: torch.Tensor, bucket: StepBucket | None = None
    ) -> FlashInferMetadata:
        """With a bucket: plan its wrapper (made on first use over fixed buffers, the graph's
        inputs) from the host arrays; `slot_mapping` must be the same static buffer every step."""
        if bucket is None:
            return self.build_metadata(step, slot_mapping)
        metadata = self._buckets.get(bucket)
        if metadata is None:
            metadata = self._buckets[bucket] = self._bucket_metadata(bucket, slot_mapping)
        # Requests past the step's own (and the padding request) have no rows: a fixed batch size.
        for kind, wrapper in metadata.wrappers.items():
            plan = build_plan(step, self.block_size, bucket.requests + 1, window=kind.window, masked=bucket.tree)
            self._plan(wrapper, plan, masked=bucket.tree, kind=kind)
        return metadata

    def _bucket_metadata(self, bucket: StepBucket, slot_mapping: torch.Tensor) -> FlashInferMetadata:
        if self.max_model_len <= 0:
            raise ValueError("graph buckets need max_model_len: it sizes their page and mask buffers")
        dev, n = self.device, bucket.requests + 1
        int32 = {"dtype": torch.int32, "device": dev}
        # The longest KV a request's rows can see: its context, then this step's rows.
        pages_per_request = -(-(self.max_model_len + bucket.rows) // self.block_size)
        buffers: dict[str, torch.Tensor] = {
            "qo_indptr_buf": torch.zeros(n + 1, **int32),
            "paged_kv_indptr_buf": torch.zeros(n + 1, **int32),
            # Each request's pages, and the padding request's: a block shared through the prefix
            # cache stands in several tables, so the pool's size bounds nothing here.
            "paged_kv_indices_buf": torch.zeros(
                bucket.requests * pages_per_request + -(-bucket.rows // self.block_size) + 1, **int32
            ),
            "paged_kv_last_page_len_buf": torch.zeros(n, **int32),
        }
        if bucket.tree:
            # The mask bits of the largest plan: every row over the longest KV, packed to whole
            # bytes per request.
            bits = bucket.rows * (self.max_model_len + bucket.rows)
            buffers["custom_mask_buf"] = torch.zeros(bits // 8 + n + 8, dtype=torch.uint8, device=dev)
            buffers["mask_indptr_buf"] = torch.zeros(n + 1, **int32)
        make = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper
        wrappers = {  # each kind of layer its own buffers: their masks differ
            kind: make(
                self._workspace, "NHD", use_cuda_graph=True, backend="fa2", **{k: b.clone() for k, b in buffers.items()}
            )
            for kind in self._kinds
        }
        return FlashInferMetadata(self, wrappers[self._kinds[0]], slot_mapping, bucket.rows, wrappers)

    def _plan(self, wrapper: Any, plan: PagedPlan, masked: bool, kind: LayerAttention = PLAIN) -> None:
        """Plan without a host sync: pinned host indptrs (plan() reads them on the host), page indices
        and the packed mask on the device, then the mask's byte offsets over plan()'s bit offsets
        (`flashinfer_staging`). A sliding window is in the mask where there is one (`build_plan`);
        without one the rows are causal (chunks, or one row a request), and FlashInfer's causal mode
        with `window_left` counts each row's window from its own position exactly."""
        options: dict[str, Any] = {}
        if kind.window is not None and not masked:
            options["window_left"] = kind.window - 1
        if kind.softcap is not None:
            options["logits_soft_cap"] = kind.softcap
        staging = self._staging.get(wrapper)
        if staging is None:
            staging = self._staging[wrapper] = PlanStaging(self.device)
        staged = staging.stage(plan, masked)
        wrapper.plan(
            staged["qo_indptr"],
            staged["kv_indptr"],
            staged["kv_indices"],
            staged["kv_last_page_len"],
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            packed_custom_mask=staged["packed_mask"] if masked else None,
            causal=not masked,  # bottom-right aligned: a chunk's row i sees keys up to i + kv_len - q_len
            pos_encoding_mode="NONE",
            sm_scale=self.sm_scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            non_blocking=True,
            **options,
        )
        if masked:
            staging.fix_mask_offsets(wrapper)
        staging.done()

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any, scale: float
    ) -> torch.Tensor:
        if abs(scale - self.sm_scale) > 1e-6 * self.sm_scale:
            raise ValueError(f"layer {layer_idx} uses scale {scale}, the step was planned with {self.sm_scale}")
        slots = metadata.slot_mapping
        hkv, d = self.num_kv_heads, self.head_dim
        self.k_cache[layer_idx].view(-1, hkv, d).index_copy_(0, slots, k.transpose(0, 1).to(self.dtype))  # [T, Hkv, D]
        self.v_cache[layer_idx].view(-1, hkv, d).index_copy_(0, slots, v.transpose(0, 1).to(self.dtype))
        qt = q.transpose(0, 1).contiguous().to(self.dtype)  # [T, Hq, D]
        wrapper = metadata.wrappers[planned_kind(self.layer(layer_idx))]  # planned for this kind of layer
        cache = (self.k_cache[layer_idx], self.v_cache[layer_idx])
        sinks = self._sinks[layer_idx] if self._sinks else None
        if sinks is None:
            return wrapper.run(qt, cache).to(q.dtype)  # [T, Hq, D]
        out, lse2 = wrapper.run(qt, cache, return_lse=True)  # [T, Hq, D], [T, Hq] float32 (base 2)
        return add_sinks(out, lse2, sinks).to(q.dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        src, dst = src.to(self.device), dst.to(self.device)
        for cache in (self.k_cache, self.v_cache):
            flat = cache.view(cache.shape[0], -1, self.num_kv_heads, self.head_dim)  # [L, slots, Hkv, D]
            flat[:, dst] = flat[:, src]
