"""The TextGeneration servicer: gRPC in, engine requests out."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from batchserve.async_engine import AsyncEngine, EngineDeadError, RequestStream
from batchserve.request import RequestOutput
from batchserve.server import convert
from batchserve.server.metrics import Metrics
from batchserve.v1 import generation_pb2 as pb
from batchserve.v1 import generation_pb2_grpc as pb_grpc

logger = logging.getLogger("batchserve.server")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ServiceInfo:
    model: str
    dtype: str
    max_waiting_requests: int


TENANT_METADATA = "x-batchserve-tenant"


def _tenant(request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> str:
    """The request's isolation key: its `tenant` field, else the x-batchserve-tenant metadata."""
    if request.tenant:
        return request.tenant
    for key, value in context.invocation_metadata() or ():
        if key == TENANT_METADATA:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return ""


class _Refused(Exception):
    """Internal: a request refused after its input was prepared."""


class TextGenerationServicer(pb_grpc.TextGenerationServicer):
    def __init__(self, engine: AsyncEngine, metrics: Metrics, info: ServiceInfo) -> None:
        self.engine = engine
        self.metrics = metrics
        self.info = info
        self.draining = False  # set at shutdown: new requests get UNAVAILABLE
        # Tokenizing and chat templates run here, never on the event loop (an input at the size
        # limit takes tens of ms to tokenize; every other stream would stall meanwhile).
        self._prepare = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchserve-tokenize")

    def close(self) -> None:
        self._prepare.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._prepare, fn, *args)

    # ---- RPCs ----------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        text: list[str] = []
        token_ids: list[int] = []
        last: RequestOutput | None = None
        async for out in self._run(request, context):
            text.append(out.new_text)
            token_ids.extend(out.new_token_ids)
            last = out
        assert last is not None and last.finish_reason is not None
        return pb.GenerateResponse(
            request_id=last.request_id,
            text="".join(text),
            token_ids=token_ids,
            finish_reason=convert.FINISH_REASONS[last.finish_reason],
            usage=convert.usage_pb(last),
            stats=convert.stats_pb(last.stats, last.num_output_tokens),
        )

    async def StreamGenerate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        async for out in self._run(request, context):
            # Steps that only held back text (a possible stop string, half a character) and
            # emitted no token send nothing; the last message is always sent.
            if out.new_token_ids or out.new_text or out.finished:
                yield convert.stream_chunk(out)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        if self.draining:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        try:
            ids = await self._off_loop(convert.prompt_of, request, self.engine.core.text)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        core = self.engine.core
        cfg = core.config
        return pb.ModelInfo(
            model=self.info.model,
            vocab_size=core.vocab_size,
            max_model_len=core.max_model_len,
            eos_token_ids=sorted(core.eos_token_ids),
            dtype=self.info.dtype,
            draft_method=cfg.draft.method,
            decoding_length=cfg.draft.decoding_length,
            max_batch_size=cfg.scheduler.max_num_seqs,
            max_waiting_requests=self.info.max_waiting_requests,
            prefix_caching=cfg.cache.prefix_caching,
        )

    # ---- one request ---------------------------------------------------------------------

    async def _run(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[RequestOutput]:
        """Validate, submit and stream one request; leaving early (client cancel, deadline)
        aborts it in the engine, which frees its KV blocks before the next step."""
        if self.draining:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        core = self.engine.core
        if self._queue_full():
            await self._reject(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"waiting queue is full ({self.info.max_waiting_requests} requests); retry later",
            )
        request_id = request.request_id or uuid.uuid4().hex
        stream: RequestStream | None = None
        error: str | None = None
        code = grpc.StatusCode.INVALID_ARGUMENT
        try:
            params = convert.sampling_params(request)
            prompt = await self._off_loop(convert.prompt_of, request, core.text)
            if self._queue_full():  # others may have arrived while this one was tokenized
                code, error = grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue is full; retry later"
                raise _Refused
            stream = self.engine.generate(prompt, params, request_id, tenant=_tenant(request, context))
        except ValueError as e:
            error = str(e)
        except EngineDeadError as e:
            code, error = grpc.StatusCode.UNAVAILABLE, f"engine stopped: {e}"
        except _Refused:
            pass
        if stream is None:
            await self._reject(context, code, error or "invalid request")
        assert stream is not None
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
            await context.abort(grpc.StatusCode.INTERNAL, f"engine error: {last.error}")

    def _queue_full(self) -> bool:
        """Whether a new request would wait beyond the limit: the seats free at the next step
        take waiting requests first, so only those beyond them count."""
        load = self.engine.load()
        return load.num_waiting - load.free_seats >= self.info.max_waiting_requests

    async def _reject(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self.metrics.rejected.labels(code.name).inc()
        await context.abort(code, message)
