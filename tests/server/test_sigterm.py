"""`batchserve serve` as a process: SIGTERM drains in-flight requests and exits cleanly; a
second signal exits at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchserve.server.client import Client
from batchserve.v1 import generation_pb2 as pb
from tests.conftest import make_tiny_model, make_tiny_tokenizer
from tests.server.conftest import free_port


def _serve(tmp_path: Path, *flags: str, **shape: int) -> tuple[subprocess.Popen, Client]:
    """A server process on the tiny model (`shape`: its sizes changed), healthy, and a client of it."""
    make_tiny_model(**shape).save_pretrained(tmp_path)
    make_tiny_tokenizer().save_pretrained(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchserve.cli",
            "serve",
            "--model",
            str(tmp_path),
            "--port",
            str(port),
            "--http-port",
            "0",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # The default adaptive policy calibrates on first start: into a fresh cache here.
        # Its torch threads as the deployment sets them (the pod's CPU limit).
        env={**os.environ, "BATCHSERVE_CACHE_DIR": str(tmp_path / "cache"), "BATCHSERVE_NUM_THREADS": "1"},
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 120
        while True:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    break
            except grpc.RpcError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.2)
    return proc, Client(f"127.0.0.1:{port}")


def test_sigterm_lets_in_flight_requests_finish(tmp_path):
    proc, client = _serve(tmp_path, "--kv-cache-gb", "0.01", "--grace", "30")
    try:
        stream = client.stream([1, 2, 3], max_new_tokens=300, ignore_eos=True)
        first = next(stream)
        proc.send_signal(signal.SIGTERM)
        chunks = [first, *stream]
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(c.token_ids) for c in chunks) == 300
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read()
        assert "shutting down" in log and "finished: 3 prompt + 0 resumed + 300 generated tokens" in log
        assert "quick cost profile measured" in log and len(list((tmp_path / "cache" / "profiles").glob("*.json"))) == 1
        assert "READY: health SERVING" in log
        assert "torch threads: 1 ($BATCHSERVE_NUM_THREADS)" in log
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_signal_exits_at_once(tmp_path):
    # Wider layers: 1,000 tokens take seconds on any CPU, so the stream is still running when the
    # second signal comes (the tiny model wrote 900 in under a second on a fast one).
    wide = {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16, "head_dim": 64}
    proc, client = _serve(tmp_path, "--kv-cache-gb", "0.05", "--grace", "600", "--draft", "none", **wide)
    try:
        stream = client.stream([1, 2, 3], max_new_tokens=1000, ignore_eos=True)
        next(stream)
        proc.send_signal(signal.SIGTERM)  # would wait up to 600 s for the stream
        time.sleep(0.3)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 128 + signal.SIGTERM
        assert "second SIGTERM: exiting now" in proc.stdout.read()
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
