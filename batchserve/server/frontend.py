"""What every front end (gRPC, the OpenAI HTTP API) shares: admission, input preparation off the
event loop, submission, per-request metrics and logs, and aborting a request its caller left."""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from batchserve.admission import Admission, Submission, id_namespace
from batchserve.async_engine import AsyncEngine, EngineDeadError, RequestStream
from batchserve.grammar import CompiledGrammar
from batchserve.request import FinishReason, RequestOutput, RequestStatus, SamplingParams
from batchserve.server.fair_work import FairWork, Pacing, preparation_share
from batchserve.server.metrics import Metrics, log_end
from batchserve.server.queue_shares import QueuedCall, TenantQueues
from batchserve.server.samples import merged_outputs, samples_of, share_prompt_scores
from batchserve.text import TextCodec

FULL = "waiting queue is full"
DISPLACED = f"{FULL} and this tenant holds over its share; retry later"
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
    max_waiting_per_tenant: int | None = None  # None: a tenant's share when the queue is full
    preparation_share: float | None = None  # a tenant's pace on the preparation threads; None: by device


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
        self.queues = TenantQueues(info.max_waiting_requests, info.max_waiting_per_tenant)
        # Tokenizing and chat templates run here, never on the event loop (an input at the size
        # limit takes tens of ms to tokenize; every other stream would stall meanwhile). Its
        # queue is bounded by admission: each job holds a place in the waiting queue.
        self._prepare = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchserve-tokenize")
        # Constraints compile here (llguidance builds a parser, tens of ms for a large schema,
        # without the GIL): never on the loop, and never in the way of the tokenizing of requests
        # without one. The engine copies the compiled matcher for each request (microseconds).
        self._grammar = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchserve-grammar")
        # Whole answers are built and rendered here: one with echo's prompt logprobs is a few MB of
        # JSON, seconds of Python that would stall every stream on the loop.
        self._render = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchserve-render")
        # Each thread takes the tenants' jobs in turn (`fair_work`): no tenant's queue of large
        # prompts or schemas holds another tenant's call behind all of it; and while others have
        # calls, a tenant's time on both is paced, as on a CPU server it is the engine's time.
        self.active: Counter[str] = Counter()  # each tenant's calls, from admission to their end
        pacing = Pacing(preparation_share(info.preparation_share, engine.device_type), contended=self._others_active)
        self._prepare_work, self._grammar_work = FairWork(self._prepare, pacing), FairWork(self._grammar, pacing)

    def close(self) -> None:
        self._prepare.shutdown(wait=False, cancel_futures=True)
        self._grammar.shutdown(wait=False, cancel_futures=True)
        self._render.shutdown(wait=False, cancel_futures=True)

    @property
    def _preparing(self) -> int:
        """Admitted requests whose tokenizing, templating or compiling is queued or running."""
        return self._prepare_work.preparing + self._grammar_work.preparing

    @property
    def healthy(self) -> bool:
        """What health checks report: serving, not draining, the engine alive."""
        return self.serving and not self.draining and self.engine.dead is None

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._prepare, fn, *args)

    async def render(self, fn: Callable[[], T]) -> T:
        """`fn()` (an answer built and rendered) in the render thread, beside the loop."""
        return await asyncio.get_running_loop().run_in_executor(self._render, fn)

    def _others_active(self, tenant: str) -> bool:
        return len(self.active) > (tenant in self.active)

    def _leave(self, call: QueuedCall) -> None:
        """`call` ended: its places given back, and it no longer counts as its tenant's."""
        self.queues.release(call)
        self.active[call.tenant] -= 1
        if self.active[call.tenant] <= 0:
            del self.active[call.tenant]

    def refuse(self, kind: Refusal, message: str) -> Refused:
        """Count a refusal in the metrics and return it to raise."""
        self.metrics.rejected.labels(kind.value).inc()
        return Refused(kind, message)

    def admit(self, count: int = 1, tenant: str = "") -> QueuedCall:
        """The places in the waiting queue of `count` new requests of `tenant`, held until their
        call starts (`queues.release`); raises Refused where they may not come in now (draining,
        the tenant's cap, or the queue full with the tenant at its share: `queue_shares.py`)."""
        if self.draining:
            raise self.refuse(Refusal.DRAINING, "server is shutting down")
        if self.engine.dead is not None:
            raise self.refuse(Refusal.ENGINE_DEAD, f"engine stopped: {self.engine.dead}")
        if self.queues.over_cap(tenant, count):
            cap = self.info.max_waiting_per_tenant
            raise self.refuse(Refusal.QUEUE_FULL, f"this tenant holds {cap} waiting requests; retry later")
        need = self._queue_excess(count)
        if need > 0 and not self._make_room(tenant, count, need):
            raise self.refuse(Refusal.QUEUE_FULL, f"{FULL} ({self.info.max_waiting_requests} requests); retry later")
        self.active[tenant] += 1  # until `_leave`
        return self.queues.hold(tenant, count)

    def _make_room(self, tenant: str, count: int, need: int) -> bool:
        """Free `need` places for `tenant` from calls of tenants over their share that never ran
        (each ends refused, see `_watch`); False where that cannot be done."""
        requests = self.engine.core.scheduler.requests

        def waiting(rid: str) -> bool:
            req = requests.get(rid)
            return req is not None and req.status is RequestStatus.WAITING and not req.output_token_ids

        victims = self.queues.displaceable(tenant, count, need, waiting)
        for call in victims or ():
            call.displaced = True
            self.queues.release(call)
            for rid in call.request_ids:
                self.engine.abort(rid)
            # Still in preparation: its jobs never start, and it ends refused there (counted once);
            # else it finds itself displaced where it goes next (`_check_displaced`).
            refused = Refused(Refusal.QUEUE_FULL, DISPLACED)
            if sum(work.drop(call, refused) for work in (self._prepare_work, self._grammar_work)):
                self.metrics.rejected.labels(Refusal.QUEUE_FULL.value).inc()
        return victims is not None

    async def prepare(self, fn: Callable[..., T], *args: Any, count: int = 1, tenant: str = "") -> T:
        """Admission (of `count` requests of `tenant`), then `fn(*args)` in the preparation thread
        in `tenant`'s turn (tokenizing, templating). A job once started counts as waiting until it
        ends, even when its caller leaves first (one not started leaves with its caller), so the
        work queued before the engine is bounded like the queue."""
        call = self.admit(count, tenant)
        try:
            result = await self._prepare_work.run(tenant, call, count, fn, *args)
            self._check_displaced(call)
            return result
        finally:
            self._leave(call)

    def _check_displaced(self, call: QueuedCall) -> None:
        """Refused where `call`'s places went to another tenant's while it was prepared."""
        if call.displaced:
            raise self.refuse(Refusal.QUEUE_FULL, DISPLACED)

    async def compile(self, sampling: SamplingParams, call: QueuedCall, count: int) -> CompiledGrammar | None:
        """`sampling.constraint` compiled in the grammar thread in its tenant's turn (or found
        compiled by that tenant), for `count` requests of `call`: whoever holds the result until
        they are submitted has the engine copy it, never build it, on the loop (`Admission.compile`).
        None without a constraint. Raises ConstraintError, a ValueError, for a constraint the
        engine refuses."""
        if sampling.constraint is None:
            return None
        compile_ = self.engine.core.admission.compile
        return await self._grammar_work.run(call.tenant, call, count, compile_, sampling.constraint, call.tenant)

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
        samples = self.generate_n(lambda text: [prepare(text)], params, request_id, tenant, fit_context, references)
        try:
            async for _, out in samples:
                yield out
        finally:
            await samples.aclose()

    async def generate_n(
        self,
        prepare: Callable[[TextCodec], list[list[int]]],
        params: Callable[[], SamplingParams],
        request_id: str = "",
        tenant: str = "",
        fit_context: bool = False,
        references: Callable[[TextCodec], list[list[int]]] | None = None,
        n: int = 1,
        num_prompts: int = 1,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """`generate` for `n` samples of each of the prompts `prepare` returns (OpenAI's `n`, and
        completions' list of prompts): prepared at once, then every prompt's samples submitted
        together, or none where one prompt is refused. A prompt's samples (`<request_id>-<i>`, or
        `<request_id>-<p>-<i>` for prompt p of several; sample i seeded with seed + i where a seed
        is given) compute its KV blocks once between them. Yields (p * n + i, output) as they come.
        Leaving early aborts every sample; EngineFailed comes after the last output of all.
        `num_prompts`: how many prompts `prepare` returns (admission counts every request)."""
        call = self.admit(n * num_prompts, tenant)
        try:
            job = (prepare, params, references, tenant)
            async for item in self._generate_n(call, job, request_id, fit_context, n):
                yield item
        finally:
            self._leave(call)

    async def _generate_n(
        self, call: QueuedCall, job: tuple[Any, ...], request_id: str, fit_context: bool, n: int
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """`generate_n` once its places are held (`call`): prepare, compile, submit, watch."""
        request_id, core = request_id or uuid.uuid4().hex, self.engine.core
        try:
            work = self._prepare_work
            sampling, subs = await work.run(call.tenant, call, call.count, _prepare, *job, core.text, core.admission)
            self._check_displaced(call)
            compiled = await self.compile(sampling, call, n * len(subs))  # held until every sample is in
            self._check_displaced(call)
        except ValueError as e:
            raise self.refuse(Refusal.INVALID, str(e)) from None
        if self.draining:  # shutdown began while this one was tokenized: a retryable refusal
            raise self.refuse(Refusal.DRAINING, "server is shutting down")
        context = core.facts.max_model_len
        for sub in subs if fit_context else ():
            if len(sub.prompt) + sampling.max_new_tokens > context:
                raise self.refuse(
                    Refusal.INVALID,
                    f"the prompt's {len(sub.prompt)} tokens plus max_tokens {sampling.max_new_tokens} exceed the "
                    f"model's context of {context} tokens",
                )
        streams: list[RequestStream] = []
        space = id_namespace(subs[0].tenant if subs else "")  # ids are unique per tenant, never across them
        try:
            for p, sub in enumerate(subs):
                rid_p = request_id if len(subs) == 1 else f"{request_id}-{p}"
                group = rid_p if n > 1 else ""
                for rid, sample in samples_of(rid_p, sampling, n):
                    one = replace(sub, params=sample, request_id=rid, group=group, grammar=compiled, namespace=space)
                    streams.append(self.engine.generate(one))
        except (ValueError, EngineDeadError) as e:
            for stream in streams:
                stream.close()
            kind = Refusal.INVALID if isinstance(e, ValueError) else Refusal.ENGINE_DEAD
            raise self.refuse(kind, str(e) if kind is Refusal.INVALID else f"engine stopped: {e}") from None
        del compiled  # every sample has its copy: the cache alone decides how long it stays
        call.request_ids = [stream.request_id for stream in streams]
        watched = self._watch(streams, n if n > 1 and sampling.prompt_logprobs is not None else 0, call)
        try:
            async for item in watched:
                yield item
        finally:
            await watched.aclose()  # aborts what is still running, now

    async def _watch(
        self, streams: list[RequestStream], share_scores: int, call: QueuedCall
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The streams' outputs as (index, output), with per-request metrics and logs; closing it
        closes (aborts) every stream still open. The first output releases the call's places in
        the queue, or, where another tenant's call took them (`_make_room`), refuses it."""
        trackers = [self.metrics.track() for _ in streams]
        last: list[RequestOutput | None] = [None] * len(streams)
        start = time.monotonic()
        merged = merged_outputs(streams)
        if share_scores:  # samples of a prompt, only the first of them scoring it
            merged = share_prompt_scores(merged, share_scores)
        try:
            async for i, out in merged:
                self._check_displaced(call)
                self.queues.release(call)
                trackers[i].observe(out)
                last[i] = out
                yield i, out
        finally:
            await merged.aclose()  # its tasks end now, not when the collector finds it
            for stream, out in zip(streams, last):
                stream.close()
                log_end(self.metrics, stream.request_id, out, time.monotonic() - start)
        # A failed step is the server's fault; a grammar with no continuation is the request's own
        # end (CONSTRAINT_FAILED, its text so far delivered), never an engine error.
        errors = [out.error or "the step failed" for out in last if out and out.finish_reason is FinishReason.ERROR]
        if errors:
            raise EngineFailed(f"engine error: {errors[0]}")

    def _queue_excess(self, count: int = 1) -> int:
        """How many places `count` new requests would wait beyond the limit (0: none): the seats
        free at the next step take waiting requests first, so only those beyond them count.
        Requests still being prepared count as waiting."""
        load = self.engine.load()
        waiting = load.num_waiting + self._preparing + count - load.free_seats
        return max(0, waiting - self.info.max_waiting_requests)


def _prepare(
    prepare: Callable[[TextCodec], list[list[int]]],
    params: Callable[[], SamplingParams],
    references: Callable[[TextCodec], list[list[int]]] | None,
    tenant: str,
    text: TextCodec,
    admission: Admission,
) -> tuple[SamplingParams, list[Submission]]:
    """A call's requests, one per prompt, built in the preparation thread: the parameters first
    (their bounds are cheap to check and refuse before any tokenizing, the constraint's size
    among them), then the prompts, then its references. The constraint compiles after, in the
    grammar thread; each sample is its prompt's record with its own id and seed."""
    sampling = params()
    if sampling.constraint is not None:
        admission.check_constraint(sampling.constraint)  # ConstraintError, a ValueError, refuses it
    prompts = prepare(text)
    refs = references(text) if references is not None else []
    return sampling, [Submission(ids, sampling, tenant=tenant, references=refs) for ids in prompts]
