"""Served rows: the same prompts through a running server, as its users send them.

`served-grpc` and `served-http` start `batchserve serve` with `make serve`'s settings (the
defaults, `--max-num-seqs` at least the load) and stream every request, over gRPC with our client
and over HTTP through `/v1/completions`; `llama-server` and `llama-server-ngram` start llama.cpp's
server on the same GGUF (plain, and with its n-gram speculation) and are sent the same prompts by
the same HTTP client (started again with `--no-repack` where llama.cpp's AMX/repacked kernels
crash it, the rows saying so). Each load runs closed-loop: `concurrency` clients, each sending its
next prompt when its last finishes. A row's TTFT is from a request's send to its first streamed
text, its TPOT the mean time per later token.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from batchserve.bench import servers
from batchserve.bench.methods import LLAMA_SERVER, WEIGHTS_SUFFIX, Row, method_rank, percentile

TENANT_HEADER = "x-batchserve-tenant"  # each run its own scope: a fresh trie and prefix cache, as a fresh engine


@dataclass(frozen=True, slots=True)
class ServedRun:
    texts: list[str]  # each prompt's completion, in prompt order
    tokens: int  # completion tokens, as the server counted them
    seconds: float  # wall from the first send to the last finish
    ttfts: list[float]
    tpots: list[float]


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


def served_row(method: str, dataset: str, b: int, run: ServedRun, reference: list[str] | None, ours: bool) -> Row:
    """A bench row of a served run. Ours is lossless when its texts equal `reference` (the
    in-process plain decoding on the same weights); a peer's matches are counted."""
    row = Row(
        method, dataset, b, len(run.texts), run.tokens, round(run.seconds, 3), round(run.tokens / run.seconds, 2),
        None, round(percentile(run.ttfts, 0.5), 4), round(percentile(run.ttfts, 0.99), 4),
        round(percentile(run.tpots, 0.5), 4), round(percentile(run.tpots, 0.99), 4),
        None if reference is None or not ours else run.texts == reference,
    )  # fmt: skip
    if reference is not None and not ours:
        row.reference_matches = sum(a == r for a, r in zip(run.texts, reference))
    return row


@dataclass(slots=True)
class ServedPeers:
    """A sweep's served rows: our servers (one per --draft setting for the whole sweep, a fresh
    tenant scope per run, warmed as the in-process rows are) and llama-server (started per run
    with as many slots as requests in flight). `close` stops every server started."""

    model_path: str | None
    weights: str  # what `make serve` runs here: its plain decoding is the reference
    seats: int  # our servers' --max-num-seqs: at least make serve's 16, at least the largest load
    logs: Path  # each server's output
    llama_server: tuple[str, Path] | None = None  # its binary and the GGUF it serves
    stack: ExitStack = field(default_factory=ExitStack)
    ours: dict[str | None, tuple[str, str]] = field(default_factory=dict)  # --draft -> (gRPC, HTTP)
    # why llama-server runs with --no-repack: its first start crashed on llama.cpp's AMX/repacked
    # kernels; every later start takes the flag at once, and each of its rows says so
    no_repack: str | None = None

    def row(
        self, method: str, dataset: str, b: int, prompts: list[list[int]], max_new: int, warm_corpus: list[list[int]],
        reference: list[str] | None,
    ) -> Row:  # fmt: skip
        """One closed-loop run of `method` at `b` in flight, against `reference` (the texts of the
        in-process `none` on `weights`, where it ran)."""
        if method in LLAMA_SERVER:
            run = self._on_llama_server(method, b, prompts, max_new)
        else:
            draft = "none" if method.endswith("-none") else None
            if draft not in self.ours:
                log = self.logs / f"server-{draft or 'default'}.log"
                server = servers.batchserve_server(self.seats, log, self.model_path, draft)
                self.ours[draft] = self.stack.enter_context(server)
            address, base = self.ours[draft]
            tenant = f"bench-{uuid.uuid4().hex[:12]}"
            if draft is None and warm_corpus:
                servers.warm(address, warm_corpus, tenant)
            if method.startswith("served-grpc"):
                run = run_grpc(address, prompts, max_new, b, tenant)
            else:
                run = run_http(base, prompts, max_new, b, tenant)
        row = served_row(method, dataset, b, run, reference, method not in LLAMA_SERVER)
        row.note = self.no_repack if method in LLAMA_SERVER else None
        plain = method.endswith("-none") or method in LLAMA_SERVER
        row.versus = ("none" if plain else "lookahead-adaptive") + WEIGHTS_SUFFIX[self.weights]
        return row

    def _on_llama_server(self, method: str, b: int, prompts: list[list[int]], max_new: int) -> ServedRun:
        """llama-server with `b` slots for the run (restarted with --no-repack where it crashes:
        `servers.run_on_llama_server`; `PeerFailed` where it fails both ways)."""
        assert self.llama_server is not None
        binary, gguf = self.llama_server
        self._make_room(gguf)
        context = max(map(len, prompts)) + max_new + 16
        log = self.logs / f"{method}-b{b}.log"
        server = servers.LlamaServer(
            binary, gguf, b, context, torch_threads(), method.endswith("ngram"), log, self.no_repack is not None
        )
        run, note = servers.run_on_llama_server(server, lambda base: run_http(base, prompts, max_new, b))
        self.no_repack = self.no_repack or note
        return run

    def _make_room(self, gguf: Path) -> None:
        """Stop our servers where the machine cannot hold the file twice (a 30B file on a 24 GB
        machine: llama-server could not load it beside ours); the next row of ours starts them again."""
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if self.ours and 2 * gguf.stat().st_size + (1 << 30) > memory:
            self.close()
            self.stack, self.ours = ExitStack(), {}

    def close(self) -> None:
        self.stack.close()

    def __enter__(self) -> ServedPeers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def served_table(rows: list[Row]) -> list[str]:
    """Served rows against the same settings in-process (what the serving path costs), and
    llama-server against our server as users get it (`served-http`), at each load."""
    at = {(r.method, r.batch_size): r for r in rows}
    lines: list[str] = []
    for r in sorted(rows, key=lambda r: (r.batch_size, method_rank(r.method))):
        base = at.get((r.versus, r.batch_size)) if r.versus else None
        if r.method.startswith("llama-server"):
            base = at.get(("served-http", r.batch_size))
        if base is None:
            continue
        if not lines:
            lines = [
                "\nServed: each row against the same settings in-process (`none` / `lookahead-adaptive` on the weights"
                " `make serve` runs), llama-server against our `served-http`:\n",
                "| method | in flight | tokens/s | against | its tokens/s | ratio | TTFT p50 (s) | its TTFT p50 (s) "
                "| TPOT p50 (ms) | its TPOT p50 (ms) |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
        lines.append(
            f"| {r.method} | {r.batch_size} | {r.tokens_per_s:.1f} | {base.method} | {base.tokens_per_s:.1f} | "
            f"{r.tokens_per_s / base.tokens_per_s:.2f}x | {r.ttft_p50_s:.3f} | {base.ttft_p50_s:.3f} | "
            f"{1e3 * r.tpot_p50_s:.1f} | {1e3 * base.tpot_p50_s:.1f} |"
        )
    return lines
