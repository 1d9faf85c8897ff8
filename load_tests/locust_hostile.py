"""`make soak-hostile`'s locustfile (load_tests/soak_hostile.py runs it): well-behaved users under
the tenant key "good", half over gRPC and half over the OpenAI HTTP API, and beside them, when
BATCHSERVE_HOSTILE_USERS > 0, the hostile tenant of load_tests/hostile.py.

A well-behaved user streams prompts of the benchmark datasets (TTFT: its first chunk; TPOT: the
time from there to the end over the tokens after the first), sends a few code prompts again and
again greedily ("repeat": their tokens a step show the drafter state its tenant keeps), makes
unary calls and walks away from some streams after two chunks. Every call is a row of the call
log; one that did not end as it should (an error, a refusal, a stream cut short) is a failure.

Environment: BATCHSERVE_GOOD_USERS (8), BATCHSERVE_GOOD_TENANT ("good"), BATCHSERVE_GOOD_KEY (its API
key, where the server has keys: then the key names the tenant), and hostile.py's.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # locust runs this file as a script

import grpc
import locustfile as base  # its prompts; grpc made to cooperate with gevent
from gevent import GreenletExit
from hostile import GRPC_HOST, HTTP_HOST, HostileUser, log_call
from locust import HttpUser, User, between, events, task
from soak_hostile import UNFINISHED

from batchserve.server.client import build_request
from batchserve.v1 import generation_pb2 as pb
from batchserve.v1 import generation_pb2_grpc as pb_grpc

__all__ = ["GoodGrpcUser", "GoodHttpUser", "HostileUser"]  # the users Locust runs

GOOD_USERS = int(os.environ.get("BATCHSERVE_GOOD_USERS", "8"))
METRICS_HOST = os.environ.get("BATCHSERVE_METRICS_HOST", "")  # host:port; empty: the probe waits for nothing
TENANT = os.environ.get("BATCHSERVE_GOOD_TENANT", "good")
KEY = os.environ.get("BATCHSERVE_GOOD_KEY", "")
METADATA = (("x-batchserve-tenant", TENANT),) + ((("authorization", f"Bearer {KEY}"),) if KEY else ())
HEADERS = dict(METADATA)
REPEAT_TOKENS = 64
# Code prompts sent again and again, greedily and to a fixed length: their drafts come from what the
# tenant's earlier answers taught its trie and recent outputs, which no other tenant may take away.
REPEATED = [p for p, chat in base.PROMPTS if not chat][:4] or base.FALLBACK_PROMPTS[:1]


class Timing:
    """One call's clock and what it returned: start, first chunk, end, tokens, tokens a step."""

    def __init__(self) -> None:
        self.wall, self.start = time.time(), time.perf_counter()
        self.first: float | None = None
        self.tokens = 0
        self.tps: float | None = None

    def chunk(self, tokens: int = 0, tps: float | None = None) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        self.tokens += tokens
        self.tps = tps if tps is not None else self.tps

    def log(self, environment: Any, proto: str, kind: str, error: str | None, key: str = "") -> None:
        """The call's row in the call log; a Locust event for gRPC (HttpSession reports HTTP's)."""
        end = time.perf_counter()
        ms = (end - self.start) * 1000
        ttft = tpot = ""
        if self.first is not None and kind not in ("generate", "probe", "teach"):
            ttft = f"{(self.first - self.start) * 1000:.1f}"
            if self.tokens > 1:
                tpot = f"{(end - self.first) * 1000 / (self.tokens - 1):.2f}"
        tps = "" if self.tps is None else f"{self.tps:.3f}"
        log_call(self.wall, role="good", proto=proto, kind=kind, outcome=error or "ok", ok=0 if error else 1,
                 ms=f"{ms:.1f}", ttft_ms=ttft, tpot_ms=tpot, tokens=self.tokens, tps=tps, key=key)  # fmt: skip
        if proto == "grpc" and error != UNFINISHED:
            environment.events.request.fire(
                request_type="grpc", name=f"good {kind}", response_time=ms, response_length=self.tokens,
                exception=RuntimeError(error) if error else None, context={},
            )  # fmt: skip


