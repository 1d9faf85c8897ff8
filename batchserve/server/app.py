"""The server: gRPC (TextGeneration, health, reflection) and the OpenAI HTTP API over one engine,
metrics, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from batchserve.async_engine import AsyncEngine
from batchserve.engine import EngineCore
from batchserve.server.frontend import Frontend, ServiceInfo
from batchserve.server.grpc.decode import GuardedRegistration
from batchserve.server.grpc.limits import CallGuard
from batchserve.server.grpc.servicer import TextGenerationServicer
from batchserve.server.guard import SourceCounts
from batchserve.server.http import HttpServer, listen, room_for_connections
from batchserve.server.keys import ApiKeys
from batchserve.server.metrics import Metrics
from batchserve.server.openai.api import OpenAIServer
from batchserve.server.settings import (
    IDLE_CONNECTION_MS,
    MAX_STREAMS,
    SERVICE_NAME,
    SPARE_CALLS,
    PortInUse,
    ServerConfig,
)
from batchserve.v1 import generation_pb2_grpc as pb_grpc

logger = logging.getLogger("batchserve.server")
FLUSH_SECONDS = 2.0  # after the grace period: time for the final messages to leave


def credentials_of(config: ServerConfig) -> grpc.ServerCredentials | None:
    """grpc's TLS credentials from the config's PEM files, or None for plaintext."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    key, cert = Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes()
    ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def message_limit(core: EngineCore) -> int:
    """The largest request a full context can need: its text at the engine's characters-per-token
    bound, 4 bytes per character in UTF-8, plus room for the other fields."""
    return core.facts.max_model_len * core.config.limits.max_prompt_chars_per_token * 4 + 64 * 1024


