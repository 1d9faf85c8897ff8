"""What holds on the gRPC port before a caller is known (the HTTP port's: `server.guard`).

grpc's own `maximum_concurrent_rpcs` is one limit for every service: 400 health `Watch` streams
without a key made `Health.Check` and every keyed `Generate` RESOURCE_EXHAUSTED. Here, per call:
- `Health.Check` passes untouched: no limit applies to it.
- `Health.Watch` and reflection streams are capped per source address and in all (`SourceCounts`).
- A TextGeneration call (AddCorpus aside: the admin token's) without a valid key is refused from
  its metadata, before its message is read: the refusal's handler reads no request.
- Keyed TextGeneration calls are counted against the server's call limit, and end with
  UNAUTHENTICATED when a reload of the key file removes their key; reflection needs the key too.
- A TextGeneration call's request must arrive within `message_seconds` (the HTTP port's body
  deadline): one trickled or never sent ends DEADLINE_EXCEEDED, having held no call place.
The servicer still checks the key itself (this is the door, not the only lock)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from batchserve.server.guard import SourceCounts
from batchserve.server.keys import ApiKeys, KeyedCall, Revoked, Unauthenticated

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
REFLECTION = "/grpc.reflection."
TOKEN_METHODS = ("AddCorpus",)  # checked against the admin token by the servicer, not a tenant key


def peer_host(peer: str) -> str:
    """The address of grpc's `context.peer()` ("ipv4:10.0.0.1:5000", "ipv6:[::1]:5000",
    "unix:/path") without its port."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6" and rest.startswith("["):
        return rest[1 : rest.find("]")]
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    return peer


class CallGuard(grpc.aio.ServerInterceptor):
    """The door of the gRPC port (see the module's docstring)."""

    def __init__(
        self, service: str, keys: ApiKeys | None, max_calls: int, streams: SourceCounts, message_seconds: float = 30.0
    ) -> None:
        self.prefix = f"/{service}/"
        self.keys, self.max_calls, self.streams = keys, max_calls, streams
        self.message_seconds = message_seconds  # a call's request message must arrive within this
        self.active = 0  # TextGeneration calls in their handlers

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        method = details.method
        handler = await continuation(details)
        if handler is None or method == HEALTH_CHECK:
            return handler
        keyed = method.startswith(REFLECTION) or (
            method.startswith(self.prefix) and method.rpartition("/")[2] not in TOKEN_METHODS
        )
        why = self._unkeyed(details) if keyed else None
        if why is not None:
            return _refusal(grpc.StatusCode.UNAUTHENTICATED, why)
        if method == HEALTH_WATCH or method.startswith(REFLECTION):
            return _wrapped(handler, self._capped)
        if method.startswith(self.prefix):
            handler = _wrapped(handler, self._counted)
            if keyed and self.keys is not None:
                values = _authorization(details)
                handler = _wrapped(handler, lambda inner: self._revocable(inner, values))
            return _message_within(handler, self.message_seconds)
        return handler

    def _unkeyed(self, details: grpc.HandlerCallDetails) -> str | None:
        """Why the call's metadata holds no valid key (None: it does, or keys are off)."""
        if self.keys is None:
            return None
        try:
            self.keys.authenticate(_authorization(details))
        except Unauthenticated as e:
            return str(e)
        return None

    def _counted(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        """`inner` taking one of the server's `max_calls` places while it runs."""

        async def enter(context: grpc.aio.ServicerContext) -> None:
            if self.active >= self.max_calls:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {self.max_calls} calls at once")
            self.active += 1

        def leave(context: grpc.aio.ServicerContext) -> None:
            self.active -= 1

        return _around(inner, enter, leave)

    def _revocable(self, inner: Callable[..., Any], authorization: list[str]) -> Callable[..., Any]:
        """`inner` ended with UNAUTHENTICATED where a reload removes its key while it runs (each
        of a stream's messages is awaited as a task the reload cancels: `KeyedCall`)."""
        keys = self.keys
        assert keys is not None
        refuse = grpc.StatusCode.UNAUTHENTICATED
        if inspect.isasyncgenfunction(inner):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                call = KeyedCall()
                try:
                    with keys.live(authorization, call.end):
                        messages = inner(request, context)
                        try:
                            while True:
                                try:
                                    message = await call.run(messages.__anext__())
                                except StopAsyncIteration:
                                    return
                                yield message
                        finally:
                            await messages.aclose()
                except (Revoked, Unauthenticated) as e:
                    await context.abort(refuse, str(e))

            return stream

        async def one(request: Any, context: grpc.aio.ServicerContext) -> Any:
            call = KeyedCall()
            try:
                with keys.live(authorization, call.end):
                    return await call.run(inner(request, context))
            except (Revoked, Unauthenticated) as e:
                await context.abort(refuse, str(e))

        return one

    def _capped(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        """`inner` holding one of its source's stream places while it runs."""

        async def enter(context: grpc.aio.ServicerContext) -> None:
            if not self.streams.take(peer_host(context.peer())):
                why = f"at most {self.streams.per_source} health and reflection streams per address"
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{why}, {self.streams.total} in all")

        def leave(context: grpc.aio.ServicerContext) -> None:
            self.streams.give(peer_host(context.peer()))

        return _around(inner, enter, leave)


def _authorization(details: grpc.HandlerCallDetails) -> list[str]:
    return [str(v) for k, v in details.invocation_metadata or () if k == "authorization"]


def _around(inner: Callable[..., Any], enter: Callable[..., Any], leave: Callable[..., Any]) -> Callable[..., Any]:
    """`inner` (a coroutine or an async generator function of (request, context)) between
    `await enter(context)` and `leave(context)`, of the same kind, so grpc calls it as it did."""
    if inspect.isasyncgenfunction(inner):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await enter(context)
            try:
                async for message in inner(request, context):
                    yield message
            finally:
                leave(context)

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await enter(context)
        try:
            return await inner(request, context)
        finally:
            leave(context)

    return call


def _wrapped(handler: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Any:
    """The handler with its one behavior wrapped."""
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behavior = getattr(handler, kind)
        if behavior is not None:
            return handler._replace(**{kind: wrap(behavior)})
    return handler


def _message_within(handler: Any, seconds: float) -> Any:
    """A unary-request handler as a streaming-request one that reads the request itself, at most
    `seconds` after the call began (grpc waits for a unary request without end): a client that
    trickles its message, or never sends it, ends DEADLINE_EXCEEDED and never held a call place."""

    async def first(context: grpc.aio.ServicerContext) -> Any:
        try:
            request = await asyncio.wait_for(context.read(), seconds)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"the request did not arrive within {seconds:g} s")
        if request is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call sent no request")
        return request

    parse, write = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary is not None:
        one = handler.unary_unary

        async def single(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            return await one(await first(context), context)

        return grpc.stream_unary_rpc_method_handler(single, request_deserializer=parse, response_serializer=write)
    if handler.unary_stream is not None:
        many = handler.unary_stream

        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            async for message in many(await first(context), context):
                yield message

        return grpc.stream_stream_rpc_method_handler(stream, request_deserializer=parse, response_serializer=write)
    return handler


def _refusal(code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler that ends the call with `code` at once: as a streaming-request handler it reads
    none of the request, whatever the method's kind (the wire is the same)."""

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    return grpc.stream_unary_rpc_method_handler(refuse)
