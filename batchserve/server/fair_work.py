"""Work done for calls off the event loop (tokenizing, templating, grammar compiling), one job at a
time on its thread, taken from the tenants in turn.

A single FIFO let one tenant keeping many calls of maximal prompts or distinct large schemas in
preparation make every other tenant wait behind all of them. Here each tenant has its own queue
and the thread takes the next job of the next tenant in a round: a tenant's wait for its turn is
at most one job of each other tenant, whatever they have queued. A job whose caller left, or whose
call gave its places to another tenant's (`drop`), is never started; a job once started runs to its
end (the thread cannot be interrupted). Everything but the job itself runs on the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(eq=False, slots=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]
    owner: object  # whose job (a call): `drop` ends the pending ones of an owner
    count: int  # the requests it is done for: held as "preparing" until it ends


class FairWork:
    """Jobs of each tenant in turn on one thread of `executor` (a single-worker pool)."""

    def __init__(self, executor: concurrent.futures.ThreadPoolExecutor) -> None:
        self.executor = executor
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()  # tenants in their round's order
        self._running: _Job | None = None
        self._last = ""  # the tenant whose job ran last
        self.preparing = 0  # requests whose jobs are queued or running

    async def run(self, tenant: str, owner: object, count: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the thread in `tenant`'s turn. A caller that leaves before its job starts
        takes it out of the queue; once started, it runs to its end."""
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop.create_future(), owner, count)
        self._queues.setdefault(tenant, deque()).append(job)
        self.preparing += count
        self._start_next()
        try:
            return await job.future
        except asyncio.CancelledError:  # the caller left: a job not started yet never starts
            queue = self._queues.get(tenant)
            if queue is not None and job in queue:
                queue.remove(job)
                self._end(job)
                if not queue:
                    del self._queues[tenant]
            raise

    def drop(self, owner: object, error: BaseException) -> int:
        """End `owner`'s jobs that have not started with `error` (the one running runs on); how many."""
        dropped = 0
        for tenant in list(self._queues):
            queue = self._queues[tenant]
            for job in [j for j in queue if j.owner is owner]:
                queue.remove(job)
                self._end(job)
                dropped += 1
                if not job.future.done():
                    job.future.set_exception(error)
            if not queue:
                del self._queues[tenant]
        return dropped

    def _start_next(self) -> None:
        """The next tenant's next job onto the thread, unless one is running."""
        while self._running is None and self._queues:
            if len(self._queues) > 1 and next(iter(self._queues)) == self._last:
                self._queues.move_to_end(self._last)  # it came back while its job ran: after the others
            tenant, queue = self._queues.popitem(last=False)
            self._last = tenant
            job = queue.popleft()
            if queue:
                self._queues[tenant] = queue  # the back of the round
            if job.future.done():  # its caller left while it waited
                self._end(job)
                continue
            self._running = job
            loop = job.future.get_loop()
            try:
                work = self.executor.submit(job.fn, *job.args)
            except RuntimeError as e:  # the pool is shut down (the server is stopping)
                self._finished(job, None, e)
                continue
            work.add_done_callback(self._on_done(loop, job))
            return

    def _on_done(self, loop: asyncio.AbstractEventLoop, job: _Job) -> Callable[[concurrent.futures.Future[Any]], None]:
        """The thread's callback for `job`: its end handled on the loop."""
        return lambda done: _call_soon(loop, lambda: self._finished(job, done, None))

    def _finished(self, job: _Job, done: concurrent.futures.Future[Any] | None, error: BaseException | None) -> None:
        self._running = None
        self._end(job)
        if not job.future.done():
            if error is None and done is not None:
                error = done.exception()
            if error is not None:
                job.future.set_exception(error)
            else:
                assert done is not None
                job.future.set_result(done.result())
        self._start_next()

    def _end(self, job: _Job) -> None:
        self.preparing -= job.count


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    """`fn` on `loop`'s thread, from any thread; nothing once the loop is closed (shutdown)."""
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:
        pass
