"""The server: gRPC (TextGeneration, health, reflection) and the OpenAI HTTP API over one engine,
metrics, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from batchserve.async_engine import AsyncEngine
from batchserve.config import setting
from batchserve.engine import EngineCore
from batchserve.server.frontend import Frontend, ServiceInfo
from batchserve.server.grpc.decode import GuardedRegistration
from batchserve.server.grpc.servicer import TextGenerationServicer
from batchserve.server.guard import ConnectionLimits
from batchserve.server.http import HttpServer, listen
from batchserve.server.keys import ApiKeys
from batchserve.server.metrics import Metrics
from batchserve.server.openai.api import OpenAIServer
from batchserve.v1 import generation_pb2 as pb
from batchserve.v1 import generation_pb2_grpc as pb_grpc

logger = logging.getLogger("batchserve.server")
FLUSH_SECONDS = 2.0  # after the grace period: time for the final messages to leave
TENANT_SOURCES = ("header", "request", "both")
# Calls beyond the running and waiting requests that a full server still answers (health,
# model info, metadata): the front ends' own connection caps leave this much room.
SPARE_CALLS = 64


class PortInUse(OSError):
    """A listener could not bind: one line naming the address and the flag that sets it."""

    def __init__(self, what: str, host: str, port: int, flag: str) -> None:
        super().__init__(f"{what} port {port} on {host} is in use (set another with {flag})")


SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The gRPC front end: where it listens, how it sheds load and shuts down, TLS."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(50051, "gRPC port (0: any free port)")
    metrics_port: int | None = setting(None, "Prometheus endpoint port (0 or unset: off, as for --http-port)")
    http_port: int = setting(8000, "OpenAI-compatible HTTP API port, same host (0: off)")
    admin_token: str | None = setting(
        None, "enables operator calls (AddCorpus) for clients that send it as x-batchserve-admin-token"
    )
    # Tenant keys are capabilities: whoever knows one drafts from (and hits the prefix cache of)
    # that tenant's scope. Behind a gateway only the header it sets can be trusted.
    tenant_source: str = setting(
        "header",
        "where a request's tenant key comes from: header (x-batchserve-tenant, set by a trusted gateway), "
        "request (gRPC's tenant field; HTTP's user field, hashed), or both (the header wins)",
        choices=TENANT_SOURCES,
    )
    api_key_file: str | None = setting(
        None,
        "a file of `TENANT KEY` lines (KEY plain or sha256:<hex>), re-read on SIGHUP: every call then needs"
        " `Authorization: Bearer KEY`, and its tenant is the key's (tenant headers and fields are ignored)",
    )
    served_model_name: str | None = setting(
        None, "the model id of the HTTP API (default: the model file's or directory's name)"
    )
    max_waiting_requests: int = setting(256, "waiting requests before RESOURCE_EXHAUSTED", flags=("--max-waiting",))
    max_waiting_per_tenant: int | None = setting(
        None,
        "waiting requests one tenant may hold (default: any number while the queue has room; once it is full,"
        " a tenant over its share gives its places to one within its share)",
    )
    grace_seconds: float = setting(30.0, "seconds in-flight requests get to finish at shutdown", flags=("--grace",))
    drain_seconds: float = setting(
        0.0, "at shutdown, report NOT_SERVING this long (still serving) before refusing new calls"
    )
    max_message_bytes: int | None = setting(
        None, "largest gRPC message (default: what a full context needs, about 1 MiB for SmolLM2)"
    )
    reflection: bool = setting(True, "gRPC server reflection (grpcurl, grpcui)")
    tls_cert: str | None = setting(None, "PEM certificate chain: serve TLS instead of plaintext")
    tls_key: str | None = setting(None, "PEM private key of --tls-cert")
    tls_client_ca: str | None = setting(None, "PEM CA bundle: require client certificates signed by it (mTLS)")
    max_connections_per_source: int = setting(
        64, "HTTP connections one address may hold open (behind a proxy, which is one address: raise it)"
    )
    max_connections: int = setting(4096, "HTTP connections open in all; past it new ones are closed unread")
    request_head_seconds: float = setting(
        10.0, "an HTTP connection must send a request's head within this of opening (or of its last response)"
    )
    request_body_seconds: float = setting(30.0, "and the request's body within this of its head")
    keepalive_time_ms: int = 20_000
    keepalive_timeout_ms: int = 10_000

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ValueError("admin_token must be at least 16 characters (an empty or short token opens AddCorpus)")
        if self.tenant_source not in TENANT_SOURCES:
            raise ValueError(f"tenant_source must be one of {TENANT_SOURCES}, got {self.tenant_source!r}")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.max_waiting_per_tenant is not None and self.max_waiting_per_tenant < 1:
            raise ValueError(f"max_waiting_per_tenant must be >= 1, got {self.max_waiting_per_tenant}")
        if self.grace_seconds < 0 or self.drain_seconds < 0:
            raise ValueError("grace_seconds and drain_seconds must be >= 0")
        if self.max_message_bytes is not None and self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        self.connection_limits()  # ValueError for limits that cannot hold
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and its key")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("client certificates (mTLS) need the server's own certificate and key")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no file {path}")

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(
            self.max_connections_per_source, self.max_connections, self.request_head_seconds, self.request_body_seconds
        )

    def credentials(self) -> grpc.ServerCredentials | None:
        """grpc's TLS credentials from the PEM files, or None for plaintext."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        key, cert = Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes()
        ca = Path(self.tls_client_ca).read_bytes() if self.tls_client_ca else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def check_ports(config: ServerConfig) -> None:
    """Raise PortInUse for a fixed port of `config` that another process holds, before anything
    slow (loading the model) happens; start() still maps a bind that fails later the same way."""
    for what, port, flag in (
        ("gRPC", config.port, "--port"),
        ("HTTP", config.http_port, "--http-port; 0 turns the HTTP API off"),
        ("metrics", config.metrics_port, "--metrics-port"),
    ):
        if port:
            try:
                listen(config.host, port).close()
            except OSError as e:
                raise PortInUse(what, config.host, port, flag) from e


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
            model_name, dtype, config.max_waiting_requests, config.admin_token, config.max_waiting_per_tenant
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
        # NOTE: the metrics port is bound first, so that a port in use fails start() before any
        # listener or engine thread exists; every later failure stops what was started.
        if c.metrics_port:  # 0 turns metrics off, as it does the HTTP API
            try:
                self.metrics_port = self.metrics.serve(c.metrics_port, c.host)
            except OSError as e:
                raise PortInUse("metrics", c.host, c.metrics_port, "--metrics-port") from e
        try:
            http_socket = self._http_socket or (listen(c.host, c.http_port) if c.http_port else None)
        except OSError as e:
            self.metrics.close()
            raise PortInUse("HTTP", c.host, c.http_port, "--http-port; 0 turns the HTTP API off") from e
        server = self._grpc_server()
        try:
            credentials = c.credentials()
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
        server = grpc.aio.server(
            maximum_concurrent_rpcs=self.max_calls,
            options=[
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.keepalive_time_ms", c.keepalive_time_ms),
                ("grpc.keepalive_timeout_ms", c.keepalive_timeout_ms),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.http2.max_pings_without_data", 0),
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
