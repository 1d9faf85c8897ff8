"""Serving an ASGI app with uvicorn inside the server's own event loop, beside gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import uvicorn

from batchserve.server.guard import ConnectionLimits, guarded_protocol
from batchserve.server.openai.errors import ApiError, error_response

FLUSH_SECONDS = 2.0  # at shutdown: open connections get this long to finish their responses


class _QuietUvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the server's SIGTERM/SIGINT handling (drain,
    grace, then stop) covers both front ends."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free one); raises OSError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)  # a burst of connects waits here, not in SYN retries
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class HttpServer:
    """An ASGI app served on `sock` until `stop()`."""

    def __init__(
        self,
        app: Any,
        sock: socket.socket,
        tls: tuple[str, str, str | None] | None = None,
        limits: ConnectionLimits | None = None,
    ) -> None:
        """`tls`: (certificate, key, client CA or None) PEM files, the same as gRPC's; `limits`: the
        connections per source and in all, and the deadlines for a request's head and body
        (`guard`; the call limit is the app's own, `CallLimit`)."""
        cert, key, ca = tls or (None, None, None)
        limits = limits or ConnectionLimits()
        room_for_connections(limits.total)
        protocol, self.connections = guarded_protocol(limits)
        config = uvicorn.Config(
            app,
            http=protocol,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=FLUSH_SECONDS,
            ssl_certfile=cert,
            ssl_keyfile=key,
            ssl_ca_certs=ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if ca else ssl.CERT_NONE,
        )
        self._server = _QuietUvicorn(config)
        self._socket = sock
        self._task = asyncio.get_running_loop().create_task(self._server.serve([sock]), name="batchserve-http")

    async def stop(self) -> None:
        """Stop accepting, let open responses finish (at most FLUSH_SECONDS), close the socket."""
        self._server.should_exit = True
        try:
            await self._task
        finally:
            self._socket.close()


def room_for_connections(total: int) -> None:
    """The process's open-file limit raised (to its hard limit at most) so that `total` connections
    and the model's files fit: a default of 1,024 would refuse connections long before the cap."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = total + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if new > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


class BodyLimit:
    """ASGI middleware: 413 for a request body over `limit` bytes, by its Content-Length or, for
    a chunked body, as soon as the bytes read pass it. Pure ASGI (no BaseHTTPMiddleware), so the
    endpoints still see the client's disconnect."""

    def __init__(self, app: Any, limit: int, on_refuse: Any) -> None:
        self.app, self.limit, self.on_refuse = app, limit, on_refuse

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            self.on_refuse()
            await error_response(413, f"request body over {self.limit} bytes")(scope, receive, send)
            return
        read = 0

        async def bounded() -> Any:
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.limit:
                self.on_refuse()
                raise ApiError(413, f"request body over {self.limit} bytes")
            return message

        await self.app(scope, bounded, send)
