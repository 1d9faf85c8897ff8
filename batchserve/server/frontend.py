"""What every front end (gRPC, the OpenAI HTTP API) shares: admission, input preparation off the
event loop, submission, per-request metrics and logs, and aborting a request its caller left."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from batchserve.async_engine import AsyncEngine, EngineDeadError, RequestStream
from batchserve.grammar import GrammarCompiler
from batchserve.request import RequestOutput, SamplingParams
from batchserve.server.metrics import Metrics
from batchserve.text import TextCodec

logger = logging.getLogger("batchserve.server")
T = TypeVar("T")


class Refusal(enum.Enum):
    """Why a request was not taken; each front end maps it to its own status. The values are the
    gRPC status names, which also label `batchserve_requests_rejected_total`."""

    INVALID = "INVALID_ARGUMENT"
    QUEUE_FULL = "RESOURCE_EXHAUSTED"
    DRAINING = "UNAVAILABLE"
    ENGINE_DEAD = "UNAVAILABLE"


class Refused(Exception):
    """A request refused before it reached the engine (nothing to free)."""

    def __init__(self, kind: Refusal, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class EngineFailed(Exception):
    """The step that ran the request failed; its partial output has been delivered."""


@dataclass(frozen=True, slots=True)
class ServiceInfo:
    model: str
    dtype: str
    max_waiting_requests: int
    admin_token: str | None = None  # operator calls (AddCorpus) need it; None: they are off


class Frontend:
    """Turns one caller's request into an engine request and its outputs, the same way for
    every protocol. `serving` turns False the moment health says NOT_SERVING (shutdown began,
    or the engine died); `draining` is set once new requests are refused."""

    def __init__(self, engine: AsyncEngine, metrics: Metrics, info: ServiceInfo) -> None:
        self.engine = engine
        self.metrics = metrics
        self.info = info
        self.serving = True
        self.draining = False
        self.admin_token = info.admin_token
        self._preparing = 0  # admitted requests still being tokenized or templated
        # Tokenizing and chat templates run here, never on the event loop (an input at the size
        # limit takes tens of ms to tokenize; every other stream would stall meanwhile). Its
        # queue is bounded by admission: each job holds a place in the waiting queue.
        self._prepare = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchserve-tokenize")

    def close(self) -> None:
        self._prepare.shutdown(wait=False, cancel_futures=True)

    @property
    def healthy(self) -> bool:
        """What health checks report: serving, not draining, the engine alive."""
        return self.serving and not self.draining and self.engine.dead is None

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._prepare, fn, *args)

    def refuse(self, kind: Refusal, message: str) -> Refused:
        """Count a refusal in the metrics and return it to raise."""
        self.metrics.rejected.labels(kind.value).inc()
        return Refused(kind, message)

    def admit(self) -> None:
        """Raise Refused if no new request may come in now (draining, or the queue is full)."""
        if self.draining:
            raise self.refuse(Refusal.DRAINING, "server is shutting down")
        if self.engine.dead is not None:
            raise self.refuse(Refusal.ENGINE_DEAD, f"engine stopped: {self.engine.dead}")
        if self._queue_full():
            raise self.refuse(
                Refusal.QUEUE_FULL, f"waiting queue is full ({self.info.max_waiting_requests} requests); retry later"
            )

    async def prepare(self, fn: Callable[..., T], *args: Any) -> T:
        """Admission, then `fn(*args)` in the preparation thread (tokenizing, templating). The
        job holds a place in the waiting queue from admission until it ends, even when its
        caller leaves first, so the work queued before the engine is bounded like the queue."""
        self.admit()
        loop = asyncio.get_running_loop()
        self._preparing += 1
        try:
            job = self._prepare.submit(fn, *args)
        except BaseException:
            self._preparing -= 1
            raise
        job.add_done_callback(lambda _: _call_soon(loop, self._prepared))
        return await asyncio.wrap_future(job)

    def _prepared(self) -> None:
        self._preparing -= 1

    async def generate(
        self,
        prepare: Callable[[TextCodec], list[int]],
        params: Callable[[], SamplingParams],
        request_id: str = "",
        tenant: str = "",
        fit_context: bool = False,
        references: Callable[[TextCodec], list[list[int]]] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Admit, prepare (`prepare(text)`: the prompt's token ids, `params()`: the sampling parameters,
        `references(text)`: its predicted output's token ids; all off the loop, a ValueError refuses
        the request as invalid), submit and stream one request. `fit_context`: refuse a prompt whose
        max_new_tokens do not fit the context (instead of ending it at the context). Leaving early (a
        client's cancel, deadline or disconnect) aborts it in the engine, which frees its KV blocks
        before the next step. Raises Refused before the first output, EngineFailed after the last."""
        request_id, core = request_id or uuid.uuid4().hex, self.engine.core
        try:
            sampling, prompt, refs = await self.prepare(_prepare, prepare, params, references, core.text, core.grammars)
        except ValueError as e:
            raise self.refuse(Refusal.INVALID, str(e)) from None
        if self.draining:  # shutdown began while this one was tokenized: a retryable refusal
            raise self.refuse(Refusal.DRAINING, "server is shutting down")
        context = core.max_model_len
        if fit_context and len(prompt) + sampling.max_new_tokens > context:
            raise self.refuse(
                Refusal.INVALID,
                f"the prompt's {len(prompt)} tokens plus max_tokens {sampling.max_new_tokens} exceed the "
                f"model's context of {context} tokens",
            )
        try:
            stream: RequestStream = self.engine.generate(prompt, sampling, request_id, tenant=tenant, references=refs)
        except ValueError as e:
            raise self.refuse(Refusal.INVALID, str(e)) from None
        except EngineDeadError as e:
            raise self.refuse(Refusal.ENGINE_DEAD, f"engine stopped: {e}") from None
        tracker = self.metrics.track()
        start = time.monotonic()
        last: RequestOutput | None = None
        try:
            async with stream:
                async for out in stream:
                    tracker.observe(out)
                    last = out
                    yield out
        finally:
            if last is None or not last.finished:
                self.metrics.finished.labels("cancelled").inc()
                logger.info("request %s cancelled by the client after %.2fs", request_id, time.monotonic() - start)
            else:
                logger.info(
                    "request %s finished: %d prompt + %d output tokens, %s, %.2fs, %.2f tokens/step",
                    request_id,
                    last.num_prompt_tokens,
                    last.num_output_tokens,
                    last.finish_reason.value,
                    time.monotonic() - start,
                    last.tokens_per_step,
                )
        if last is not None and last.error is not None:
            raise EngineFailed(f"engine error: {last.error}")

    def _queue_full(self) -> bool:
        """Whether a new request would wait beyond the limit: the seats free at the next step
        take waiting requests first, so only those beyond them count. Requests still being
        prepared count as waiting."""
        load = self.engine.load()
        return load.num_waiting + self._preparing - load.free_seats >= self.info.max_waiting_requests


def choose_tenant(source: str, header: str | None, field: str | None) -> str:
    """A request's tenant key under `source` (ServerConfig.tenant_source): the header a
    gateway sets, the request's own field, or both with the header winning ("" for none)."""
    if source == "header":
        return header or ""
    if source == "request":
        return field or ""
    return header or field or ""


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    """`fn` on `loop`'s thread, from any thread; nothing once the loop is closed (shutdown)."""
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:
        pass


def _prepare(
    prepare: Callable[[TextCodec], list[int]],
    params: Callable[[], SamplingParams],
    references: Callable[[TextCodec], list[list[int]]] | None,
    text: TextCodec,
    grammars: GrammarCompiler,
) -> tuple[SamplingParams, list[int], list[list[int]]]:
    """A request's preparation, in the preparation thread: the parameters first (their bounds
    are cheap to check and refuse before any tokenizing), then its constraint compiled (into the
    cache the engine takes it from), then the prompt, then its references."""
    sampling = params()
    if sampling.constraint is not None:
        grammars.compile(sampling.constraint)  # ConstraintError, a ValueError, refuses it
    prompt = prepare(text)
    return sampling, prompt, references(text) if references is not None else []
