"""Host arrays to the device in one copy per call, never blocking on the kernels in flight."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class Upload:
    """Copies host arrays of one dtype to the device together: zero-copy views on the CPU; on
    CUDA one asynchronous copy through a reused pinned staging buffer, split on the device.

    NOTE: the buffer is reused only once the copy out of it has completed (an event recorded after
    it), not the whole stream: the step's host work runs while its kernels do, and a stream-wide
    wait there would end that overlap."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.int64) -> None:
        self.device = device
        self.dtype = dtype
        self._host: torch.Tensor | None = None
        self._copied: Any = None  # torch.cuda.Event recorded after the last copy out of _host

    def __call__(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            np_dtype = torch.empty(0, dtype=self.dtype).numpy().dtype
            return [torch.from_numpy(np.asarray(a, dtype=np_dtype)) for a in arrays]
        sizes = [len(a) for a in arrays]
        total = sum(sizes)
        if self._copied is not None:
            self._copied.synchronize()
        capacity = 0 if self._host is None else len(self._host)
        if capacity < total:
            self._host = torch.empty(max(total, 2 * capacity), dtype=self.dtype).pin_memory()
        assert self._host is not None
        staged = self._host[:total]
        np.concatenate(arrays, out=staged.numpy(), casting="same_kind")
        on_device = staged.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        return list(on_device.split(sizes))


class Readback:
    """A step's small int64 result brought to the host without waiting for the whole device: on
    CUDA a non-blocking copy on a stream of its own (after the compute stream's work so far) into
    pinned memory, and an event the host waits on in `wait`; on the CPU the tensor itself.

    NOTE: a pinned buffer is reused only after `wait` on the copy out of it has returned; `start`
    takes the other of two, so one step's result may be in flight while the next one starts."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Any = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._buffers = [torch.empty(0, dtype=torch.int64) for _ in range(2)]  # pinned once grown
        self._turn = 0

    def start(self, result: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Begin copying `result` ([N] int64) to the host; (the host tensor, an event or None)."""
        if self._stream is None:
            return result, None
        self._turn ^= 1
        host = self._buffers[self._turn]
        if len(host) < len(result):
            host = torch.empty(max(len(result), 2 * len(host)), dtype=torch.int64).pin_memory()
            self._buffers[self._turn] = host
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            out = host[: len(result)]
            out.copy_(result, non_blocking=True)
            result.record_stream(self._stream)  # the compute stream may not reuse it before the copy
            done = torch.cuda.Event()
            done.record(self._stream)
        return out, done

    @staticmethod
    def wait(pending: tuple[torch.Tensor, Any]) -> list[int]:
        """The result on the host, once its copy has completed."""
        host, done = pending
        if done is not None:
            done.synchronize()
        return host.tolist()
