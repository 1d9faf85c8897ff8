"""The scheduler's book of requests: the waiting queue, the running list and every unfinished
request by id, and their entry and exit (added, aborted, finished, failed), the pool's blocks
freed on every way out. `Scheduler` (scheduler.py) composes the steps over it."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from batchserve.request import FinishReason, Request, RequestStatus
from batchserve.scheduler.block_allocator import BlockAllocator


class RequestBook:
    """Requests waiting and running over one KV pool, by id; each leaves with its blocks freed."""

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request
        self._arrivals = itertools.count()
        self._finished_ids: list[str] = []  # for the runner, since the last schedule()
        self._failed: list[Request] = []  # ended by schedule() itself: their final outputs are owed

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        longest = min(req.num_prompt_tokens + req.params.max_new_tokens, req.max_total_len)
        capacity = self.allocator.num_blocks * self.allocator.block_size
        if longest > capacity:
            raise ValueError(
                f"request needs up to {longest} KV slots (prompt + max_new_tokens) but the KV cache "
                f"holds {capacity}; lower max_new_tokens or enlarge the cache"
            )
        req.status = RequestStatus.WAITING
        req.arrival_seq = next(self._arrivals)
        self.requests[req.request_id] = req
        self.waiting.append(req)
        # NOTE: the drafter hears of the request only when it first runs (a step drafts for it):
        # a waiting request costs nothing there, whatever its prompt.

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its blocks are free before the next step. False if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish(req, FinishReason.CANCELLED)
        return True

    def finish(self, req: Request, reason: FinishReason) -> None:
        if req.is_finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.allocator.free(req.block_ids)
        req.block_ids = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def take_failed(self) -> list[Request]:
        """The requests schedule() ended since the last call (their grammar failed): each needs
        its final output."""
        failed, self._failed = self._failed, []
        return failed

    def fail(self, request_ids: Iterable[str], error: str, reason: FinishReason = FinishReason.ERROR) -> list[Request]:
        """Finish these requests with `reason` and `error` as their message (the others go on)."""
        failed = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                req.error = error
                self.finish(req, reason)
                failed.append(req)
        return failed

    def check_integrity(self) -> None:
        """Assert the pool's and the requests' bookkeeping agree (tests call it between steps)."""
        owners = [r.block_ids for r in self.requests.values()]
        self.allocator.check_integrity(owners)
        for r in self.waiting:
            assert r.status is RequestStatus.WAITING and not r.block_ids, r.request_id
        for r in self.running:
            assert r.status is RequestStatus.RUNNING, r.request_id
            # Between steps a request holds exactly the blocks of its computed K/V: rejected
            # drafts' blocks went back to the pool (trim_blocks).
            assert self.allocator.blocks_for(r.num_computed_tokens) == len(r.block_ids), r.request_id
        assert len(self.waiting) + len(self.running) == len(self.requests)
