from __future__ import annotations

import os
import random
import socket
from pathlib import Path
from typing import Any

import grpc
import pytest

from batchserve.async_engine import AsyncEngine
from batchserve.config import CacheConfig, DraftConfig, EngineConfig, SchedulerConfig
from batchserve.engine import EngineCore
from batchserve.server.app import BatchServer, ServerConfig
from batchserve.server.http import listen
from batchserve.v1 import generation_pb2_grpc as pb_grpc
from tests.conftest import make_tiny_model, make_tiny_tokenizer

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def tiny_core(
    max_num_seqs: int = 8, num_blocks: int = 512, max_num_batched_tokens: int = 256, model: Any = None
) -> EngineCore:
    """The tiny model (or `model`, with the tiny tokenizer) behind a small engine."""
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        draft=DraftConfig(decoding_length=8, adaptive=False),
    )
    return EngineCore(config, model if model is not None else make_tiny_model(), tokenizer)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(count: int) -> int:
    """A base port whose `count` consecutive ports are all free now, for a script that listens on
    PORT, PORT+1, ... Chosen below the kernel's ephemeral range: other tests' port-0 binds and
    client sockets draw from that range, so none of them can take one of ours before the
    server binds it (a block taken from `free_port()` could collide with them)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:  # not Linux: the IANA ephemeral range starts at 49152
        low = 49152
    top = low - count if low > 12000 else 65535 - count  # an unusual range: any high port
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, top)
        socks = [socket.socket() for _ in range(count)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {count} free ports found")


def worker_threads() -> dict[str, str]:
    """$BATCHSERVE_NUM_THREADS where the session set it (a worker's share of the cores under
    pytest-xdist, tests/conftest.py), for a server started with an environment of its own."""
    return {k: v for k, v in os.environ.items() if k == "BATCHSERVE_NUM_THREADS"}


def server_logs(out: Path, tail: int = 4000) -> str:
    """The end of each server log a load_tests/run.sh run left in `out`, for a failure message."""
    logs = sorted(out.glob("server*.log"))
    return "".join(f"\n--- {p.name} ---\n{p.read_text(errors='replace')[-tail:]}" for p in logs)


class Running:
    def __init__(self, server: BatchServer, channel: grpc.aio.Channel) -> None:
        self.server = server
        self.channel = channel
        self.stub = pb_grpc.TextGenerationStub(channel)

    @property
    def core(self) -> EngineCore:
        return self.server.engine.core


async def start_server(core: EngineCore | None = None, http: bool = False, **server_kwargs: Any) -> Running:
    """A server on free loopback ports; `http`: with the OpenAI API on a socket bound here."""
    server_kwargs.setdefault("port", 0)
    server_kwargs.setdefault("http_port", 0)
    if server_kwargs.get("metrics_port") == 0:  # 0 is off for the server: tests that read metrics take a free port
        server_kwargs["metrics_port"] = free_port()
    sock = listen("127.0.0.1", 0) if http else None
    config = ServerConfig(**server_kwargs)
    server = BatchServer(AsyncEngine(core or tiny_core()), config, model_name="tiny", http_socket=sock)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return Running(server, channel)


@pytest.fixture
async def running():
    r = await start_server(metrics_port=0)
    yield r
    await r.channel.close()
    await r.server.shutdown()


@pytest.fixture
async def ascii_api():
    """gRPC and HTTP over the tiny model that writes ASCII text (its output tokenizes back to itself)."""
    from tests.conftest import make_ascii_model

    r = await start_server(tiny_core(model=make_ascii_model()), http=True, metrics_port=0)
    yield r
    await r.channel.close()
    await r.server.shutdown()


@pytest.fixture
async def api():
    """A server with the HTTP API on the tiny model (the OpenAI tests')."""
    r = await start_server(http=True, metrics_port=0)
    yield r
    await r.channel.close()
    await r.server.shutdown()
