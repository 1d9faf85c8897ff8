"""The hostile tenant of `make soak-hostile` (load_tests/soak_hostile.py): a Locust user that, under
its own tenant key, sends issue 79's attacks over HTTP and gRPC, each in turn (a shuffled cycle),
floods in bursts of concurrent calls:

- grammar floods: `response_format` JSON schemas of 150-400 properties, distinct (a cache miss
  each) and repeated (the same text again), with few tokens to generate;
- resume floods: thousands of random `resume_token_ids`, and more than the context holds;
- echo + logprobs 20 with `max_tokens` 0 on long prompts, n up to 8 (completions);
- huge bodies: just under the server's body limit, and over it (HTTP and gRPC);
- slow readers: a long stream read a little at a time; cancels: streams dropped at once;
- key rotation (issue 89): a burst of calls each under a fresh tenant string, one-token answers
  on prompts of a few hundred tokens: never "background", and each a new draft scope;
- a seat hog (issue 89): as many long decodes at once as the server has seats, read to their end;
- before any key (issue 100): idle sockets (a burst that sends nothing), a body trickled a byte at a
  time, gRPC health Watch streams held open, and a preparation flood (prompts at the context's
  size, each to be tokenized, with distinct large schemas to compile);
- key revocation (issue 100), where the server has keys: a stream under a key of its own that the
  operator then removes (the key file rewritten, SIGHUP): how long until the stream ends.

With keys (BATCHSERVE_HOSTILE_KEY), every call but the health streams and the raw sockets' carries
the hostile key, and the key names the tenant: key rotation's tenant strings are then ignored.

Hostile calls are expected to be refused or limited: none is a Locust failure. Every call's
outcome ("http 413", "grpc INVALID_ARGUMENT", "error ReadTimeout") goes to the call log, where
the driver counts them by kind. `log_call` writes the well-behaved users' rows too.

Environment: BATCHSERVE_GRPC_HOST, BATCHSERVE_HTTP_HOST, BATCHSERVE_CALL_LOG (set by the driver),
BATCHSERVE_HOSTILE_USERS (0: no hostile user), BATCHSERVE_HOSTILE_BURST (calls of a flood, 4),
BATCHSERVE_HOSTILE_PROMPT_TOKENS (echo prompts, 2048), BATCHSERVE_SLOW_READ_S (20),
BATCHSERVE_BODY_LIMIT (bytes; default: what the server computes for its model),
BATCHSERVE_HOSTILE_ATTACKS (method names, comma-separated: only those, in that order),
BATCHSERVE_HOSTILE_KEY, BATCHSERVE_KEY_FILE and BATCHSERVE_SERVER_PID (keys on: set by the driver).
"""

from __future__ import annotations

import csv
import fcntl
import itertools
import json
import os
import random
import secrets
import signal
import socket
import string
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import gevent
import grpc
import locustfile as base  # the plain load: its prompts, and grpc made to cooperate with gevent
from grpc_health.v1 import health_pb2, health_pb2_grpc
from locust import HttpUser, between, task
from soak_hostile import FIELDS, UNFINISHED

from batchserve.request import Constraint
from batchserve.server.client import build_request
from batchserve.v1 import generation_pb2 as pb
from batchserve.v1 import generation_pb2_grpc as pb_grpc

GRPC_HOST = os.environ.get("BATCHSERVE_GRPC_HOST", "127.0.0.1:50051")
HTTP_HOST = os.environ.get("BATCHSERVE_HTTP_HOST", "http://127.0.0.1:8000")
CALL_LOG = os.environ.get("BATCHSERVE_CALL_LOG", "")
TENANT = os.environ.get("BATCHSERVE_HOSTILE_TENANT", "hostile")
USERS = int(os.environ.get("BATCHSERVE_HOSTILE_USERS", "0"))
BURST = int(os.environ.get("BATCHSERVE_HOSTILE_BURST", "4"))
PROMPT_TOKENS = int(os.environ.get("BATCHSERVE_HOSTILE_PROMPT_TOKENS", "2048"))
SLOW_READ_S = float(os.environ.get("BATCHSERVE_SLOW_READ_S", "20"))
BODY_LIMIT = int(os.environ.get("BATCHSERVE_BODY_LIMIT", "0"))
ATTACKS = os.environ.get("BATCHSERVE_HOSTILE_ATTACKS", "")  # e.g. "seat_hog,key_rotation": only these, in turn
TIMEOUT = 120.0
FIRST_PLAIN_ID = 256  # random ids above the special tokens (an EOS among resumed ids is refused)
KEY = os.environ.get("BATCHSERVE_HOSTILE_KEY", "")
KEY_FILE = os.environ.get("BATCHSERVE_KEY_FILE", "")
SERVER_PID = int(os.environ.get("BATCHSERVE_SERVER_PID", "0"))
AUTH = (("authorization", f"Bearer {KEY}"),) if KEY else ()
HEADERS = {"x-batchserve-tenant": TENANT} | dict(AUTH)
HTTP_OPTIONS: dict[str, Any] = {"headers": HEADERS, "timeout": TIMEOUT, "catch_response": True}
STREAM_OPTIONS = HTTP_OPTIONS | {"stream": True}
METADATA = (("x-batchserve-tenant", TENANT), *AUTH)
_TYPES = ({"type": "string", "maxLength": 12}, {"type": "integer"}, {"enum": ["a", "b", "c"]}, {"type": "boolean"})


