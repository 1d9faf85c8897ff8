"""A small synchronous Python client for the TextGeneration service, with failover across replicas."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc

from batchserve.request import Constraint
from batchserve.v1 import generation_pb2 as pb
from batchserve.v1 import generation_pb2_grpc as pb_grpc

FINISH_REASON_NAMES = {v: k.removeprefix("FINISH_REASON_").lower() for k, v in pb.FinishReason.items()}


def build_request(
    prompt: str | Sequence[int] | Sequence[dict[str, str]],
    *,
    request_id: str = "",
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool | None = None,
    lookahead: bool | None = None,
    decoding_length: int | None = None,
    layout: str | None = None,
    tenant: str = "",
    jacobi: Sequence[int | None] | None = None,
    references: Sequence[str] = (),
    constraint: Constraint | None = None,
    logprobs: int | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest from text, token ids, or chat messages ({"role", "content"} dicts);
    `references`: texts the output is expected to repeat (a predicted output); `constraint`:
    what the text must match (structured output); `logprobs`: report each token's logprob and
    this many alternatives. A None option is left unset (the server's default)."""
    req = pb.GenerateRequest(request_id=request_id, tenant=tenant, reference=references)
    _set_input(req, prompt)
    s = req.sampling
    for name, value in (
        ("max_new_tokens", max_new_tokens),
        ("temperature", temperature),
        ("top_k", top_k),
        ("top_p", top_p),
        ("seed", seed),
        ("ignore_eos", ignore_eos),
        ("logprobs", logprobs),
        ("frequency_penalty", frequency_penalty),
        ("presence_penalty", presence_penalty),
        ("repetition_penalty", repetition_penalty),
    ):
        if value is not None:
            setattr(s, name, value)
    s.stop.extend(x.encode("utf-8") for x in stop)
    s.stop_token_ids.extend(stop_token_ids)
    s.logit_bias.update(logit_bias or {})
    window = dict(zip(("jacobi_window", "jacobi_ngram", "jacobi_guesses"), jacobi or ()))
    for name, value in {"enable": lookahead, "decoding_length": decoding_length, "layout": layout, **window}.items():
        if value is not None:
            setattr(req.lookahead, name, value)
    if constraint is not None:
        setattr(req, constraint.kind, True if constraint.kind == "json_object" else constraint.spec)
    return req


def _set_input(req: pb.GenerateRequest, prompt: str | Sequence[int] | Sequence[dict[str, str]]) -> None:
    """The request's `input` oneof: text, chat messages or token ids."""
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)  # type: ignore[index]
    else:
        req.token_ids.ids.extend(prompt)  # type: ignore[arg-type]


SERVICE = "batchserve.v1.TextGeneration"
# A ping after 20 s without a frame, the connection dropped 10 s after an unanswered one: a replica gone
# silent (host lost, partition) fails its calls UNAVAILABLE in 30 s. The server's own; it takes pings every 5 s.
KEEPALIVE_S = (20.0, 10.0)
BACKOFF_S = (0.05, 1.0)  # the first pause before another attempt, and the longest
INFO_TIMEOUT_S = 30.0  # Tokenize and GetModelInfo without a client timeout: quick calls, never unbounded


