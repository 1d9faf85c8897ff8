"""A stand-in for `flashinfer` that enforces what its paged prefill wrapper requires, on the CPU.

`BatchPrefillWithPagedKVCacheWrapper` here checks every rule the real wrapper (FlashInfer
0.7.2.post1, `prefill.py` and `attention/scheduler.cuh`) enforces or silently relies on, raising
`ContractError` where the real one raises, fails in a CUDA kernel, or computes garbage, and then
attends densely from what it was planned with, read back from the same buffers the real kernels
read (in graph mode the constructor's fixed buffers, and the mask bit-packed into
`custom_mask_buf`). So a plan that only works by accident, say a buffer too small or a mask
offset wrong, gives wrong output here as it would there.

Where the double and the real library can disagree:
- "On the device": on a CPU run every tensor is on the CPU. The real `plan()` packs the custom
  mask with a CUDA kernel (`segment_packbits`, which checks its input is a CUDA tensor); here a
  mask counts as on the device unless it shares memory with a tensor registered in `HOST` (the
  tests register the host-side plan the backend builds), so a backend that hands the host mask to
  `plan()` is caught, while a copy made for the device passes.
- Head dims: the real FA2 kernels fail below 64 ("Invalid configuration") after a JIT build; the
  double refuses them at `plan()`. Whether a dim such as 80 or 96 builds is not modelled.
- Numerics: the double attends in float32 and rounds once; FlashInfer's kernels round differently
  (split KV, bf16 products). Tests compare the double with the reference in float32, not with a GPU.
- Planning cost, split-KV chunking and the query-tile choice are not modelled, only their
  preconditions (a fixed batch size, rows within the first plan's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

HOST: set[int] = set()  # data pointers of host-side tensors (never valid as device inputs)


class ContractError(Exception):
    """What the real FlashInfer would refuse, or get wrong without saying so."""


def mark_host(*tensors: torch.Tensor) -> None:
    HOST.update(t.untyped_storage().data_ptr() for t in tensors)


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
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    last_page_len: np.ndarray
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    masked: bool
    sm_scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    window_left: int  # -1: none; else a row at position p (kv_len - q_len + its index) sees keys p - window_left ..
    logits_soft_cap: float  # 0: none; else each scaled score s -> cap * tanh(s / cap)


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
            if custom_mask_buf is not None:
                _require(custom_mask_buf.dtype == torch.uint8, "custom_mask_buf holds packed bits: uint8")
            if mask_indptr_buf is not None:
                _int32_vector("mask_indptr_buf", mask_indptr_buf)
                _require(len(mask_indptr_buf) == self.fixed_batch_size + 1, "mask_indptr_buf: batch_size + 1")
        self.qo_indptr_buf = qo_indptr_buf
        self.kv_indptr_buf = paged_kv_indptr_buf
        self.kv_indices_buf = paged_kv_indices_buf
        self.last_page_len_buf = paged_kv_last_page_len_buf
        self.custom_mask_buf = custom_mask_buf
        self.mask_indptr_buf = mask_indptr_buf

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
        **unmodelled: Any,
    ) -> None:
        _require(not unmodelled, f"the double does not model {sorted(unmodelled)}")
        # The real packed-mask path computes mask offsets in bits where the kernel reads bytes.
        _require(packed_custom_mask is None, "pass custom_mask (bool); packed_custom_mask's offsets are per bit")
        for name, t in (
            ("qo_indptr", qo_indptr),
            ("paged_kv_indptr", paged_kv_indptr),
            ("paged_kv_indices", paged_kv_indices),
            ("paged_kv_last_page_len", paged_kv_last_page_len),
        ):
            _int32_vector(name, t)
        _require(head_dim_qk >= 64 and head_dim_qk % 16 == 0, f"FA2: Invalid configuration for head dim {head_dim_qk}")
        _require(num_qo_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads")
        _require(pos_encoding_mode == "NONE", "RoPE is applied by the model: pos_encoding_mode must be NONE")
        qo, kv_ptr = qo_indptr.cpu().numpy(), paged_kv_indptr.cpu().numpy()
        indices, last = paged_kv_indices.cpu().numpy(), paged_kv_last_page_len.cpu().numpy()
        batch = len(qo) - 1
        _require(len(kv_ptr) == batch + 1, "qo_indptr and paged_kv_indptr must have the same length")
        _require(len(last) == batch, "paged_kv_last_page_len: one per request")
        _require(qo[0] == 0 and (np.diff(qo) >= 0).all(), "qo_indptr must start at 0 and not decrease")
        _require(kv_ptr[0] == 0 and (np.diff(kv_ptr) >= 1).all(), "every request needs at least one page")
        _require(len(indices) == kv_ptr[-1], "paged_kv_indices must hold exactly paged_kv_indptr[-1] pages")
        _require(((last >= 1) & (last <= page_size)).all(), "last page lengths must be in [1, page_size]")
        kv_len = (np.diff(kv_ptr) - 1) * page_size + last
        mask_bits = np.diff(qo) * kv_len  # [B]
        if custom_mask is not None:
            # A custom mask runs on FA2 only; `auto` picks FA3 on Hopper, where a masked plan fails.
            _require(self.backend == "fa2", f"a custom mask needs backend='fa2', the wrapper has {self.backend!r}")
            _require(custom_mask.dtype == torch.bool, "custom_mask must be bool")
            _require(custom_mask.device == self.device, "custom_mask must be on the device (segment_packbits)")
            _require(
                custom_mask.untyped_storage().data_ptr() not in HOST,
                "custom_mask is host memory: plan() packs it with a CUDA kernel (CHECK_INPUT: must be a CUDA tensor)",
            )
            bits = int(mask_bits.sum())
            _require(custom_mask.numel() == bits, "custom_mask must hold q_len * kv_len bits per request")
        rows = int(qo[-1])
        if self.use_cuda_graph:
            _require(batch == self.fixed_batch_size, f"batch size {batch} != the graph's fixed {self.fixed_batch_size}")
            if self._max_rows is None:
                self._max_rows = rows  # the first plan (the capture's) fixes the most rows
            _require(rows <= self._max_rows, f"{rows} rows exceed the {self._max_rows} planned at capture")
            assert self.kv_indices_buf is not None
            _require(len(indices) <= len(self.kv_indices_buf), "paged_kv_indices exceeds the allocated buffer size")
            assert self.qo_indptr_buf is not None and self.kv_indptr_buf is not None
            assert self.last_page_len_buf is not None
            self.qo_indptr_buf.copy_(qo_indptr)
            self.kv_indptr_buf.copy_(paged_kv_indptr)
            self.last_page_len_buf.copy_(paged_kv_last_page_len)
            self.kv_indices_buf[: len(indices)].copy_(paged_kv_indices)
            if custom_mask is not None:
                _require(self.custom_mask_buf is not None, "custom_mask_buf must be given in graph mode to use a mask")
                _require(self.mask_indptr_buf is not None, "mask_indptr_buf must be given in graph mode to use a mask")
                packed, byte_ptr = _pack(custom_mask, mask_bits)
                assert self.custom_mask_buf is not None and self.mask_indptr_buf is not None
                _require(len(packed) <= len(self.custom_mask_buf), "the packed mask exceeds custom_mask_buf")
                self.custom_mask_buf[: len(packed)].copy_(packed)
                self.mask_indptr_buf.copy_(byte_ptr)
        else:
            self.qo_indptr_buf, self.kv_indptr_buf = qo_indptr.clone(), paged_kv_indptr.clone()
            self.kv_indices_buf, self.last_page_len_buf = paged_kv_indices.clone(), paged_kv_last_page_len.clone()
            self.custom_mask_buf, self.mask_indptr_buf = (
                _pack(custom_mask, mask_bits) if custom_mask is not None else (None, None)
            )
        self._plan = _Plan(
            qo, kv_ptr, indices, last, num_qo_heads, num_kv_heads, head_dim_qk, page_size,
            custom_mask is not None, sm_scale if sm_scale is not None else head_dim_qk**-0.5,
            q_data_type, kv_data_type or q_data_type, window_left, logits_soft_cap or 0.0,
        )  # fmt: skip
        self._runs = 0

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
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
        assert self.qo_indptr_buf is not None and self.kv_indptr_buf is not None
        assert self.kv_indices_buf is not None and self.last_page_len_buf is not None
        qo = self.qo_indptr_buf.cpu().numpy()
        kv_ptr, last = self.kv_indptr_buf.cpu().numpy(), self.last_page_len_buf.cpu().numpy()
        indices = self.kv_indices_buf[: kv_ptr[-1]].cpu().numpy().astype(np.int64)
        _require(((indices >= 0) & (indices < k_pages.shape[0])).all(), "a page index is outside the cache")
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for i in range(len(qo) - 1):
            q0, q1 = int(qo[i]), int(qo[i + 1])
            if q0 == q1:
                continue
            pages = torch.from_numpy(indices[kv_ptr[i] : kv_ptr[i + 1]])
            kv_len = (len(pages) - 1) * plan.page_size + int(last[i])
            k = k_pages[pages].reshape(-1, plan.num_kv_heads, plan.head_dim)[:kv_len].float()  # [kv, Hkv, D]
            v = v_pages[pages].reshape(-1, plan.num_kv_heads, plan.head_dim)[:kv_len].float()
            mask = self._mask(i, q1 - q0, kv_len) if plan.masked else torch.ones(q1 - q0, kv_len, dtype=torch.bool)
            if plan.window_left >= 0:  # by the row's place in the KV, as the kernel counts it
                pos = kv_len - (q1 - q0) + torch.arange(q1 - q0)
                mask &= torch.arange(kv_len)[None, :] >= (pos - plan.window_left)[:, None]
            qh, kh, vh = q[q0:q1].float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, n, D]
            if plan.logits_soft_cap:
                group = qh.shape[0] // kh.shape[0]
                kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
                scores = torch.tanh(qh @ kh.transpose(1, 2) * plan.sm_scale / plan.logits_soft_cap)
                scores = (scores * plan.logits_soft_cap).masked_fill(~mask, float("-inf"))
                o = torch.softmax(scores, -1) @ vh
            else:
                o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=plan.sm_scale, enable_gqa=True)
            out[q0:q1] = o.transpose(0, 1)
        return out.to(q.dtype)  # [T, Hq, D]

    def _mask(self, i: int, q_len: int, kv_len: int) -> torch.Tensor:
        """Request i's [q_len, kv_len] mask unpacked from the packed bytes, as the kernel reads it."""
        assert self.custom_mask_buf is not None and self.mask_indptr_buf is not None
        start = int(self.mask_indptr_buf[i])
        nbytes = -(-q_len * kv_len // 8)
        _require(start + nbytes <= len(self.custom_mask_buf), "the mask offsets run past custom_mask_buf")
        raw = self.custom_mask_buf[start : start + nbytes].cpu().numpy()
        bits = np.unpackbits(raw, bitorder="little")[: q_len * kv_len]
        return torch.from_numpy(bits.astype(bool).reshape(q_len, kv_len))


def _pack(mask: torch.Tensor, bits: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """segment_packbits(bitorder="little"): each request's bits packed to whole bytes, and the byte
    offsets of the segments."""
    flat = mask.cpu().numpy()
    ends = np.cumsum(bits)
    segments = [np.packbits(flat[e - n : e], bitorder="little") for n, e in zip(bits, ends)]
    byte_ptr = np.concatenate(([0], np.cumsum([len(s) for s in segments]))).astype(np.int32)
    packed = np.concatenate(segments) if segments else np.zeros(0, np.uint8)
    return torch.from_numpy(packed).to(mask.device), torch.from_numpy(byte_ptr).to(mask.device)
