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