def service_config(load_balancing: str = "round_robin", retries: int = 3) -> str:
    """A gRPC service config: the load-balancing policy over every address the target resolves
    to, and retries of UNAVAILABLE (a replica draining or gone). gRPC retries a call only while
    no response has arrived, so a retried request was never started by another replica."""
    config: dict[str, Any] = {"loadBalancingConfig": [{load_balancing: {}}]}
    if retries > 1:
        policy = {"maxAttempts": retries, "initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2}
        policy["retryableStatusCodes"] = ["UNAVAILABLE"]
        config["methodConfig"] = [{"name": [{"service": SERVICE}], "retryPolicy": policy}]
    return json.dumps(config)


def channel_options(
    load_balancing: str | None = "round_robin",
    retries: int = 3,
    keepalive: tuple[float, float] | None = KEEPALIVE_S,
) -> list[tuple[str, Any]]:
    """Channel options for `target`s with several replicas: `dns:///host:port` (every address
    DNS gives, e.g. a headless Service) or `ipv4:127.0.0.1:p1,127.0.0.1:p2`. `load_balancing`
    None: grpc's default (pick_first); `retries`: attempts of a call gRPC makes by itself (1:
    none, not even its transparent ones); `keepalive`: (time, timeout) seconds, None: off."""
    options: list[tuple[str, Any]] = []
    if keepalive is not None:
        # Pings between calls too, and however long a call is silent (grpc stops after 2); any ping
        # unanswered for `timeout` drops the connection (grpc's flow-control pings wait a minute).
        time_ms, timeout_ms = int(keepalive[0] * 1000), int(keepalive[1] * 1000)
        options += [("grpc.keepalive_time_ms", time_ms), ("grpc.keepalive_permit_without_calls", 1)]
        options += [("grpc.http2.max_pings_without_data", 0), ("grpc.keepalive_timeout_ms", timeout_ms)]
        options.append(("grpc.http2.ping_timeout_ms", timeout_ms))
    if load_balancing is not None:
        options.append(("grpc.service_config", service_config(load_balancing, retries)))
    options.append(("grpc.enable_retries", 1 if load_balancing is not None and retries > 1 else 0))
    return options


def _tenant(kwargs: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    tenant = kwargs.get("tenant")
    return (("x-batchserve-tenant", tenant),) if tenant else ()


# A replica that died, was killed, or shut down under the call: another replica can take it on. A
# refusal (INVALID_ARGUMENT, RESOURCE_EXHAUSTED with its retry hint) or a deadline is the caller's.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
# A proxy between (HAProxy, the front door) ends a call whose replica died with a bare END_STREAM:
# no status ever came, which grpc reports as UNKNOWN "Stream removed". The replica is gone all the same.
LOST_STREAM = "Stream removed"


def _replica_lost(e: grpc.RpcError) -> bool:
    code = e.code() if callable(getattr(e, "code", None)) else None  # type: ignore[attr-defined]
    if code in FAILOVER_CODES:
        return True
    details = e.details() if callable(getattr(e, "details", None)) else ""  # type: ignore[attr-defined]
    return code == grpc.StatusCode.UNKNOWN and (details or "").startswith(LOST_STREAM)


class ReplicaShutDown(grpc.RpcError):
    """UNAVAILABLE: the replica ended the call CANCELLED without the caller asking (it shut down
    under it), and the client could not finish it elsewhere."""

    def __init__(self, attempts: int) -> None:
        super().__init__(f"the replica shut down under the call (attempt {attempts})")
        self.attempts = attempts

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return str(self)


class RetryBudget:
    """Failovers as a share of calls, for the clients that hold it: each call deposits `ratio`,
    each failover takes 1 while 1 is left (else the call fails with its error). It starts full at
    `reserve`, its cap: the burst when a replica dies under many calls (size it to the calls one
    replica runs). With every replica down a call costs 1 + `ratio` attempts, not 1 + failover."""

    def __init__(self, ratio: float = 0.2, reserve: float = 20.0) -> None:
        if not ratio >= 0 or not reserve >= 0:
            raise ValueError(f"ratio and reserve must be >= 0, got {ratio} and {reserve}")
        self.ratio, self.reserve, self._left = ratio, reserve, reserve
        self._lock = threading.Lock()

    def deposit(self) -> None:
        with self._lock:
            self._left = min(self.reserve, self._left + self.ratio)

    def withdraw(self) -> bool:
        """Whether a failover may go (it is then counted)."""
        with self._lock:
            if self._left < 1:
                return False
            self._left -= 1
            return True


class Client:
    """`Client("127.0.0.1:50051").generate("def fib(n):", max_new_tokens=64).text`

    `target` may name several replicas (`dns:///batchserve-headless:50051`,
    `ipv4:10.0.0.1:50051,10.0.0.2:50051`); `load_balancing` spreads calls over them
    (`round_robin`, or `pick_first`; None: grpc's default).

    Failover is the only retrying (gRPC's own is off on its channel): a call a replica could not
    finish (UNAVAILABLE, or CANCELLED this client did not ask for: the replica died or shut down)
    is sent again, at most `failover` times, after a jittered exponential pause (BACKOFF_S), while
    `retry_budget` allows (a RetryBudget; None: one of its own), within one deadline (`timeout`,
    for the whole call, pauses included; None: none, a silent replica found by `keepalive`). A
    broken stream is resumed on another replica from the tokens it had delivered: the caller sees
    one stream, no token twice or missing; for greedy and seeded requests the very stream the
    first replica would have sent (bit for bit on CPU).

    `api_key` goes as `authorization: Bearer KEY` on every call (a server with --api-key-file
    refuses calls without one).

    Raises grpc.RpcError only (`code()`, `details()`): the last attempt's error as grpc gave it,
    or ReplicaShutDown; build_request's TypeError or ValueError for an option protobuf cannot
    hold; after `close()`, grpc's ValueError."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        timeout: float | None = None,
        load_balancing: str | None = "round_robin",
        failover: int = 3,
        keepalive: tuple[float, float] | None = KEEPALIVE_S,
        retry_budget: RetryBudget | None = None,
        api_key: str | None = None,
    ) -> None:
        if failover < 0:
            raise ValueError(f"failover must be >= 0, got {failover}")
        options = channel_options(load_balancing, retries=1, keepalive=keepalive)
        self.channel = grpc.insecure_channel(target, options=options)
        self.stub = pb_grpc.TextGenerationStub(self.channel)
        self.timeout, self.failover = timeout, failover
        self.info_timeout = timeout if timeout is not None else INFO_TIMEOUT_S
        self.budget = retry_budget if retry_budget is not None else RetryBudget()
        self.failovers = 0  # calls sent again or streams resumed, since this client was made
        self.refused = 0  # failovers the retry budget refused
        self._rng = random.Random()
        self._auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def generate(self, prompt: Any, **kwargs: Any) -> pb.GenerateResponse:
        """`kwargs`: build_request's; a `tenant` goes in the field and the metadata, so the
        server finds it under every --tenant-source."""
        req, deadline = build_request(prompt, **kwargs), self._deadline()
        self.budget.deposit()
        for attempt in range(self.failover + 1):
            try:
                reply = self.stub.Generate(req, timeout=_left(deadline), metadata=self._auth + _tenant(kwargs))
            except grpc.RpcError as e:
                self._may_fail_over(e, attempt, deadline)
                continue
            if reply.finish_reason != pb.FINISH_REASON_CANCELLED:
                return reply
            self._may_fail_over(ReplicaShutDown(attempt + 1), attempt, deadline)
        raise AssertionError("unreachable")  # pragma: no cover - the last attempt returns or raises

    def stream(self, prompt: Any, **kwargs: Any) -> Iterator[pb.GenerateStreamResponse]:
        """The request's messages as they come, resumed on another replica where one breaks.
        Leaving the loop early cancels the call (the replica frees its slot at once)."""
        req, deadline = build_request(prompt, **kwargs), self._deadline()
        resumed = list(req.resume_token_ids)  # what the caller resumes from itself
        ended = False  # the last message came (a replica that died before its status cost nothing)
        self.budget.deposit()
        for attempt in range(self.failover + 1):
            call = self.stub.StreamGenerate(req, timeout=_left(deadline), metadata=self._auth + _tenant(kwargs))
            try:
                for msg in call:
                    broken = msg.finish_reason == pb.FINISH_REASON_CANCELLED
                    ended = msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED and not broken
                    if broken:  # the replica shut down under it: what it sent goes on, its end does not
                        msg.finish_reason = pb.FINISH_REASON_UNSPECIFIED
                    resumed.extend(msg.token_ids)
                    if msg.token_ids or msg.text or not broken:
                        yield msg
                    if broken:
                        raise ReplicaShutDown(attempt + 1)
                return
            except grpc.RpcError as e:
                if ended and not isinstance(e, ReplicaShutDown):
                    return
                self._may_fail_over(e, attempt, deadline)
                del req.resume_token_ids[:]
                req.resume_token_ids.extend(resumed)
            finally:
                if hasattr(call, "cancel"):  # a no-op once the call has ended
                    call.cancel()

    def _deadline(self) -> float | None:
        return time.monotonic() + self.timeout if self.timeout is not None else None

    def _may_fail_over(self, e: grpc.RpcError, attempt: int, deadline: float | None) -> None:
        """Return where the call may go to another replica (after a jittered pause); raise `e` where not."""
        left = _left(deadline)
        if not _replica_lost(e) or attempt >= self.failover or (left is not None and left <= 0):
            raise e
        if not self.budget.withdraw():
            self.refused += 1
            raise e
        self.failovers += 1
        # Full jitter: the calls a dead replica dropped together do not all come back together.
        pause = self._rng.uniform(0.0, min(BACKOFF_S[1], BACKOFF_S[0] * 2**attempt))
        time.sleep(pause if left is None else min(pause, left))

    def tokenize(self, text: str) -> list[int]:
        request = pb.TokenizeRequest(text=text)
        return list(self.stub.Tokenize(request, timeout=self.info_timeout, metadata=self._auth).token_ids)

    def add_corpus(
        self,
        texts: Sequence[str] = (),
        token_ids: Sequence[Sequence[int]] = (),
        tenant: str = "",
        admin_token: str = "",
    ) -> int:
        """Load earlier outputs into the server's draft trie for `tenant` (an operator call)."""
        req = pb.AddCorpusRequest(texts=texts, token_ids=[pb.TokenIds(ids=t) for t in token_ids], tenant=tenant)
        metadata = (("x-batchserve-admin-token", admin_token),)
        return self.stub.AddCorpus(req, timeout=self.timeout, metadata=metadata).sequences

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.info_timeout, metadata=self._auth)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
