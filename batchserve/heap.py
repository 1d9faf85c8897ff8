"""The process's long-lived heap, kept out of the cyclic garbage collector's full passes.

A loaded engine holds a few hundred thousand long-lived Python objects (torch modules, the
tokenizer, imported libraries, a warmed trie). A full collection walks all of them: a pause
of several steps' time, landing on whatever request is running (benchmarks/README.md).
Freezing them after startup leaves the collector only what serving creates. Reference
counting still frees frozen objects that are dropped; only a frozen object in a reference
cycle outlives its use, so the heap is collected first and frozen only where it lives as long
as the process (or is unfrozen after, below).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def settle() -> None:
    """Collect, then freeze every object left: call once the server's engine has loaded."""
    gc.collect()
    gc.freeze()


@contextmanager
def settled() -> Iterator[None]:
    """`settle` for a measured run of an engine that does not outlive the process (the bench):
    the frozen objects are handed back to the collector when the block ends."""
    settle()
    try:
        yield
    finally:
        gc.unfreeze()
