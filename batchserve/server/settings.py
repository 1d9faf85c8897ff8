"""The server's settings (`ServerConfig`: listeners, limits, keys, TLS, shutdown) and the checks
made on them before the model loads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchserve.config import setting
from batchserve.server.guard import ConnectionLimits
from batchserve.server.http import listen
from batchserve.server.keys import MIN_KEY_BITS, key_bits, read_secret_file
from batchserve.v1 import generation_pb2 as pb

TENANT_SOURCES = ("header", "request", "both")
# Calls beyond the running and waiting requests that a full server still answers (health,
# model info, metadata): the front ends' own connection caps leave this much room.
SPARE_CALLS = 64
MAX_STREAMS = 1024  # gRPC health Watch and reflection streams open in all
IDLE_CONNECTION_MS = 300_000  # a gRPC connection without a call for this long is closed (GOAWAY)


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
    admin_token_file: str | None = setting(
        None,
        "a file holding the token (128 bits or more) that enables operator calls (AddCorpus) for clients that"
        " send it as x-batchserve-admin-token (a file: a flag's value shows in ps)",
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
    max_connections: int = setting(4096, "connections open in all on each port; past it new ones are closed")
    request_head_seconds: float = setting(
        10.0,
        "an HTTP connection must send a request's head within this of opening (or of its last response); "
        "a gRPC one its HTTP/2 settings",
    )
    request_body_seconds: float = setting(
        30.0, "and the request's body within this of its head (gRPC: a call's request message, of the call's start)"
    )
    max_streams_per_source: int = setting(8, "gRPC health Watch and reflection streams one address may hold")
    preparation_share: float | None = setting(
        None,
        "while other tenants have calls, a tenant's tokenizing and grammar compiling take at most this "
        "of a second each second (default: 0.2 on a CPU, where it is the engine's time; unpaced on a GPU)",
    )
    keepalive_time_ms: int = 20_000
    keepalive_timeout_ms: int = 10_000

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        self.admin_token()  # ValueError for a file that is missing or holds a weak token
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
        if self.preparation_share is not None and not 0 <= self.preparation_share <= 1:
            raise ValueError(f"preparation_share must be in [0, 1], got {self.preparation_share}")
        if not 1 <= self.max_streams_per_source <= MAX_STREAMS:
            raise ValueError(f"max_streams_per_source must be in [1, {MAX_STREAMS}], got {self.max_streams_per_source}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and its key")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("client certificates (mTLS) need the server's own certificate and key")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no file {path}")

    def admin_token(self) -> str | None:
        """The admin token from `admin_token_file` (None: operator calls are off); ValueError for a
        file that cannot be read, is not one line, or holds fewer than 128 bits (`key_bits`)."""
        if self.admin_token_file is None:
            return None
        path = Path(self.admin_token_file)
        lines = [line.strip() for line in read_secret_file(path, "admin token file").splitlines() if line.strip()]
        if len(lines) != 1:
            raise ValueError(f"admin token file {path}: one line, the token (got {len(lines)})")
        if key_bits(lines[0]) < MIN_KEY_BITS:
            raise ValueError(f"admin token file {path}: the token is too easy to guess (at least {MIN_KEY_BITS} bits)")
        return lines[0]

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(
            self.max_connections_per_source, self.max_connections, self.request_head_seconds, self.request_body_seconds
        )


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