def log_call(start: float, **row: Any) -> None:
    """Append one call (`start`: its wall-clock start) to the call log (soak_hostile.py reads it)."""
    if CALL_LOG:
        with open(CALL_LOG, "a", encoding="utf-8", newline="") as f:
            csv.DictWriter(f, fieldnames=FIELDS, restval="").writerow({"start": f"{start:.3f}"} | row)


def schema(rng: random.Random, properties: int, distinct: bool) -> dict[str, Any]:
    """A closed JSON schema of `properties` properties; distinct: random names, so its text is
    new to the server's grammar cache; else the same text for the same size every time."""
    names = [("".join(rng.choices(string.ascii_lowercase, k=8)) if distinct else "field") + f"_{i}"
             for i in range(properties)]  # fmt: skip
    return {
        "type": "object",
        "properties": {name: _TYPES[i % len(_TYPES)] for i, name in enumerate(names)},
        "required": names[:8],
        "additionalProperties": False,
    }


def _grpc_outcome(error: grpc.RpcError) -> str:
    return f"grpc {error.code().name}"


class HostileUser(HttpUser):
    """One hostile client; its gRPC calls go to GRPC_HOST, its HTTP ones to HTTP_HOST."""

    host = HTTP_HOST
    wait_time = between(0.0, 0.2)
    abstract = USERS == 0
    fixed_count = USERS

    def on_start(self) -> None:
        self.rng = random.Random()
        self.channel = grpc.insecure_channel(GRPC_HOST)
        self.stub = pb_grpc.TextGenerationStub(self.channel)
        info = self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30, metadata=METADATA)
        self.max_len, self.vocab = info.max_model_len, info.vocab_size
        # The server's limit (app.message_limit): a full context of text at 32 characters a token, 4 bytes each.
        self.body_limit = BODY_LIMIT or self.max_len * 32 * 4 + 64 * 1024
        self.model = self.client.get("/v1/models", name="hostile models", headers=HEADERS).json()["data"][0]["id"]
        attacks = [self.grammar_flood, self.resume_flood, self.echo_logprobs, self.huge_body, self.slow_reader]
        attacks += [self.cancel, self.key_rotation, self.seat_hog, self.idle_sockets, self.slow_body]
        attacks += [self.health_watch, self.prep_flood] + ([self.key_revocation] if KEY_FILE else [])
        if ATTACKS:  # only these, in this order (a run that looks at one attack)
            attacks = [getattr(self, name) for name in ATTACKS.split(",")]
        self.seats = info.max_batch_size or 8
        if not ATTACKS:
            self.rng.shuffle(attacks)
        self.plan = itertools.cycle(attacks)

    def on_stop(self) -> None:
        self.channel.close()

    @task
    def attack(self) -> None:
        """The attacks in turn, in a shuffled cycle: each comes up once a cycle, none crowds out another."""
        next(self.plan)()

    def _burst(self, kind: str, call: Callable[[], tuple[str, str]], count: int) -> None:
        """`count` calls at once; each returns (proto, outcome) and is logged as `kind`."""

        def one() -> None:
            wall, start, proto, outcome = time.time(), time.perf_counter(), "?", ""
            try:
                proto, outcome = call()
            except grpc.RpcError as e:
                proto, outcome = "grpc", _grpc_outcome(e)
            except Exception as e:  # a hostile call's end, whatever it is, is an outcome to count
                outcome = f"error {type(e).__name__}"
            except gevent.GreenletExit:  # Locust's stop: still in flight, which is an outcome too
                outcome = UNFINISHED
                raise
            finally:
                ms = (time.perf_counter() - start) * 1000
                log_call(wall, role="hostile", proto=proto, kind=kind, outcome=outcome, ok=1, ms=f"{ms:.1f}")

        calls = [gevent.spawn(one) for _ in range(count)]
        try:
            gevent.joinall(calls)
        except gevent.GreenletExit:
            gevent.killall(calls)  # Locust stops this user: its calls end (and are logged) with it
            raise

    def _post(self, path: str, body: dict[str, Any] | bytes, name: str) -> tuple[str, str]:
        options = HTTP_OPTIONS | {"json": body}
        if isinstance(body, bytes):  # sent as it is: its size is the attack
            options = HTTP_OPTIONS | {"data": body, "headers": HEADERS | {"content-type": "application/json"}}
        with self.client.post(path, name=f"hostile {name}", **options) as resp:
            resp.success()  # refused is the expected outcome: counted in the call log, not by Locust
            if not resp.status_code:  # the connection failed (reset, timed out): Locust keeps why
                return "http", f"http no response ({type(resp.error).__name__})"
            return "http", f"http {resp.status_code}"

    def _generate(self, request: pb.GenerateRequest) -> tuple[str, str]:
        try:
            self.stub.Generate(request, timeout=TIMEOUT, metadata=METADATA)
        except grpc.RpcError as e:
            return "grpc", _grpc_outcome(e)
        return "grpc", "grpc OK"

    def _ids(self, count: int) -> list[int]:
        return [self.rng.randrange(FIRST_PLAIN_ID, self.vocab) for _ in range(count)]

    def grammar_flood(self) -> None:
        distinct = self.rng.random() < 0.5
        size = self.rng.choice((150, 400))

        def call() -> tuple[str, str]:
            spec = schema(self.rng, size, distinct)
            if self.rng.random() < 0.5:
                fmt = {"type": "json_schema", "json_schema": {"name": "form", "schema": spec}}
                body = {"model": self.model, "messages": [{"role": "user", "content": "Fill in the form."}],
                        "max_tokens": 8, "response_format": fmt}  # fmt: skip
                return self._post("/v1/chat/completions", body, "grammar")
            constraint = Constraint("json_schema", json.dumps(spec))
            return self._generate(build_request("Fill in the form.", max_new_tokens=8, constraint=constraint))

        self._burst("grammar-distinct" if distinct else "grammar-repeated", call, BURST)

    def resume_flood(self) -> None:
        """Random resumed ids taught to the drafter; one call in four more than the context holds."""
        oversized = self.rng.random() < 0.25
        count = 2 * self.max_len if oversized else self.rng.randint(2000, max(2000, min(7000, self.max_len - 64)))

        def call() -> tuple[str, str]:
            ids = self._ids(count)
            if self.rng.random() < 0.5:
                body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": count + 8,
                        "resume_token_ids": ids}  # fmt: skip
                return self._post("/v1/completions", body, "resume")
            request = build_request("Once upon a time", max_new_tokens=count + 8)
            request.resume_token_ids.extend(ids)
            return self._generate(request)

        self._burst("resume-oversized" if oversized else "resume", call, BURST)

    def echo_logprobs(self) -> None:
        """A long prompt scored, not generated: each of n samples echoes it with 20 alternatives a token."""

        def call() -> tuple[str, str]:
            body = {"model": self.model, "prompt": self._ids(min(PROMPT_TOKENS, self.max_len - 1)), "echo": True,
                    "logprobs": 20, "max_tokens": 0, "n": self.rng.choice((1, 4, 8))}  # fmt: skip
            return self._post("/v1/completions", body, "echo")

        self._burst("echo-logprobs", call, 1)

    def huge_body(self) -> None:
        over = self.rng.random() < 0.5
        size = self.body_limit + 256 * 1024 if over else self.body_limit - 4096

        def call() -> tuple[str, str]:
            if self.rng.random() < 0.3:  # gRPC: one message of about that size
                return self._generate(build_request("x" * size, max_new_tokens=1))
            shell = {"model": self.model, "prompt": "", "max_tokens": 1}
            text = "Lorem ipsum dolor sit amet. " * (size // 28 + 1)  # ASCII, nothing to escape: its length is its size
            body = json.dumps(shell | {"prompt": text[: size - len(json.dumps(shell))]}).encode()
            return self._post("/v1/completions", body, "huge")

        self._burst("huge-over-limit" if over else "huge-near-limit", call, 1)

    def slow_reader(self) -> None:
        """A long stream read a few bytes at a time for SLOW_READ_S seconds, then dropped."""

        def call() -> tuple[str, str]:
            deadline = time.monotonic() + SLOW_READ_S
            if self.rng.random() < 0.5:
                request = build_request(self.rng.choice(base.PROMPTS)[0], max_new_tokens=512, ignore_eos=True)
                stream = self.stub.StreamGenerate(request, timeout=TIMEOUT, metadata=METADATA)
                try:
                    for _ in stream:
                        if time.monotonic() > deadline:
                            break
                        gevent.sleep(0.5)
                except grpc.RpcError as e:
                    return "grpc", _grpc_outcome(e)
                stream.cancel()
                return "grpc", "grpc read slowly"
            body = {"model": self.model, "prompt": self.rng.choice(base.PROMPTS)[0], "max_tokens": 512,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            with self.client.post("/v1/completions", json=body, name="hostile slow", **STREAM_OPTIONS) as r:
                r.success()
                while r.status_code == 200 and time.monotonic() < deadline and r.raw.read(64):
                    gevent.sleep(0.5)
                return "http", f"http {r.status_code} read slowly"

        self._burst("slow-reader", call, 1)

    def cancel(self) -> None:
        """Streams started and dropped at once, before or at their first chunk."""

        def call() -> tuple[str, str]:
            prompt = self.rng.choice(base.PROMPTS)[0]
            if self.rng.random() < 0.5:
                stream = self.stub.StreamGenerate(build_request(prompt, max_new_tokens=256), metadata=METADATA)
                if self.rng.random() < 0.5:
                    next(stream, None)
                stream.cancel()
                return "grpc", "grpc cancelled"
            body = {"model": self.model, "prompt": prompt, "max_tokens": 256, "stream": True}
            with self.client.post("/v1/completions", json=body, name="hostile cancel", **STREAM_OPTIONS) as r:
                r.success()
                return "http", f"http {r.status_code} dropped"

        self._burst("cancel", call, BURST)

    def key_rotation(self) -> None:
        """A fresh tenant string a call (no keys: a client may send any): short answers on
        prompts of a few hundred tokens, each under a key never seen before."""

        def call() -> tuple[str, str]:
            tenant = f"rot-{self.rng.getrandbits(48):012x}"
            prompt = self._ids(self.rng.randrange(200, 500))
            request = build_request(prompt, max_new_tokens=self.rng.choice((1, 4, 16)))
            try:
                self.stub.Generate(request, timeout=TIMEOUT, metadata=(("x-batchserve-tenant", tenant), *AUTH))
            except grpc.RpcError as e:
                return "grpc", _grpc_outcome(e)
            return "grpc", "grpc OK"

        self._burst("key-rotation", call, 4 * BURST)

    def seat_hog(self) -> None:
        """Long decodes, as many at once as the server has seats, each read to its end."""

        def call() -> tuple[str, str]:
            prompt = self.rng.choice(base.PROMPTS)[0]
            return self._generate(build_request(prompt, max_new_tokens=384, ignore_eos=True))

        self._burst("seat-hog", call, self.seats)

    def _held_until_closed(self, sock: socket.socket, trickle: bytes = b"") -> str:
        """Keep `sock` open (sending `trickle` a byte a second) until the server closes it, or 60 s:
        how long the server let it live. Without a trickle it waits in one read (no wakeups)."""
        start = time.monotonic()
        sock.settimeout(1.0 if trickle else 60.0)
        try:
            while time.monotonic() - start < 60:
                if trickle:
                    sock.sendall(trickle[:1])
                    trickle = trickle[1:] or b" "
                try:
                    if not sock.recv(4096):
                        return f"closed by the server after {time.monotonic() - start:.0f} s"
                except TimeoutError:
                    continue
            return "held 60 s"
        except OSError as e:
            return f"closed by the server after {time.monotonic() - start:.0f} s ({type(e).__name__})"
        finally:
            sock.close()

    def _connect(self) -> socket.socket:
        """A raw connection to the HTTP port; on loopback from 127.0.0.2, another address than the
        well-behaved users' (the server's connection caps are per address)."""
        url = urlsplit(HTTP_HOST)
        host = url.hostname or "127.0.0.1"
        source = ("127.0.0.2", 0) if host.startswith("127.") else None
        return socket.create_connection((host, url.port or 80), timeout=10, source_address=source)

    def idle_sockets(self) -> None:
        """Connections that send nothing at all, 16 times a burst at once."""
        self._burst("idle-socket", lambda: ("http", self._held_until_closed(self._connect())), 16 * BURST)

    def slow_body(self) -> None:
        """A completion whose body of a declared 100 kB comes a byte a second."""

        def call() -> tuple[str, str]:
            sock = self._connect()
            head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            auth = "".join(f"{name}: {value}\r\n" for name, value in AUTH)
            sock.sendall((head + f"x-batchserve-tenant: {TENANT}\r\n{auth}Content-Length: 100000\r\n\r\n").encode())
            return "http", self._held_until_closed(sock, b'{"model": "m", "prompt": "' + b"x" * 200)

        self._burst("slow-body", call, BURST)

    def health_watch(self) -> None:
        """gRPC health Watch streams without a key, held open for 10 s each."""
        stub = health_pb2_grpc.HealthStub(self.channel)

        def call() -> tuple[str, str]:
            stream = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
            try:
                for _ in stream:
                    pass
            except grpc.RpcError as e:
                return "grpc", _grpc_outcome(e)
            return "grpc", "grpc OK"

        self._burst("health-watch", call, 8 * BURST)

    def prep_flood(self) -> None:
        """Work before the engine: text prompts near the context's size (tokenized one by one) and
        distinct large schemas (compiled one by one), as many at once as a burst allows."""

        def call() -> tuple[str, str]:
            if self.rng.random() < 0.5:
                text = " ".join(self.rng.choice(("lorem", "ipsum", "dolor", "amet")) for _ in range(self.max_len - 64))
                return self._generate(build_request(text, max_new_tokens=1))
            constraint = Constraint("json_schema", json.dumps(schema(self.rng, 400, True)))
            return self._generate(build_request("Fill in the form.", max_new_tokens=1, constraint=constraint))

        self._burst("prep-flood", call, 4 * BURST)

    def key_revocation(self) -> None:
        """A key of its own added to the server's key file, a long stream under it, then the key
        removed (the file rewritten whole, SIGHUP, as an operator does): the outcome says how long
        the stream ran on after the signal, and whether a new call under the key is refused."""

        def call() -> tuple[str, str]:
            tenant, key = f"leaving-{self.rng.getrandbits(32):08x}", secrets.token_hex(16)
            auth = (("authorization", f"Bearer {key}"),)
            _edit_keys(lambda lines: [*lines, f"{tenant} {key}"])
            request = build_request(self.rng.choice(base.PROMPTS)[0], max_new_tokens=4000, ignore_eos=True)
            deadline = time.monotonic() + 10
            while True:  # the reload is asynchronous: until the new key is taken
                try:
                    stream = self.stub.StreamGenerate(request, timeout=TIMEOUT, metadata=auth)
                    next(stream)
                    break
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.UNAUTHENTICATED or time.monotonic() > deadline:
                        _edit_keys(lambda lines: [line for line in lines if not line.endswith(key)])
                        return "grpc", _grpc_outcome(e)
                    gevent.sleep(0.1)
            t = _edit_keys(lambda lines: [line for line in lines if not line.endswith(key)])
            try:
                for _ in stream:
                    pass
                return "grpc", "ran to its end after the key was removed"
            except grpc.RpcError as e:
                ended, code = time.monotonic() - t, e.code().name
            try:
                self.stub.Generate(build_request("x", max_new_tokens=1), timeout=30, metadata=auth)
                refused = "a new call still taken"
            except grpc.RpcError as e:
                refused = f"a new call {e.code().name}"
            return "grpc", f"ended {code} after {ended:.1f} s; {refused}"

        self._burst("key-revocation", call, 1)


def _edit_keys(change: Callable[[list[str]], list[str]]) -> float:
    """The key file rewritten whole by `change` (of its lines) under a lock (both hostile users
    edit it), renamed into place, and the server told (SIGHUP); when the signal went."""
    path = Path(KEY_FILE)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        new = path.with_suffix(".new")
        new.write_text("".join(f"{line}\n" for line in change(lines)))
        new.chmod(0o600)
        new.replace(path)
        os.kill(SERVER_PID, signal.SIGHUP)
        return time.monotonic()
