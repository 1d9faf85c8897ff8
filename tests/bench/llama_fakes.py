"""Stand-ins for llama.cpp that the bench's child processes and servers can load: llama-cpp-python's
`Llama` (generating 10, 11, 12, ...) and `llama-server` (answering every completion with "ab"),
each crashing by a signal where a test asks it to, as llama.cpp's AMX kernels do on a CPU that
lists AMX but does not grant it. Module-level, so a spawned child finds the loaders by name."""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchserve.bench.llamacpp_child import LlamaSettings


def die(sig: signal.Signals) -> None:
    """End this process by `sig`, as a crashing kernel would (no core file left behind)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.kill(os.getpid(), sig)


class FakeLlama:
    """llama-cpp-python's `Llama` as the peer uses it: `reset`, and `generate` from 10 upwards;
    `crash`: the signal its first `generate` dies by (None: it does not)."""

    def __init__(self, crash: signal.Signals | None = None) -> None:
        self.crash = crash

    def reset(self) -> None:
        pass

    def generate(self, tokens: list[int], **kwargs: Any) -> Iterator[int]:
        if self.crash is not None:
            die(self.crash)
        yield from range(10, 10_000)


def _noted(settings: LlamaSettings, log: Path | None) -> None:
    """One line per load in `log`: which kernels it asked for."""
    if log is not None:
        with open(log, "a") as f:
            f.write(f"extra_bufts={settings.extra_bufts}\n")


def fine(settings: LlamaSettings, log: Path | None = None) -> FakeLlama:
    _noted(settings, log)
    return FakeLlama()


def sigill_on_default_kernels(settings: LlamaSettings, log: Path | None = None) -> FakeLlama:
    """Dies by SIGILL at its first token on the default (AMX/repacked) kernels; fine without them."""
    _noted(settings, log)
    return FakeLlama(signal.SIGILL if settings.extra_bufts else None)


def crashes_both_ways(settings: LlamaSettings, log: Path | None = None) -> FakeLlama:
    """SIGILL on the default kernels, SIGSEGV on the fallback."""
    _noted(settings, log)
    return FakeLlama(signal.SIGILL if settings.extra_bufts else signal.SIGSEGV)


def no_model(settings: LlamaSettings, log: Path | None = None) -> FakeLlama:
    _noted(settings, log)
    raise ValueError(f"Failed to load model from file: {settings.gguf}")


def exits_quietly(settings: LlamaSettings, log: Path | None = None) -> FakeLlama:
    """Exits with status 3 on the default kernels, as a process ended without a word; fine without them."""
    _noted(settings, log)
    if settings.extra_bufts:
        os._exit(3)
    return FakeLlama()


def hangs(settings: LlamaSettings, log: Path | None = None) -> FakeLlama:
    _noted(settings, log)
    time.sleep(3600)
    return FakeLlama()


# llama-server: `{mode}` is "start" (SIGILL before it listens), "request" (SIGILL at its first
# completion), "always" (SIGILL at its first completion, --no-repack or not), "exit" (status 3
# at start, no signal) or "serve"; with --no-repack "start" and "request" serve too. Each start
# appends its arguments to `{starts}`.
SERVER = """#!{python}
import json, os, resource, signal, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE, NO_REPACK = {mode!r}, "--no-repack" in sys.argv
# SIGINT stops it, as llama-server's own handler does, even where the parent ignores SIGINT (a
# pytest-xdist worker does, and an ignored signal stays ignored in the child's Python).
signal.signal(signal.SIGINT, signal.default_int_handler)
with open({starts!r}, "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")


def die():
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.kill(os.getpid(), signal.SIGILL)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        body = b"ok" if self.path == "/health" else json.dumps({{"data": [{{"id": "fake.gguf"}}]}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if MODE == "always" or (MODE == "request" and not NO_REPACK):
            die()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in ({{"choices": [{{"text": "a"}}]}}, {{"choices": [{{"text": "b"}}]}},
                      {{"choices": [], "usage": {{"completion_tokens": 2}}}}):
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\\n\\n")
        self.wfile.write(b"data: [DONE]\\n\\n")


if MODE == "exit":
    sys.exit(3)
if MODE == "start" and not NO_REPACK:
    print("load_tensors: AMX model buffer size = 42 MiB", flush=True)
    die()
port = int(sys.argv[sys.argv.index("--port") + 1])
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def fake_llama_server(directory: Path, mode: str) -> tuple[Path, Path]:
    """(an executable llama-server in `directory` that crashes as `mode` says, the file its starts
    are listed in, one line of arguments each)."""
    starts = directory / "starts.txt"
    binary = directory / "llama-server"
    binary.write_text(SERVER.format(python=sys.executable, mode=mode, starts=str(starts)))
    binary.chmod(0o755)
    return binary, starts
