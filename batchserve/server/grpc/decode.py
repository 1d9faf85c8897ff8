"""Requests that do not parse (a string field with bad UTF-8, a truncated message) as
INVALID_ARGUMENT naming why, not grpc's UNKNOWN with the exception's class: every TextGeneration
method's deserializer hands back `Undecodable` instead of raising, and its handler refuses it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True, slots=True)
class Undecodable:
    error: str


def _refuse(request: Undecodable) -> str:
    return f"the request does not parse as its message: {request.error}"


def guarded(handlers: dict[str, grpc.RpcMethodHandler]) -> dict[str, grpc.RpcMethodHandler]:
    """The same handlers, their parse failures refused with INVALID_ARGUMENT (unary and
    server-streaming methods: the TextGeneration service has no other kind)."""
    out = {}
    for name, handler in handlers.items():
        parse: Callable[[bytes], Any] = handler.request_deserializer

        def safe(data: bytes, parse: Callable[[bytes], Any] = parse) -> Any:
            try:
                return parse(data)
            except DecodeError as e:
                return Undecodable(str(e))

        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def one(request: Any, context: grpc.aio.ServicerContext, inner: Any = unary) -> Any:
                if isinstance(request, Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refuse(request))
                return await inner(request, context)

            out[name] = handler._replace(request_deserializer=safe, unary_unary=one)
        elif handler.unary_stream is not None:
            stream = handler.unary_stream

            async def many(request: Any, context: grpc.aio.ServicerContext, inner: Any = stream) -> AsyncIterator[Any]:
                if isinstance(request, Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refuse(request))
                async for message in inner(request, context):
                    yield message

            out[name] = handler._replace(request_deserializer=safe, unary_stream=many)
        else:
            raise ValueError(f"{name}: a client-streaming method is not guarded")
    return out


class GuardedRegistration:
    """What a generated `add_*Servicer_to_server` sees as the server: the handlers it registers
    go to `server` guarded (its generic-handler call is dropped: the registered one rebuilds it)."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same methods come again through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        safe = guarded(handlers)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, safe),))
        self.server.add_registered_method_handlers(service, safe)