def read_stream(lines: Iterable[bytes], timing: Timing, stop_after: int | None = None) -> str | None:
    """Feed an SSE stream's chunks to `timing` (its usage chunk: tokens and tokens a step); why
    the stream failed (an error event, no `data: [DONE]`), or None."""
    chunks = 0
    for line in lines:
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: ") :]
        if data == b"[DONE]":
            return None
        event = json.loads(data)
        if "error" in event:
            return f"error event after {chunks} chunks: {str(event['error'])[:200]}"
        if event.get("usage"):
            timing.tokens = event["usage"]["completion_tokens"]
            timing.tps = event["usage"].get("speculation", {}).get("tokens_per_step")
        elif event.get("choices"):
            timing.chunk()
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                return None  # walked away: no [DONE] owed
    return f"ended without data: [DONE] after {chunks} chunks"


def _wait_idle(timeout: float = 120) -> None:
    """Until the server runs and queues nothing (the calls dropped at Locust's stop end there too)."""
    deadline = time.monotonic() + timeout
    names = ("batchserve_num_requests_running ", "batchserve_num_requests_waiting ")
    while METRICS_HOST and time.monotonic() < deadline:
        body = urllib.request.urlopen(f"http://{METRICS_HOST}/metrics", timeout=5).read().decode()
        if sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(names)) == 0:
            return
        time.sleep(0.5)


def _send_repeated(environment: Any, kind: str) -> None:
    """Each repeated prompt once, one after another, logged as `kind`."""
    channel = grpc.insecure_channel(GRPC_HOST)
    stub = pb_grpc.TextGenerationStub(channel)
    for key, prompt in enumerate(REPEATED):
        timing, error = Timing(), None
        request = build_request(prompt, max_new_tokens=REPEAT_TOKENS, temperature=0.0, ignore_eos=True)
        try:
            reply = stub.Generate(request, timeout=base.TIMEOUT, metadata=METADATA)
            timing.chunk(reply.usage.completion_tokens, reply.stats.tokens_per_step)
        except grpc.RpcError as e:
            error = f"{e.code().name}: {e.details()}"
        timing.log(environment, "grpc", kind, error, str(key))
    channel.close()


@events.test_start.add_listener
def teach(environment: Any, **kwargs: Any) -> None:
    """Before any user starts: the tenant's drafter learns each repeated prompt's answer, so that
    both runs begin with the same state, whatever the load then gets through."""
    if GOOD_USERS:  # the hostile tenant's own Locust process has none to teach
        _send_repeated(environment, "teach")


@events.test_stop.add_listener
def probe(environment: Any, **kwargs: Any) -> None:
    """Once the load is over (every user stopped), each repeated prompt once more on the idle
    server: the call log's "probe" rows, whose tokens a step show the drafter state its tenant kept
    (during the load, the batch around a call shares the draft budget and lowers it too)."""
    if GOOD_USERS:
        _wait_idle()
        _send_repeated(environment, "probe")


