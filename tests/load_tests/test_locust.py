"""The short Locust run: a few users for a few seconds against a real server process."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_tiny_model, make_tiny_tokenizer
from tests.server.conftest import CHAT_TEMPLATE, free_port_block, server_logs, worker_threads

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_short_locust_run(tmp_path, protocol):
    model_dir = tmp_path / "model"
    make_tiny_model().save_pretrained(model_dir)
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)
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
            "12s",
            "--out",
            str(out),
            "--model",
            str(model_dir),
            "--port",
            str(free_port_block(3)),  # gRPC, metrics and HTTP of each server
            "--protocol",
            protocol,
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
    stats = {row["Name"]: row for row in csv.DictReader(open(out / "locust_stats.csv"))}
    for name in ("Generate", "StreamGenerate", "StreamGenerate TTFT"):
        assert int(stats[name]["Request Count"]) > 0, name
        assert int(stats[name]["Failure Count"]) == 0, name
    for name in ("StreamGenerate cancelled", "Generate deadline"):  # walk-aways, when drawn
        assert int(stats.get(name, {}).get("Failure Count", 0)) == 0, name
    assert (out / "report.html").stat().st_size > 1000
    assert "server memory at start" in (out / "memory.txt").read_text()
    assert "shed by RESOURCE_EXHAUSTED: 0" in proc.stdout
    assert "idle: 0 requests running or waiting, KV pool 0.0% used" in proc.stdout  # aborts freed their KV
    assert (out / "rss.csv").read_text().startswith("0,")
    # The server stopped gracefully once the run was over.
    assert "stopped" in (out / "server.log").read_text()