class BatchServer:
    """Owns the grpc.aio server around one AsyncEngine."""

    def __init__(
        self,
        engine: AsyncEngine,
        config: ServerConfig,
        model_name: str = "",
        dtype: str = "",
        http_socket: socket.socket | None = None,
    ) -> None:
        """`http_socket`: a listening socket for the HTTP API instead of `config.http_port`
        (tests bind port 0 themselves)."""
        self.engine = engine
        self.config = config
        self.metrics = Metrics(engine)
        self.model_name = model_name
        info = ServiceInfo(
            model_name,
            dtype,
            config.max_waiting_requests,
            config.admin_token(),
            config.max_waiting_per_tenant,
            config.preparation_share,
        )
        self.frontend = Frontend(engine, self.metrics, info)
        # The key file is read here: one that does not parse stops the server before it listens.
        self.keys = ApiKeys(config.api_key_file) if config.api_key_file else None
        self.servicer = TextGenerationServicer(self.frontend, config.tenant_source, self.keys)
        self._http_socket = http_socket
        self._http: HttpServer | None = None
        self.http_port: int | None = None  # where the OpenAI API listens, once started
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None  # where metrics are served; None: off
        self._server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        c = self.config
        self.max_message_bytes = c.max_message_bytes or message_limit(self.engine.core)
        self.servicer.max_message_bytes = self.max_message_bytes
        # NOTE: the metrics port is bound first, so that a port in use fails start() before any
        # listener or engine thread exists; every later failure stops what was started.
        if c.metrics_port:  # 0 turns metrics off, as it does the HTTP API
            try:
                self.metrics_port = self.metrics.serve(c.metrics_port, c.host, lambda: self.frontend.healthy)
            except OSError as e:
                raise PortInUse("metrics", c.host, c.metrics_port, "--metrics-port") from e
        try:
            http_socket = self._http_socket or (listen(c.host, c.http_port) if c.http_port else None)
        except OSError as e:
            self.metrics.close()
            raise PortInUse("HTTP", c.host, c.http_port, "--http-port; 0 turns the HTTP API off") from e
        server = self._grpc_server()
        try:
            credentials = credentials_of(c)
            address = f"{c.host}:{c.port}"
            port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
            if port == 0:
                raise PortInUse("gRPC", c.host, c.port, "--port")
            self.port = port
            self.engine.start()
            await server.start()
            if http_socket is not None:
                served = c.served_model_name or Path(self.model_name).stem or "model"
                api = OpenAIServer(
                    self.frontend, served, self.max_message_bytes, c.tenant_source, self.keys, self.max_calls
                )
                tls = (c.tls_cert, c.tls_key, c.tls_client_ca) if c.tls_cert and c.tls_key else None
                self._http = HttpServer(api.app, http_socket, tls, c.connection_limits())
                self.http_port = http_socket.getsockname()[1]
        except BaseException:
            self.metrics.close()
            if http_socket is not None:
                http_socket.close()
            await server.stop(None)
            await self.engine.stop()
            raise
        self._server = server
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info("serving %s on %s:%d (%s)", SERVICE_NAME, c.host, self.port, "TLS" if credentials else "plaintext")
        if self.http_port is not None:
            logger.info("serving the OpenAI API on http://%s:%d/v1", c.host, self.http_port)
        if self.metrics_port is not None:
            logger.info("metrics on http://%s:%d/metrics", c.host, self.metrics_port)
        return self.port

    @property
    def max_calls(self) -> int:
        """Calls each front end takes at once: every running and waiting request (admission
        refuses the rest with a clear status first) plus room for health and info calls."""
        return self.engine.config.scheduler.max_num_seqs + self.config.max_waiting_requests + SPARE_CALLS

    def _grpc_server(self) -> grpc.aio.Server:
        """The grpc.aio server with its services (TextGeneration, health, reflection), not yet bound."""
        c = self.config
        # No grpc-wide call limit: it counted health streams too. The guard counts TextGeneration
        # calls, caps Watch and reflection streams per address, and leaves Health.Check free.
        # Connections: a cap in all (grpc has no per-address one; the front door has), HTTP/2's
        # settings within the head deadline of accept, and none idle for long.
        streams = SourceCounts(c.max_streams_per_source, MAX_STREAMS)
        room_for_connections(2 * c.max_connections)  # this port's and the HTTP port's
        self.guard = CallGuard(SERVICE_NAME, self.keys, self.max_calls, streams, c.request_body_seconds)
        server = grpc.aio.server(
            interceptors=[self.guard],
            options=[
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.keepalive_time_ms", c.keepalive_time_ms),
                ("grpc.keepalive_timeout_ms", c.keepalive_timeout_ms),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS),
                ("grpc.max_allowed_incoming_connections", c.max_connections),
                ("grpc.server_handshake_timeout_ms", int(c.request_head_seconds * 1000)),
            ],
        )
        pb_grpc.add_TextGenerationServicer_to_server(self.servicer, GuardedRegistration(server))  # bad bytes: 400s
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if c.reflection:
            reflection.enable_server_reflection(
                (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
                server,
            )
        return server

    async def shutdown(self) -> None:
        """NOT_SERVING at once; for `drain_seconds` load balancers route away while calls are
        still taken; then new calls get UNAVAILABLE and in-flight requests have the grace period
        to finish. Whatever is left then ends with CANCELLED (a final message and status, not a
        cut connection) before the listener closes and the engine stops."""
        if self._server is None or self._stopped.is_set():
            return
        c = self.config
        logger.info(
            "shutting down: NOT_SERVING, %.0f s drain, %.0f s grace for in-flight requests",
            c.drain_seconds,
            c.grace_seconds,
        )
        self.frontend.serving = False  # HTTP /health says 503 from the same moment
        await self.health.enter_graceful_shutdown()
        if c.drain_seconds:
            await asyncio.sleep(c.drain_seconds)
        self.frontend.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + c.grace_seconds
        while self.engine.has_work() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        cancelled = self.engine.abort_all()
        if cancelled:
            logger.warning("grace period over: %d requests end CANCELLED", cancelled)
        stops = [self._server.stop(FLUSH_SECONDS)]  # the final messages reach their clients
        if self._http is not None:
            stops.append(self._http.stop())
        await asyncio.gather(*stops)
        await self.engine.stop()
        self.metrics.close()
        self.frontend.close()
        self._stopped.set()
        logger.info("stopped")

    async def wait(self) -> None:
        await self._stopped.wait()


async def serve_forever(server: BatchServer, started: float | None = None) -> int:
    """Run until SIGTERM or SIGINT, then shut down gracefully; or until the engine stops for
    good, then report NOT_SERVING, shut down and return 1 so that a supervisor restarts the
    process. `started`: time.monotonic() when the process began, for the ready line."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():  # a second signal: no more waiting
            logger.critical("second %s: exiting now", sig.name)
            os._exit(128 + sig)
        logger.info("%s: draining (send it again to exit at once)", sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    if server.keys is not None:  # SIGHUP: the key file re-read (a file that does not parse keeps the keys)
        loop.add_signal_handler(signal.SIGHUP, server.keys.reload)
    port = await server.start()
    since = f" {time.monotonic() - started:.1f} s after start" if started is not None else ""
    captured = server.engine.core.facts.capture
    if captured is not None:
        since += f" (CUDA graphs: {captured.graphs} in {captured.seconds:.1f} s, {captured.bytes / 2**20:.0f} MiB)"
    logger.info("READY: health SERVING on %s:%d%s; Ctrl-C drains and stops", server.config.host, port, since)
    signalled = asyncio.create_task(stop.wait())
    died = asyncio.create_task(server.engine.died.wait())
    await asyncio.wait({signalled, died}, return_when=asyncio.FIRST_COMPLETED)
    for task in (signalled, died):
        task.cancel()
    await server.shutdown()
    if server.engine.dead is not None:
        logger.critical("exiting with status 1: %s", server.engine.dead)
        return 1
    return 0
