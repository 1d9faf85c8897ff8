"""Replicas behind grpc's own client-side balancing: real server processes on loopback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from batchserve.server.client import Client
from batchserve.v1 import generation_pb2 as pb
from tests.conftest import make_tiny_model, make_tiny_tokenizer
from tests.server.conftest import CHAT_TEMPLATE, free_port_block, server_logs, worker_threads

ROOT = Path(__file__).resolve().parents[2]


class Replica:
    """`batchserve serve` on free ports (0: the server picks them and logs where it listens)."""

    def __init__(self, model_dir: Path, cache: Path, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchserve.cli",
                "serve",
                "--model",
                str(model_dir),
                "--port",
                "0",
                "--http-port",
                "0",
                "--metrics-port",
                str(free_port_block(1)),  # 0 would turn metrics off
                "--kv-cache-gb",
                "0.02",
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "BATCHSERVE_CACHE_DIR": str(cache)},
        )
        self.log: list[str] = []
        self.port = self.metrics_port = 0
        deadline = time.monotonic() + 120
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.log.append(line)
            if m := re.search(r"metrics on http://[\d.]+:(\d+)/metrics", line):
                self.metrics_port = int(m.group(1))
            if m := re.search(r"READY: health SERVING on [\d.]+:(\d+)", line):
                self.port = int(m.group(1))
                break
            assert time.monotonic() < deadline, "".join(self.log)
        assert self.port and self.metrics_port, "".join(self.log)
        # Keep draining the log so the server never blocks on a full pipe.
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()  # type: ignore[arg-type]

    def finished(self) -> int:
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        prefix = "batchserve_requests_finished_total{"
        return int(sum(float(x.rsplit(" ", 1)[1]) for x in body.splitlines() if x.startswith(prefix)))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model")
    make_tiny_model().save_pretrained(path)
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def test_round_robin_spreads_calls_and_a_replica_leaving_under_load_fails_none(model_dir, tmp_path):
    replicas = [Replica(model_dir, tmp_path / "cache", "--grace", "30") for _ in range(3)]
    try:
        target = "ipv4:" + ",".join(f"127.0.0.1:{r.port}" for r in replicas)
        with Client(target, timeout=60) as client:
            for i in range(6):  # round_robin takes replicas as their connections become ready
                client.generate([1, 2, 3 + i], max_new_tokens=4)
            before = [r.finished() for r in replicas]
            for i in range(9):
                client.generate([1, 2, 3 + i], max_new_tokens=4)
            spread = [r.finished() - b for r, b in zip(replicas, before)]
            assert sum(spread) == 9 and min(spread) >= 2, spread  # about one in three each (pick_first: 9, 0, 0)

            results: list[object] = []
            leaving = replicas[1]

            def call(i: int) -> None:
                try:
                    reply = client.generate([5, 6, i % 200], max_new_tokens=30, ignore_eos=True)
                    results.append(reply.finish_reason)
                except Exception as e:  # every failure is a finding
                    results.append(e)

            with ThreadPoolExecutor(6) as pool:
                futures = [pool.submit(call, i) for i in range(60)]
                while len(results) < 10:
                    time.sleep(0.01)
                leaving.proc.send_signal(signal.SIGTERM)  # mid-load: drains, finishes its calls, exits
                for f in futures:
                    f.result()
            assert leaving.proc.wait(timeout=60) == 0
            failures = [r for r in results if r != pb.FINISH_REASON_LENGTH]
            assert not failures, failures
            assert len(results) == 60
    finally:
        for r in replicas:
            r.stop()


def test_locust_over_two_replicas(model_dir, tmp_path):
    out = tmp_path / "load"
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "load_tests" / "run.sh"),
            "--users",
            "4",
            "--spawn-rate",
            "4",
            "--duration",
            "10s",
            "--out",
            str(out),
            "--model",
            str(model_dir),
            "--port",
            str(free_port_block(6)),  # gRPC, metrics and HTTP of each server
            "--replicas",
            "2",
            "--",
            "--kv-cache-gb",
            "0.02",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        env={
            "PYTHON": sys.executable,
            "BATCHSERVE_MAX_PROMPT_CHARS": "600",
            "PATH": "/usr/bin:/bin",
            "BATCHSERVE_CACHE_DIR": str(tmp_path / "cache"),
            # Built modules are shared (named by what they are built from): no rebuild per server.
            "BATCHSERVE_BUILD_DIR": os.environ["BATCHSERVE_BUILD_DIR"],
            **worker_threads(),
        },
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr + server_logs(out)
    finished = [int(n) for n in re.findall(r"replica [\d.:]+: (\d+) requests finished", proc.stdout)]
    assert len(finished) == 2 and min(finished) > 0, proc.stdout  # both replicas served
    assert "shed by RESOURCE_EXHAUSTED: 0" in proc.stdout
