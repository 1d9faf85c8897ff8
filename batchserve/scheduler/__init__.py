"""Continuous batching and KV block bookkeeping (pure Python: no torch, no grpc)."""

from batchserve.scheduler.block_allocator import BlockAllocator, NoFreeBlocksError
from batchserve.scheduler.output import RunnerOutput, ScheduledRequest, SchedulerOutput, StepPhases
from batchserve.scheduler.scheduler import Scheduler

__all__ = [
    "BlockAllocator",
    "NoFreeBlocksError",
    "RunnerOutput",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "StepPhases",
]
