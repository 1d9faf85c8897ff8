"""A stand-in for `flashinfer` that enforces what its paged prefill wrapper requires, on the CPU.

`BatchPrefillWithPagedKVCacheWrapper` here checks every rule the real wrapper (FlashInfer
0.7.2.post1: `prefill.py`, `attention/variants.cuh`, `attention/scheduler.cuh`) enforces or
silently relies on, raising `ContractError` where the real one raises, fails in a CUDA kernel, or
computes garbage, then attends densely from the buffers the real kernels read (graph mode: the
constructor's; eager: what plan() kept, the very device tensors it was handed). So a plan that
works only by accident, say a buffer too small or a mask offset wrong, gives wrong output here too.

The mask as 0.7.2 takes it: a bool `custom_mask` is packed by `segment_packbits` (per request,
little bit order, whole bytes) with that function's byte offsets; a `packed_custom_mask` is kept
as it is, with the offsets of `_compute_page_mask_indptr`: running sums of q_len * kv_len, in bits.
The kernel reads request i's mask from byte `_mask_indptr_buf[i]` on: past the first request, the
packed path is wrong unless the caller writes byte offsets there after plan() (the backend does).

`SYNCS` collects what each plan() would block the host on in the real one: a bool mask (packed on
the device, read back with `.item()`), an indptr array on the device (`.to("cpu")`), page indices
or a packed mask on the host in graph mode (a blocking copy), pageable host memory. It does not raise.
"On the device": on a CPU run every tensor is on the CPU; one counts as host memory when it shares
memory with one given to `mark_host` (`pinned=True`: page-locked), as the tests do with the
backend's host-side plan and staging buffers.

Not modelled: head dims above 64 (below, FA2 fails "Invalid configuration", as here), numerics
(float32), planning cost, split-KV chunking, tiles, stream order; only their preconditions."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# Storage data pointers of host tensors, each kept alive so that no later "device" tensor takes its
# address; PINNED: those of them in page-locked memory.
HOST: dict[int, torch.Tensor] = {}
PINNED: set[int] = set()
SYNCS: list[str] = []  # what the real plan() calls made so far would have blocked the host on


class ContractError(Exception):
    """What the real FlashInfer would refuse, or get wrong without saying so."""


def mark_host(*tensors: torch.Tensor, pinned: bool = False) -> None:
    HOST.update((t.untyped_storage().data_ptr(), t) for t in tensors)
    PINNED.update(t.untyped_storage().data_ptr() for t in tensors if pinned)


def forget_host() -> None:
    HOST.clear()
    PINNED.clear()
    SYNCS.clear()


def _where(t: torch.Tensor) -> str:
    ptr = t.untyped_storage().data_ptr()
    return "device" if ptr not in HOST else "pinned" if ptr in PINNED else "pageable"


# The runs one plan may serve: a step plans once, then every layer runs. The contract tests set it
# to the model's layer count, so a step (or a replay) that skipped its plan shows up.
RUNS_PER_PLAN: list[int] = [1 << 30]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ContractError(message)


def _int32_vector(name: str, t: Any) -> None:
    _require(torch.is_tensor(t), f"{name} must be a tensor")
    _require(t.dtype == torch.int32, f"{name} must be int32 (the kernels' index type), got {t.dtype}")
    _require(t.dim() == 1, f"{name} must be 1-D")


@dataclass(slots=True)
class _Plan:
    qo_indptr: np.ndarray
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sm_scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    window_left: int  # -1: none; else a row at position p (kv_len - q_len + its index) sees keys p - window_left ..
    logits_soft_cap: float  # 0: none; else each scaled score s -> cap * tanh(s / cap)
    causal: bool  # without a mask: row r sees keys up to its place kv_len - q_len + r (CAUSAL), else all


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        paged_kv_indptr_buf: torch.Tensor | None = None,
        paged_kv_indices_buf: torch.Tensor | None = None,
        paged_kv_last_page_len_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        _require(float_workspace_buffer.dtype == torch.uint8, "the workspace is a uint8 buffer")
        _require(kv_layout == "NHD", f"the double reads the NHD layout only, got {kv_layout}")
        self.device = float_workspace_buffer.device
        self.backend = backend
        self.use_cuda_graph = use_cuda_graph
        self._plan: _Plan | None = None
        self._runs = 0
        self._max_rows: int | None = None
        if use_cuda_graph:
            for name, buf in (
                ("qo_indptr_buf", qo_indptr_buf),
                ("paged_kv_indptr_buf", paged_kv_indptr_buf),
                ("paged_kv_indices_buf", paged_kv_indices_buf),
                ("paged_kv_last_page_len_buf", paged_kv_last_page_len_buf),
            ):
                _require(torch.is_tensor(buf), f"{name} should be a torch.Tensor in CUDA graph mode")
                _int32_vector(name, buf)
                _require(buf.device == self.device, f"{name} must be on the workspace's device")
            assert qo_indptr_buf is not None and paged_kv_indptr_buf is not None
            assert paged_kv_last_page_len_buf is not None
            self.fixed_batch_size = len(qo_indptr_buf) - 1
            _require(len(paged_kv_indptr_buf) == self.fixed_batch_size + 1, "paged_kv_indptr_buf: batch_size + 1")
            _require(len(paged_kv_last_page_len_buf) == self.fixed_batch_size, "paged_kv_last_page_len_buf: batch_size")
            _require(custom_mask_buf is None or custom_mask_buf.dtype == torch.uint8, "custom_mask_buf: packed, uint8")
            if mask_indptr_buf is not None:
                _int32_vector("mask_indptr_buf", mask_indptr_buf)
                _require(len(mask_indptr_buf) == self.fixed_batch_size + 1, "mask_indptr_buf: batch_size + 1")
        # The real wrapper's attribute names: the backend writes the mask offsets into the last.
        self._qo_indptr_buf = qo_indptr_buf
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf
        self._custom_mask_buf = custom_mask_buf
        self._mask_indptr_buf = mask_indptr_buf

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        sm_scale: float | None = None,
        q_data_type: torch.dtype = torch.float16,
        kv_data_type: torch.dtype | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        non_blocking: bool = True,
        **unmodelled: Any,
    ) -> None:
        _require(not unmodelled, f"the double does not model {sorted(unmodelled)}")
        arrays = (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        for name, t in zip(("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"), arrays):
            _int32_vector(name, t)
        _require(head_dim_qk >= 64 and head_dim_qk % 16 == 0, f"FA2: Invalid configuration for head dim {head_dim_qk}")
        _require(num_qo_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads")
        _require(pos_encoding_mode == "NONE", "RoPE is applied by the model: pos_encoding_mode must be NONE")
        SYNCS.extend(self._syncs(*arrays, custom=custom_mask, packed=packed_custom_mask, non_blocking=non_blocking))
        qo, kv_ptr, indices, last = (t.cpu().numpy() for t in arrays)
        batch = len(qo) - 1
        _require(len(kv_ptr) == batch + 1, "qo_indptr and paged_kv_indptr must have the same length")
        _require(len(last) == batch, "paged_kv_last_page_len: one per request")
        _require(qo[0] == 0 and (np.diff(qo) >= 0).all(), "qo_indptr must start at 0 and not decrease")
        _require(kv_ptr[0] == 0 and (np.diff(kv_ptr) >= 1).all(), "every request needs at least one page")
        _require(len(indices) == kv_ptr[-1], "paged_kv_indices must hold exactly paged_kv_indptr[-1] pages")
        _require(((last >= 1) & (last <= page_size)).all(), "last page lengths must be in [1, page_size]")
        mask_bits = np.diff(qo) * ((np.diff(kv_ptr) - 1) * page_size + last)  # [B]: q_len * kv_len
        packed, mask_indptr = self._packed_mask(custom_mask, packed_custom_mask, mask_bits)
        if self.use_cuda_graph:
            self._fill_buffers(*arrays, packed, mask_indptr)
        else:  # `.to(self.device)`: a device tensor is kept as it is, a host one copied
            kept = [_to_device(t) for t in (*arrays, packed, mask_indptr)]
            self._qo_indptr_buf, self._paged_kv_indptr_buf, self._paged_kv_indices_buf = kept[:3]
            self._paged_kv_last_page_len_buf, self._custom_mask_buf, self._mask_indptr_buf = kept[3:]
        self._plan = _Plan(
            qo, num_qo_heads, num_kv_heads, head_dim_qk, page_size,
            sm_scale if sm_scale is not None else head_dim_qk**-0.5, q_data_type, kv_data_type or q_data_type,
            window_left, logits_soft_cap or 0.0, causal,
        )  # fmt: skip
        self._runs = 0

    def _syncs(self, *arrays: torch.Tensor, custom: Any, packed: Any, non_blocking: bool) -> list[str]:
        """What the real plan() would block the host on, given where its inputs are."""
        syncs = [] if non_blocking else ["non_blocking=False: every copy plan() makes is a blocking one"]
        named = dict(zip(("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"), arrays))
        if packed is not None:
            named["packed_custom_mask"] = packed
        elif custom is not None:
            syncs.append("custom_mask: plan() packs it with segment_packbits, which reads indptr_new[-1].item()")
        for name, t in named.items():
            where, copied_by_graph = _where(t), name in ("paged_kv_indices", "packed_custom_mask")
            if where == "device" and not copied_by_graph:
                syncs.append(f"{name} on the device: plan() reads it back with .to('cpu'), a blocking copy")
            elif where != "device" and copied_by_graph and self.use_cuda_graph:
                syncs.append(f"{name} on the host: graph-mode plan() copies it with non_blocking=False")
            elif where == "pageable":
                syncs.append(f"{name} in pageable memory: plan()'s cudaMemcpyAsync from it may block")
        return syncs

    def _packed_mask(
        self, custom_mask: torch.Tensor | None, packed_custom_mask: torch.Tensor | None, mask_bits: np.ndarray
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The packed mask plan() keeps, and its offsets: segment_packbits' bytes for a bool mask,
        `_compute_page_mask_indptr`'s bits for a packed one (0.7.2)."""
        if custom_mask is None and packed_custom_mask is None:
            return None, None
        # A custom mask runs on FA2 only; `auto` picks FA3 on Hopper, where a masked plan fails.
        _require(self.backend == "fa2", f"a custom mask needs backend='fa2', the wrapper has {self.backend!r}")
        if packed_custom_mask is not None:
            _require(packed_custom_mask.dtype == torch.uint8, "packed_custom_mask holds packed bits: uint8")
            _require(packed_custom_mask.dim() == 1, "packed_custom_mask must be 1-D")
            bit_indptr = np.concatenate(([0], np.cumsum(mask_bits))).astype(np.int32)
            return packed_custom_mask, torch.from_numpy(bit_indptr)
        assert custom_mask is not None
        _require(custom_mask.dtype == torch.bool, "custom_mask must be bool")
        _require(custom_mask.device == self.device, "custom_mask must be on the device (segment_packbits)")
        _require(_where(custom_mask) == "device", "custom_mask is host memory: segment_packbits needs a CUDA tensor")
        _require(custom_mask.numel() == int(mask_bits.sum()), "custom_mask must hold q_len * kv_len bits per request")
        return segment_packbits(custom_mask, mask_bits)

    def _fill_buffers(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        packed: torch.Tensor | None,
        mask_indptr: torch.Tensor | None,
    ) -> None:
        """Graph mode: the plan copied into the constructor's buffers, the kernels' fixed inputs."""
        batch, rows = len(qo_indptr) - 1, int(qo_indptr[-1])
        _require(batch == self.fixed_batch_size, f"batch size {batch} != the graph's fixed {self.fixed_batch_size}")
        if self._max_rows is None:
            self._max_rows = rows  # the first plan (the capture's) fixes the most rows
        _require(rows <= self._max_rows, f"{rows} rows exceed the {self._max_rows} planned at capture")
        buffers = self._index_buffers()
        _require(len(paged_kv_indices) <= len(buffers[2]), "paged_kv_indices exceeds the allocated buffer size")
        for buf, t in zip(buffers, (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)):
            buf[: len(t)].copy_(t)
        if packed is not None:
            for name, buf in (("custom_mask_buf", self._custom_mask_buf), ("mask_indptr_buf", self._mask_indptr_buf)):
                _require(torch.is_tensor(buf), f"{name} must be given in graph mode to use a mask")
            assert self._custom_mask_buf is not None and self._mask_indptr_buf is not None
            _require(len(packed) <= len(self._custom_mask_buf), "the packed mask exceeds custom_mask_buf")
            self._custom_mask_buf[: len(packed)].copy_(packed)
            self._mask_indptr_buf.copy_(mask_indptr)

    def _index_buffers(self) -> tuple[torch.Tensor, ...]:
        """The kernels' qo_indptr, kv_indptr, kv_indices and last_page_len buffers."""
        buffers = (self._qo_indptr_buf, self._paged_kv_indptr_buf, self._paged_kv_indices_buf)
        buffers += (self._paged_kv_last_page_len_buf,)
        assert all(b is not None for b in buffers)
        return buffers  # type: ignore[return-value]

    def run(
        self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor], return_lse: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[T, Hq, D] in q's dtype; with `return_lse`, also each row's log-sum-exp of its scaled
        (capped) scores, [T, Hq] float32 in base 2 as the kernels write it (-inf where no key)."""
        plan = self._plan
        _require(plan is not None, "run() before plan()")
        assert plan is not None
        self._runs += 1
        _require(self._runs <= RUNS_PER_PLAN[0], "more runs than layers since the last plan(): a step was not planned")
        k_pages, v_pages = paged_kv_cache
        _require(q.dtype == plan.q_dtype, f"q is {q.dtype}, planned {plan.q_dtype}")
        _require(k_pages.dtype == v_pages.dtype == plan.kv_dtype, f"the cache is {k_pages.dtype}, not {plan.kv_dtype}")
        _require(q.device == k_pages.device == self.device, "q and the cache must be on the workspace's device")
        rows = int(plan.qo_indptr[-1]) if not self.use_cuda_graph else self._max_rows
        want = (rows, plan.num_qo_heads, plan.head_dim)
        _require(tuple(q.shape) == want, f"q must be [{rows}, Hq, D] as planned, got {tuple(q.shape)}")
        shape = (plan.page_size, plan.num_kv_heads, plan.head_dim)
        _require(k_pages.dim() == 4 and tuple(k_pages.shape[1:]) == shape, "the cache is [pages, page_size, Hkv, D]")
        _require(k_pages.shape == v_pages.shape, "K and V pages must have one shape")
        # Read the plan back from the buffers the kernels read (in graph mode, the fixed ones).
        qo, kv_ptr, all_indices, last = (b.cpu().numpy() for b in self._index_buffers())
        indices = all_indices[: kv_ptr[-1]].astype(np.int64)
        _require(((indices >= 0) & (indices < k_pages.shape[0])).all(), "a page index is outside the cache")
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), device=q.device)
        for i in range(len(qo) - 1):
            q0, q1 = int(qo[i]), int(qo[i + 1])
            if q0 == q1:
                continue
            pages = torch.from_numpy(indices[kv_ptr[i] : kv_ptr[i + 1]])
            kv_len = (len(pages) - 1) * plan.page_size + int(last[i])
            k = k_pages[pages].reshape(-1, plan.num_kv_heads, plan.head_dim)[:kv_len].float()  # [kv, Hkv, D]
            v = v_pages[pages].reshape(-1, plan.num_kv_heads, plan.head_dim)[:kv_len].float()
            o, row_lse = self._attend(plan, q[q0:q1], k, v, i)
            out[q0:q1], lse[q0:q1] = o.transpose(0, 1), row_lse.T
        return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)

    def _attend(
        self, plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Request i: q [q_len, Hq, D], k and v [kv_len, Hkv, D] float32 -> [Hq, q_len, D] float32
        and the rows' base-2 log-sum-exp [Hq, q_len]."""
        q_len, kv_len = len(q), len(k)
        pos, keys = kv_len - q_len + torch.arange(q_len), torch.arange(kv_len)[None, :]  # rows' places in the KV
        # MaskMode.CUSTOM whenever the wrapper holds a mask buffer (a graph wrapper's always does), a mask
        # given or not; else CAUSAL (aligned to the keys' end) or NON_CAUSAL.
        if self._custom_mask_buf is not None:
            mask = self.mask(i, q_len, kv_len)
        else:
            mask = keys <= pos[:, None] if plan.causal else torch.ones(q_len, kv_len).bool()
        if plan.window_left >= 0:  # by the row's place in the KV, as the kernel counts it
            mask &= keys >= (pos - plan.window_left)[:, None]
        qh, kh, vh = q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, n, D]
        group = qh.shape[0] // kh.shape[0]
        kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
        scores = qh @ kh.transpose(1, 2) * plan.sm_scale  # [Hq, q_len, kv_len]
        if plan.logits_soft_cap:
            scores = torch.tanh(scores / plan.logits_soft_cap) * plan.logits_soft_cap
        scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, -1) / math.log(2.0)  # [Hq, q_len]
        return torch.softmax(scores, -1).nan_to_num(0.0) @ vh, lse  # a row with no key: 0, as the kernel's

    def mask(self, i: int, q_len: int, kv_len: int) -> torch.Tensor:
        """Request i's [q_len, kv_len] mask as the kernel reads it (`variants.cuh`): element (r, c) is bit
        o % 8 of byte `_mask_indptr_buf[i]` + o // 8 of `_custom_mask_buf`, o = r * kv_len + c."""
        assert self._custom_mask_buf is not None and self._mask_indptr_buf is not None
        start, nbytes = int(self._mask_indptr_buf[i]), -(-q_len * kv_len // 8)
        _require(start + nbytes <= len(self._custom_mask_buf), "the mask offsets run past custom_mask_buf")
        raw = self._custom_mask_buf[start : start + nbytes].cpu().numpy()  # [nbytes] uint8
        offset = np.arange(q_len * kv_len)
        bits = (raw[offset // 8] >> (offset % 8)) & 1
        return torch.from_numpy(bits.astype(bool).reshape(q_len, kv_len))


def _to_device(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t.to(device)`: the tensor itself when it is on the device already, else a device copy."""
    return t if t is None or _where(t) == "device" else t.clone()


def segment_packbits(mask: torch.Tensor, bits: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's `segment_packbits(mask, indptr, bitorder="little")` (SegmentPackBitsKernel): request i's
    `bits[i]` elements 8 at a time, missing ones 0, byte value sum(element[8k + j] << j), at byte offsets
    new_indptr[i] = sum((bits[:i] + 7) // 8). Returns (packed [new_indptr[-1]] uint8, new_indptr [B + 1] int32)."""
    flat, starts = mask.cpu().numpy().astype(np.uint8), np.concatenate(([0], np.cumsum(bits)))
    new_indptr = np.concatenate(([0], np.cumsum((bits + 7) // 8))).astype(np.int32)
    packed = np.zeros(int(new_indptr[-1]), np.uint8)
    weights = (1 << np.arange(8)).astype(np.uint8)  # little: element j of a group is bit j
    for i, n in enumerate(bits.tolist()):
        segment = np.zeros(-(-n // 8) * 8, np.uint8)
        segment[:n] = flat[starts[i] : starts[i] + n]
        packed[new_indptr[i] : new_indptr[i + 1]] = segment.reshape(-1, 8) @ weights
    return torch.from_numpy(packed).to(mask.device), torch.from_numpy(new_indptr).to(mask.device)
