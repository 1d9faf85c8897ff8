"""A FlashInfer plan's inputs on their way to the device, without a host sync: the mask bit-packed
on the host, pinned staging buffers, non-blocking copies, and an event that guards reuse.

What FlashInfer 0.7.2's `BatchPrefillWithPagedKVCacheWrapper.plan()` does with each input (its
`prefill.py`), and so how each is handed to it:
- `qo_indptr`, `paged_kv_indptr`, `paged_kv_last_page_len`: read on the host (`.to("cpu")`, a
  blocking copy were they on the device), then copied to the device non-blocking. Handed as pinned
  host tensors, so that copy is truly asynchronous.
- `paged_kv_indices`, `packed_custom_mask`: in graph mode copied into the wrapper's buffers with
  `non_blocking=(tensor.device == self.device)`: a host tensor is a blocking copy (a stream sync).
  Handed as device tensors, filled here from pinned memory by non-blocking copies.
- `custom_mask` (bool) is never used: plan() packs it with `segment_packbits`, which reads
  `indptr_new[-1].item()` (a sync). `pack_masks` does the same packing on the host.
- With `packed_custom_mask`, plan() sets the mask offsets to `_compute_page_mask_indptr`: running
  sums of q_len * kv_len, in bits, while the kernel adds them to a byte pointer
  (`variants.cuh`: `maybe_custom_mask + maybe_mask_indptr[batch_idx]`). So after plan() the
  byte offsets are written over the wrapper's `_mask_indptr_buf` (in graph mode the buffer given
  to its constructor), by a non-blocking copy on the same stream, before any kernel reads them.

The copies read the pinned buffers when the stream reaches them, so a buffer is written again
only after `event` (recorded after plan()) has passed. The event also covers plan()'s own copy
from the wrapper's pinned int workspace (`scheduler.cuh`, `cudaMemcpyAsync`), which the next
plan() of that wrapper overwrites on the host without any guard of its own.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch


def pack_masks(mask: np.ndarray, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FlashInfer's `segment_packbits(mask, indptr, bitorder="little")` on the host.
    `mask` [sum bits] bool: each request's `bits[i]` elements back to back. Returns the packed
    [sum ceil(bits / 8)] uint8 (bit j of byte k is element 8k + j of the segment, each segment's
    last byte zero-padded, segments back to back) and the [B + 1] int32 byte offsets of the segments."""
    nbytes = (bits + 7) // 8  # [B]
    byte_ptr = np.zeros(len(bits) + 1, np.int32)
    np.cumsum(nbytes, out=byte_ptr[1:])
    bit_ptr = np.concatenate(([0], np.cumsum(bits)))  # [B + 1]
    # Each request's bits moved to its segment's whole-byte start, then packed in one call.
    padded = np.zeros(8 * int(byte_ptr[-1]), bool)
    padded[np.arange(len(mask)) + np.repeat(8 * byte_ptr[:-1] - bit_ptr[:-1], bits)] = mask
    return np.packbits(padded, bitorder="little"), byte_ptr


class Event(Protocol):
    def record(self) -> None: ...
    def synchronize(self) -> None: ...


class HostEvent:
    """A CPU run's event: its copies completed before they returned."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def make_event(device: torch.device) -> Event:
    return torch.cuda.Event() if device.type == "cuda" else HostEvent()


def host_buffer(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[size] host memory to copy to `device` from: pinned for a CUDA device (an asynchronous copy)."""
    return torch.empty(size, dtype=dtype, pin_memory=device.type == "cuda")


class PlanStaging:
    """One wrapper's plan inputs: host buffers (pinned on CUDA) and device buffers, reused and grown
    across steps, and the event that says when the host buffers may be written again.

    Use: `stage(plan)`, then the wrapper's plan() with what it returns, then `fix_mask_offsets`
    (a masked plan), then `done()`. One per wrapper: in eager mode the wrapper keeps the device
    tensors it was handed, and each kind of layer has its own mask. The device buffers are
    rewritten in stream order, so, as a graph bucket's own buffers already require, a step's
    forward must be queued before the next step is planned (the runner launches it at once)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.event = make_event(device)
        self._host: dict[str, torch.Tensor] = {}
        self._device: dict[str, torch.Tensor] = {}
        self._mask_indptr = torch.zeros(0, dtype=torch.int32)

    def stage(self, plan: Any, masked: bool) -> dict[str, torch.Tensor]:
        """The wrapper's inputs for `plan` (a PagedPlan): host indptr arrays, device page indices and,
        if `masked`, the device packed mask. Waits for the last plan's copies first (normally long done)."""
        self.event.synchronize()
        staged = {name: self._on_host(name, getattr(plan, name)) for name in ("qo_indptr", "kv_indptr")}
        staged["kv_last_page_len"] = self._on_host("kv_last_page_len", plan.kv_last_page_len)
        staged["kv_indices"] = self._on_device("kv_indices", plan.kv_indices)
        if masked:
            staged["packed_mask"] = self._on_device("packed_mask", plan.packed_mask)
            self._mask_indptr = self._on_host("mask_indptr", plan.mask_indptr)
        return staged

    def fix_mask_offsets(self, wrapper: Any) -> None:
        """Write the packed mask's byte offsets over the bit offsets plan() left in the wrapper."""
        target = getattr(wrapper, "_mask_indptr_buf", None)
        n = len(self._mask_indptr)
        # (device types: the backend's may be "cuda", a tensor's is "cuda:0")
        if not (torch.is_tensor(target) and target.shape == (n,) and target.device.type == self.device.type):
            raise RuntimeError(
                "this FlashInfer keeps its mask offsets elsewhere than `_mask_indptr_buf` [batch + 1] on the "
                "device (read in 0.7.2): check how its plan() derives them from packed_custom_mask"
            )
        target.copy_(self._mask_indptr, non_blocking=True)

    def done(self) -> None:
        """After plan() (and `fix_mask_offsets`): the host buffers are free once the stream passes here."""
        self.event.record()

    def _on_host(self, name: str, src: torch.Tensor) -> torch.Tensor:
        buf = self._grown(self._host, name, src, host=True)
        buf.copy_(src)
        return buf

    def _on_device(self, name: str, src: torch.Tensor) -> torch.Tensor:
        out = self._grown(self._device, name, src, host=False)
        out.copy_(self._on_host(name, src), non_blocking=True)
        return out

    def _grown(self, store: dict[str, torch.Tensor], name: str, src: torch.Tensor, host: bool) -> torch.Tensor:
        """store[name][:len(src)], reallocated (twice the size) if too small: only after `stage`'s wait,
        so no copy still reads the old one."""
        n, buf = src.numel(), store.get(name)
        if buf is None or len(buf) < n:
            size = max(n, 2 * len(buf)) if buf is not None else n
            if host:
                buf = host_buffer(size, src.dtype, self.device)
            else:
                buf = torch.empty(size, dtype=src.dtype, device=self.device)
            store[name] = buf
        return buf[:n]
