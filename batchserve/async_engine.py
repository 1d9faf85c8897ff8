"""The asyncio front of the engine: one step loop serving many concurrent request streams."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from batchserve.admission import Submission
from batchserve.config import EngineConfig
from batchserve.cost_profile import CostProfile
from batchserve.engine import EngineCore
from batchserve.records import SchedulerOutput, StepPhases
from batchserve.request import FinishReason, RequestOutput, RequestStats
from batchserve.serving_loop import StepPipeline

logger = logging.getLogger("batchserve")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """A snapshot of how busy the engine is (admission control, metrics, health)."""

    num_running: int
    num_waiting: int
    free_seats: int  # running slots open at the next step; waiting requests take them first
    kv_usage: float  # fraction of KV blocks in use
    num_free_kv_blocks: int
    num_kv_blocks: int
    num_preemptions: int  # since start
    prefix_cache_queried_tokens: int  # since start: tokens of requests that looked up a cached prefix
    prefix_cache_hit_tokens: int  # of those, tokens reused


class AsyncEngine:
    """Serves many concurrent `generate` streams from one step loop.

    The loop schedules and commits on the event loop and runs the forward in one worker
    thread, so RPCs keep flowing during a step; requests join and leave between steps.
    """

    def __init__(
        self, core: EngineCore, max_failed_steps: int = 3, step_thread: ThreadPoolExecutor | None = None
    ) -> None:
        """`max_failed_steps`: after this many steps in a row that served nobody (every request
        failed), the engine stops for good: a device that keeps failing needs a restart.
        `step_thread`: the one-thread executor the core was built in (`build`); a new one otherwise."""
        if max_failed_steps < 1:
            raise ValueError(f"max_failed_steps must be >= 1, got {max_failed_steps}")
        self.core = core
        self.max_failed_steps = max_failed_steps
        self.dead: str | None = None  # why the engine stopped for good; new requests are refused
        self.died = asyncio.Event()
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._executor = step_thread or step_executor()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # The loop that serves (serving_loop.py): where the forward runs on another device than the
        # host's cores, a step's outputs are built and streamed, and new requests let in, while
        # the next step's forward runs.
        self._pipe = StepPipeline(core, core.outputs_beside_forward, self._failed_step)

    @property
    def stream_beside_forward(self) -> bool:
        """Whether a step's outputs are built and streamed while the next forward runs."""
        return self._pipe.beside_forward

    @stream_beside_forward.setter
    def stream_beside_forward(self, beside: bool) -> None:
        self._pipe.beside_forward = beside

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def step_listeners(self) -> list[Callable[[SchedulerOutput, StepPhases], None]]:
        return self.core.step_listeners

    @classmethod
    def from_config(cls, config: EngineConfig | None = None, **settings: Any) -> AsyncEngine:
        """An engine loading its model from `config` with `settings` applied over it, as `LLM` does."""
        return cls.build((config or EngineConfig()).with_settings(**settings))

    @classmethod
    def build(cls, config: EngineConfig, *core_args: Any, max_failed_steps: int = 3) -> AsyncEngine:
        """The core built in the thread that will run its steps, so that one thread does all of the
        process's OpenMP work. NOTE: libgomp keeps a worker pool per thread that ever ran a parallel
        region; with more pool threads than CPUs it stops spinning between regions and wakes its
        workers through the kernel instead, which made every step on 2 cores 1.5-2x slower when
        the model was built (loaded, checked, calibrated) on the main thread and stepped on this one.
        `core_args`: EngineCore's after the config (a model and tokenizer handed in)."""
        step_thread = step_executor()
        try:
            core = step_thread.submit(EngineCore, config, *core_args).result()
        except BaseException:
            step_thread.shutdown(wait=False)
            raise
        return cls(core, max_failed_steps, step_thread)

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def device_type(self) -> str:
        """Where the model runs: "cpu", "cuda", ..."""
        return self.core.runner.device.type

    @property
    def cost_profile(self) -> CostProfile | None:
        """The profile the adaptive policy plans with (None when drafting is fixed)."""
        return self.core.cost_profile

    def load(self) -> EngineLoad:
        sched = self.core.scheduler
        alloc = sched.allocator
        return EngineLoad(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            free_seats=max(0, self.core.config.scheduler.max_num_seqs - sched.num_running),
            kv_usage=alloc.usage,
            num_free_kv_blocks=alloc.num_free_blocks,
            num_kv_blocks=alloc.num_blocks,
            num_preemptions=sched.num_preemptions,
            prefix_cache_queried_tokens=sched.prefix.queried_tokens,
            prefix_cache_hit_tokens=sched.prefix.hit_tokens,
        )

    def has_work(self) -> bool:
        return self.core.has_work()

    def start(self) -> None:
        if self._task is None and self.dead is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="batchserve-engine")
            self._task.add_done_callback(self._on_loop_done)

    def _on_loop_done(self, task: asyncio.Task[None]) -> None:
        """Whatever ends the step loop other than stop() (a bug that escaped every handler,
        `fail_all` itself raising) stops the engine for good, loudly: health goes NOT_SERVING,
        the process exits non-zero, and every stream still open gets its final output."""
        if task.cancelled() or self.dead is not None:
            return
        error = task.exception()
        if error is None:  # pragma: no cover - _run only returns after _die
            return
        logger.critical("the engine loop died", exc_info=error)
        self._die(f"the engine loop died: {type(error).__name__}: {error}")

    def abort_all(self) -> int:
        """Cancel every request: each stream gets its final output (CANCELLED). Returns how many."""
        return sum(self.abort(rid) for rid in list(self.core.scheduler.requests))

    async def stop(self) -> None:
        """Cancel every request and stop the step loop."""
        self.abort_all()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:  # the loop died earlier; _on_loop_done reported it
                pass
            self._task = None
        self._executor.shutdown(wait=True)

    def generate(self, sub: Submission) -> RequestStream:
        """Submit a request and return its stream of per-step outputs (the last one has
        `finished` set). A constraint's matcher is a copy of its compiled one (tens of
        microseconds): compile it off the loop first and hand it in as `sub.grammar` (as `Frontend`
        does), or a constraint not compiled yet is compiled here, on the loop: tens of ms for a
        large schema. Raises ValueError at once for invalid input, EngineDeadError once the
        engine has stopped for good."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if (rid := self.core.engine_id(sub)) is not None and rid in self._queues:
            # Still streaming (or finished but not yet read): never let a second caller touch it.
            raise ValueError(f"request_id {sub.request_id!r} is already in use")
        self.start()
        req = self.core.add_request(sub)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[req.request_id] = queue
        self._wakeup.set()
        return RequestStream(self, req.request_id, queue)

    async def add_corpus(self, sequences: list[list[int]], tenant: str = "") -> int:
        """`EngineCore.add_corpus`, yielding the loop between slices: a large corpus never holds
        up the streams and health checks. Returns how many sequences."""
        for _ in self.core.add_corpus(sequences, tenant):
            await asyncio.sleep(0)
        return len(sequences)

    def abort(self, request_id: str) -> bool:
        out = self.core.abort(request_id)
        if out is None:
            return False
        self._dispatch([out])
        return True

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            q = self._queues.get(o.request_id)
            if q is not None:
                q.put_nowait(o)

    async def _run(self) -> None:
        loop, core, pipe = asyncio.get_running_loop(), self.core, self._pipe
        try:
            while True:
                if not core.has_work():
                    self._flush()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                step = core.schedule()
                if pipe.beside_forward:
                    # A device: the step thread launches, then is idle while the forward runs and
                    # this thread builds the last step's outputs (nothing competes with the launch
                    # for the GIL); the same thread then collects, while new requests come in.
                    await loop.run_in_executor(self._executor, core.launch, step)
                    self._dispatch(pipe.between())
                    await loop.run_in_executor(self._executor, core.collect, step)
                else:
                    # A CPU: the forward takes the host's cores, so the outputs wait for it. Built
                    # beside it (streaming in the worker first) measured 0.97x at 1 and 0.93x at 16
                    # in flight on 2 cores (benchmarks/results/served).
                    forward = loop.run_in_executor(self._executor, core.execute, step)
                    self._dispatch(pipe.between())
                    await forward
                self._dispatch(pipe.after(step))
                if core.consecutive_failed_steps >= self.max_failed_steps:
                    self._flush()
                    failed = core.consecutive_failed_steps
                    self._die(f"{failed} engine steps in a row failed; the engine needs a restart")
                    return
                if not pipe.beside_forward:
                    await asyncio.sleep(0)  # let new requests and aborts in before the next step
        finally:
            self._flush()  # stopped between a step's advance and its outputs: they are owed

    def _flush(self) -> None:
        """Hand out the outputs of the step advanced last, if they are still owed."""
        self._dispatch(self._pipe.flush())

    def _failed_step(self, error: Exception) -> list[RequestOutput]:
        """A bug outside the step's requests (advancing it, building its outputs): every stream
        ends rather than wait forever, and it counts towards stopping the engine."""
        self.core.consecutive_failed_steps += 1
        return self.core.fail_all(error)

    def _die(self, reason: str) -> None:
        logger.critical(reason)
        self.dead = reason
        try:
            self._dispatch(self.core.fail_all(EngineDeadError(reason)))
        except Exception:  # the scheduler's state is beyond use: end the streams without it
            logger.exception("failing the requests of a dead engine failed")
        # Every open stream gets a final output whatever state the core is in (a stream stops at
        # the first final it reads, so one already queued wins over this one).
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(RequestOutput(rid, [], "", True, FinishReason.ERROR, 0, 0, RequestStats(), error=reason))
        self.died.set()


def step_executor() -> ThreadPoolExecutor:
    """The engine's step thread: one worker, for every forward."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchserve-step")


class EngineDeadError(RuntimeError):
    """The engine stopped for good after repeated failed steps; the process should restart."""


class RequestStream:
    """Async iterator over one request's outputs.

    Closing it early (`aclose()`, leaving `async with`, cancelling the task awaiting it, or
    dropping the last reference after `break`) aborts the request and frees its KV blocks.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue[RequestOutput]) -> None:
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._queue.get()
        except asyncio.CancelledError:
            self.close()
            raise
        if out.finished:
            self._done = True
            self._unregister()
        return out

    def close(self) -> None:
        if not self._done:
            self._done = True
            if self._unregister():  # only while the id is still ours: never abort a newer request
                self.engine.core.abort(self.request_id)

    def _unregister(self) -> bool:
        queues = self.engine._queues
        if queues.get(self.request_id) is self._queue:
            del queues[self.request_id]
            return True
        return False

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
