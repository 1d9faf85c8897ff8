"""Thread counts per op, so that torch never splits one row's work between threads.

torch runs an elementwise op on one thread below GRAIN_SIZE elements; above it, it cuts the
flattened tensor into `min(threads, ceil(n / GRAIN_SIZE))` equal chunks, one per thread, each a
vectorized loop with a scalar tail. A chunk boundary in the middle of a row puts some of the row's
elements in a scalar tail in one step and in a vector loop in another, and transcendental
functions (silu's exp, softmax's exp) differ in the last bit between the two: a row's bits then
depend on the step's row count and on the thread count. `row_threads` picks, per op, the most
threads at which every chunk is whole rows with no tail, which computes each row exactly as one
thread does; reductions over rows wider than GRAIN_SIZE (the sampler's vocabulary-wide sums) are
split inside the row, so they run on one thread (`torch_threads(1)`).

And how many threads the server runs: torch's default is every core of the machine, which in a
container is the node's, not the pod's (`resolve_threads`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

THREADS_ENV = "BATCHSERVE_NUM_THREADS"  # the server's thread count where no flag sets it
# ATen's internal::GRAIN_SIZE: elementwise ops on at most this many elements run on one thread.
GRAIN_SIZE = 32768
# Elements one step of a vectorized elementwise loop takes (two AVX-512 vectors of bfloat16; a
# multiple of every narrower case): a chunk of a multiple of it has no scalar tail.
VECTOR_STEP = 64


def row_threads(rows: int, width: int, threads: int | None = None) -> int:
    """The most threads (at most `threads`, default torch's) at which an elementwise op over
    [rows, width] computes every row as one thread would: one chunk, or whole rows per chunk and
    no tail. 1 where no split qualifies."""
    threads = torch.get_num_threads() if threads is None else threads
    n = rows * width
    if n <= GRAIN_SIZE or threads <= 1:
        return threads  # one chunk at any thread count
    for t in range(threads, 1, -1):
        chunks = min(t, -(-n // GRAIN_SIZE))
        if rows % chunks == 0 and (rows // chunks * width) % VECTOR_STEP == 0:
            return t
    return 1


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside the block (a cheap switch: the pool stays)."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def rows_whole(rows: int, width: int) -> Iterator[None]:
    """`torch_threads(row_threads(rows, width))`: an elementwise op over [rows, width] inside the
    block gives each row the bits one thread gives it."""
    with torch_threads(row_threads(rows, width)):
        yield


def set_threads(n: int | None) -> None:
    """torch's intra-op threads to `n` (None: left as they are)."""
    if n is not None:
        torch.set_num_threads(n)


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPUs this process's cgroup may use (its CFS quota over its period), or None where it
    sets no quota: cgroup v2's `cpu.max`, else v1's `cpu.cfs_quota_us` and `cpu.cfs_period_us`."""
    base = Path(root)
    try:
        quota, period = (base / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((base / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((base / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def available_cpus(root: str = "/sys/fs/cgroup") -> tuple[int, str]:
    """(cores this process may use, where that comes from): its CPU affinity, capped by its
    cgroup's quota (rounded down: threads past a quota wait for the next period)."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None and int(limit) < affinity:
        return max(1, int(limit)), f"the cgroup's CPU quota of {limit:g}"
    return affinity, "the CPU affinity"


def resolve_threads(setting: int | None, environ: Mapping[str, str] = os.environ) -> tuple[int, str]:
    """(torch threads to run, why): the setting, else $BATCHSERVE_NUM_THREADS (the deployment sets
    it from the pod's CPU limit), else `available_cpus()`. Raises ValueError for a bad value."""
    if setting is not None:
        return setting, "--num-threads"
    raw = environ.get(THREADS_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{THREADS_ENV} must be a whole number of threads >= 1, got {raw!r}")
        return value, f"${THREADS_ENV}"
    return available_cpus()
