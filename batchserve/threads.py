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
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

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
