"""Work done for calls off the event loop (tokenizing, templating, grammar compiling), one job at a
time on its thread, taken from the tenants in turn.

A single FIFO let one tenant keeping many calls of maximal prompts or distinct large schemas in
preparation make every other tenant wait behind all of them. Here each tenant has its own queue
and the thread takes the next job of the next tenant in a round: a tenant's wait for its turn is
at most one job of each other tenant, whatever they have queued. A job whose caller left, or whose
call gave its places to another tenant's (`drop`), is never started; a job once started runs to its
end (the thread cannot be interrupted). Everything but the job itself runs on the event loop.

Turns alone do not keep the work off the engine's cores: on a CPU server, one tenant keeping both
threads busy with distinct large schemas and maximal prompts took 1.2 cores of two and slowed every
other tenant's decoding 4x. So while other tenants have calls (`Pacing.contended`), a tenant's jobs
on both threads together take at most `share` of a second each second, after a `burst`; past it,
its next job waits (other tenants' jobs go first) until its time has come back. A tenant alone on
the server is never paced."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
CPU_SHARE = 0.2  # of a second each second: on two cores, a tenant's work then slows others' steps about 1.1x


def preparation_share(share: float | None, device_type: str) -> float:
    """The pace configured, or by device: on a CPU the threads take the engine's own cores; beside
    an accelerator they do not, and no tenant is paced (0)."""
    if share is not None:
        return share
    return CPU_SHARE if device_type == "cpu" else 0.0


@dataclass(eq=False, slots=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]
    owner: object  # whose job (a call): `drop` ends the pending ones of an owner
    count: int  # the requests it is done for: held as "preparing" until it ends
    tenant: str = ""
    seconds: float = 0.0  # how long it ran on the thread

    def __call__(self) -> Any:
        start = time.perf_counter()
        try:
            return self.fn(*self.args)
        finally:
            self.seconds = time.perf_counter() - start


def _never(tenant: str) -> bool:
    return False


@dataclass
class Pacing:
    """Each tenant's time on the preparation threads while others have calls: `share` of a
    second each second, after `burst` seconds (share 0: never paced). Only tenants that owe time
    are kept, and those that never come back are swept once repaid (within 2 bursts / share
    seconds), so the table is bounded by the work of that long, whatever tenant strings arrive. A
    paced tenant left alone goes on at its timer (at most 2 bursts / share), not at once."""

    share: float = 0.0
    burst: float = 1.0
    contended: Callable[[str], bool] = _never  # whether tenants other than this one have calls
    _owed: dict[str, tuple[float, float]] = field(default_factory=dict)  # tenant -> (balance, at)
    _swept: int = 64  # the table's size after its last sweep

    def balance(self, tenant: str, now: float) -> float:
        balance, at = self._owed.get(tenant, (self.burst, now))
        return min(self.burst, balance + (now - at) * self.share)

    def charge(self, tenant: str, seconds: float, now: float) -> None:
        """`seconds` of `tenant`'s work, where others had calls (alone, it owes nothing); what
        it owes stops at one burst, so that one huge job never locks a tenant out for long."""
        if self.share <= 0 or not self.contended(tenant):
            return
        balance = max(-self.burst, self.balance(tenant, now) - seconds)
        if balance >= self.burst:
            self._owed.pop(tenant, None)
        else:
            self._owed[tenant] = (balance, now)
        if len(self._owed) > 2 * self._swept:  # tenants that never came back: forgotten once repaid
            self._owed = {t: owed for t, owed in self._owed.items() if self.balance(t, now) < self.burst}
            self._swept = max(64, len(self._owed))

    def wait(self, tenant: str, now: float) -> float:
        """Seconds until `tenant`'s next job may start (0: now)."""
        if self.share <= 0 or tenant not in self._owed:
            return 0.0
        balance = self.balance(tenant, now)
        if balance >= self.burst:
            del self._owed[tenant]
        if balance >= 0 or not self.contended(tenant):
            return 0.0
        return -balance / self.share


class FairWork:
    """Jobs of each tenant in turn on one thread of `executor` (a single-worker pool), paced by
    `pacing` (shared by the threads, so that a tenant's time on both counts once)."""

    def __init__(self, executor: concurrent.futures.ThreadPoolExecutor, pacing: Pacing | None = None) -> None:
        self.executor = executor
        self.pacing = pacing or Pacing()
        self._timer: asyncio.TimerHandle | None = None  # wakes a round in which every tenant was paced
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()  # tenants in their round's order
        self._running: _Job | None = None
        self._last = ""  # the tenant whose job ran last
        self.preparing = 0  # requests whose jobs are queued or running

    async def run(self, tenant: str, owner: object, count: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the thread in `tenant`'s turn. A caller that leaves before its job starts
        takes it out of the queue; once started, it runs to its end."""
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop.create_future(), owner, count, tenant)
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
        """The next tenant's next job onto the thread, unless one is running; tenants that owe
        time are passed over, and where every one does, a timer comes back when the first may go."""
        while self._running is None and self._queues:
            if len(self._queues) > 1 and next(iter(self._queues)) == self._last:
                self._queues.move_to_end(self._last)  # it came back while its job ran: after the others
            now = time.monotonic()
            waits = {tenant: self.pacing.wait(tenant, now) for tenant in self._queues}
            tenant = next((t for t in self._queues if waits[t] <= 0), None)
            if tenant is None:
                self._wake_in(min(waits.values()))
                return
            queue = self._queues.pop(tenant)
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
                work = self.executor.submit(job)
            except RuntimeError as e:  # the pool is shut down (the server is stopping)
                self._finished(job, None, e)
                continue
            work.add_done_callback(self._on_done(loop, job))
            return

    def _wake_in(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._woken)  # always on the loop

    def _woken(self) -> None:
        self._timer = None
        self._start_next()

    def _on_done(self, loop: asyncio.AbstractEventLoop, job: _Job) -> Callable[[concurrent.futures.Future[Any]], None]:
        """The thread's callback for `job`: its end handled on the loop."""
        return lambda done: _call_soon(loop, lambda: self._finished(job, done, None))

    def _finished(self, job: _Job, done: concurrent.futures.Future[Any] | None, error: BaseException | None) -> None:
        self._running = None
        self._end(job)
        self.pacing.charge(job.tenant, job.seconds, time.monotonic())
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