class GoodGrpcUser(User):
    """A well-behaved client of the gRPC API."""

    host = GRPC_HOST
    wait_time = between(0.05, 0.5)
    fixed_count = GOOD_USERS // 2
    abstract = fixed_count == 0

    def on_start(self) -> None:
        self.rng = random.Random()
        self.channel = grpc.insecure_channel(self.host)
        self.stub = pb_grpc.TextGenerationStub(self.channel)

    def on_stop(self) -> None:
        self.channel.close()

    def _stream(self, kind: str, request: pb.GenerateRequest, key: str = "", stop_after: int | None = None) -> None:
        timing, error = Timing(), None
        call = self.stub.StreamGenerate(request, timeout=base.TIMEOUT, metadata=METADATA)
        try:
            for i, chunk in enumerate(call):
                timing.chunk(len(chunk.token_ids), chunk.stats.tokens_per_step)
                if stop_after is not None and i + 1 >= stop_after:
                    call.cancel()
                    break
        except grpc.RpcError as e:
            error = f"{e.code().name}: {e.details()}"
        except GreenletExit:  # Locust's stop cut it: neither a success nor a failure
            timing.log(self.environment, "grpc", kind, UNFINISHED, key)
            raise
        timing.log(self.environment, "grpc", kind, error, key)

    def _request(self, max_tokens: int | None = None) -> pb.GenerateRequest:
        prompt, chat = self.rng.choice(base.PROMPTS)
        max_new_tokens = max_tokens or self.rng.choice(base.MAX_NEW_TOKENS)
        return build_request([{"role": "user", "content": prompt}] if chat else prompt, max_new_tokens=max_new_tokens)

    @task(6)
    def stream(self) -> None:
        self._stream("stream", self._request())

    @task(3)
    def repeat(self) -> None:
        key = self.rng.randrange(len(REPEATED))
        request = build_request(REPEATED[key], max_new_tokens=REPEAT_TOKENS, temperature=0.0, ignore_eos=True)
        self._stream("repeat", request, str(key))

    @task(2)
    def generate(self) -> None:
        timing, error = Timing(), None
        try:
            reply = self.stub.Generate(self._request(), timeout=base.TIMEOUT, metadata=METADATA)
            timing.chunk(reply.usage.completion_tokens, reply.stats.tokens_per_step)
        except grpc.RpcError as e:
            error = f"{e.code().name}: {e.details()}"
        except GreenletExit:
            timing.log(self.environment, "grpc", "generate", UNFINISHED)
            raise
        timing.log(self.environment, "grpc", "generate", error)

    @task(1)
    def cancel(self) -> None:
        self._stream("cancel", self._request(max(base.MAX_NEW_TOKENS)), stop_after=2)


class GoodHttpUser(HttpUser):
    """A well-behaved client of the OpenAI HTTP API (completions and chat completions)."""

    host = HTTP_HOST
    wait_time = between(0.05, 0.5)
    fixed_count = GOOD_USERS - GOOD_USERS // 2
    abstract = fixed_count == 0

    def on_start(self) -> None:
        self.rng = random.Random()
        self.model = self.client.get("/v1/models", name="good models", headers=HEADERS).json()["data"][0]["id"]

    def _call(self, max_tokens: int | None = None) -> tuple[str, dict[str, Any]]:
        prompt, chat = self.rng.choice(base.PROMPTS)
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens or self.rng.choice(base.MAX_NEW_TOKENS)}
        if chat:
            return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
        return "/v1/completions", body | {"prompt": prompt}

    def _post(self, kind: str, path: str, body: dict[str, Any], key: str = "", stop_after: int | None = None) -> None:
        """One call; a stream unless `kind` is generate. Judged by the call log and by Locust."""
        timing, error, stream = Timing(), None, kind != "generate"
        if stream:
            body = body | {"stream": True, "stream_options": {"include_usage": True}}
        options = {"headers": HEADERS, "timeout": base.TIMEOUT, "catch_response": True, "stream": stream}
        try:
            with self.client.post(path, json=body, name=f"good {kind}", **options) as resp:
                if resp.status_code != 200:
                    error = f"HTTP {resp.status_code}: {(resp.text or '')[:200]}"
                elif stream:
                    error = read_stream(resp.iter_lines(), timing, stop_after)
                else:
                    usage = resp.json()["usage"]
                    timing.chunk(usage["completion_tokens"], usage["speculation"]["tokens_per_step"])
                if error:
                    resp.failure(error)
                else:
                    resp.success()
        except Exception as e:  # a broken stream is this call's failure, not the user's end
            error = f"stream broke: {type(e).__name__}: {e}"
        except GreenletExit:  # Locust's stop cut it: neither a success nor a failure
            timing.log(self.environment, "http", kind, UNFINISHED, key)
            raise
        timing.log(self.environment, "http", kind, error, key)

    @task(6)
    def stream(self) -> None:
        self._post("stream", *self._call())

    @task(3)
    def repeat(self) -> None:
        key = self.rng.randrange(len(REPEATED))
        body = {"model": self.model, "prompt": REPEATED[key], "max_tokens": REPEAT_TOKENS, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        self._post("repeat", "/v1/completions", body, str(key))

    @task(2)
    def generate(self) -> None:
        self._post("generate", *self._call())

    @task(1)
    def cancel(self) -> None:
        self._post("cancel", *self._call(max(base.MAX_NEW_TOKENS)), stop_after=2)
