"""Continuous batching and KV block bookkeeping (pure Python: no torch, no grpc). The step's
records it hands the runner live below it, in `batchserve.records`."""

from batchserve.scheduler.block_allocator import BlockAllocator, NoFreeBlocksError
from batchserve.scheduler.scheduler import Scheduler

__all__ = ["BlockAllocator", "NoFreeBlocksError", "Scheduler"]
