"""A small synchronous Python client for the TextGeneration service."""

from __future__ import annotations

import json
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


def service_config(load_balancing: str = "round_robin", retries: int = 3) -> str:
    """A gRPC service config: the load-balancing policy over every address the target resolves
    to, and retries of UNAVAILABLE (a replica draining or gone). gRPC retries a call only while
    no response has arrived, so a retried request was never started by another replica."""
    config: dict[str, Any] = {"loadBalancingConfig": [{load_balancing: {}}]}
    if retries > 1:
        config["methodConfig"] = [
            {
                "name": [{"service": SERVICE}],
                "retryPolicy": {
                    "maxAttempts": retries,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    return json.dumps(config)


def channel_options(load_balancing: str | None = "round_robin", retries: int = 3) -> list[tuple[str, Any]]:
    """Channel options for `target`s with several replicas: `dns:///host:port` (every address
    DNS gives, e.g. a headless Service) or `ipv4:127.0.0.1:p1,127.0.0.1:p2`. None: grpc's
    default (pick_first, no retries)."""
    if load_balancing is None:
        return []
    return [("grpc.service_config", service_config(load_balancing, retries)), ("grpc.enable_retries", 1)]


def _tenant(kwargs: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    tenant = kwargs.get("tenant")
    return (("x-batchserve-tenant", tenant),) if tenant else ()


# A replica that died, was killed, or shut down under the call: another replica can take it on.
# A refusal (INVALID_ARGUMENT, RESOURCE_EXHAUSTED with its retry hint) or a deadline is the
# caller's to see, never retried here.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


class Client:
    """`Client("127.0.0.1:50051").generate("def fib(n):", max_new_tokens=64).text`

    `target` may name several replicas (`dns:///batchserve-headless:50051`,
    `ipv4:10.0.0.1:50051,10.0.0.2:50051`); `load_balancing` spreads calls over them
    (`round_robin`, or `pick_first`; None: grpc's defaults) and retries UNAVAILABLE.

    Failover (`failover` tries beyond the first): a call that a replica could not finish
    (UNAVAILABLE, or CANCELLED that this client did not ask for: the replica died or shut down)
    is sent again, within the same deadline (`timeout`, for the whole call); a broken stream is
    resumed on another replica from the tokens it had delivered (`resume_token_ids`), so the
    caller sees one stream, no token twice or missing: for greedy and seeded requests the very
    stream the first replica would have sent (bit for bit on CPU)."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        timeout: float | None = None,
        load_balancing: str | None = "round_robin",
        failover: int = 3,
    ) -> None:
        self.channel = grpc.insecure_channel(target, options=channel_options(load_balancing))
        self.stub = pb_grpc.TextGenerationStub(self.channel)
        self.timeout = timeout
        self.failover = failover
        self.failovers = 0  # calls sent again or streams resumed, since this client was made

    def generate(self, prompt: Any, **kwargs: Any) -> pb.GenerateResponse:
        """`kwargs`: build_request's; a `tenant` goes in the field and the metadata, so the
        server finds it under every --tenant-source."""
        req, deadline = build_request(prompt, **kwargs), self._deadline()
        for attempt in range(self.failover + 1):
            try:
                reply = self.stub.Generate(req, timeout=_left(deadline), metadata=_tenant(kwargs))
                if reply.finish_reason != pb.FINISH_REASON_CANCELLED:
                    return reply
                self._may_fail_over(_Broken(), attempt, deadline)  # the replica shut down under it
            except grpc.RpcError as e:
                self._may_fail_over(e, attempt, deadline)
        raise AssertionError("unreachable")  # pragma: no cover

    def stream(self, prompt: Any, **kwargs: Any) -> Iterator[pb.GenerateStreamResponse]:
        """The request's messages as they come, resumed on another replica where one breaks."""
        req, deadline = build_request(prompt, **kwargs), self._deadline()
        resumed = list(req.resume_token_ids)  # what the caller resumes from itself
        ended = False  # the last message came (a replica that died before its status cost nothing)
        for attempt in range(self.failover + 1):
            try:
                for msg in self.stub.StreamGenerate(req, timeout=_left(deadline), metadata=_tenant(kwargs)):
                    broken = msg.finish_reason == pb.FINISH_REASON_CANCELLED
                    ended = msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED and not broken
                    if broken:  # the replica shut down under it: what it sent goes on, its end does not
                        msg.finish_reason = pb.FINISH_REASON_UNSPECIFIED
                    resumed.extend(msg.token_ids)
                    if msg.token_ids or msg.text or not broken:
                        yield msg
                    if broken:
                        raise _Broken()
                return
            except (grpc.RpcError, _Broken) as e:
                if ended and not isinstance(e, _Broken):
                    return
                self._may_fail_over(e, attempt, deadline)
                del req.resume_token_ids[:]
                req.resume_token_ids.extend(resumed)

    def _deadline(self) -> float | None:
        return time.monotonic() + self.timeout if self.timeout is not None else None

    def _may_fail_over(self, e: Exception, attempt: int, deadline: float | None) -> None:
        """Return where the call may go to another replica (after a short pause); raise `e` where not."""
        code = e.code() if isinstance(e, grpc.RpcError) else grpc.StatusCode.CANCELLED  # type: ignore[attr-defined]
        left = _left(deadline)
        if code not in FAILOVER_CODES or attempt >= self.failover or (left is not None and left <= 0):
            raise e
        self.failovers += 1
        time.sleep(min(0.05 * 2**attempt, left if left is not None else 1.0))

    def tokenize(self, text: str) -> list[int]:
        return list(self.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=self.timeout).token_ids)

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
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Broken(Exception):
    """A stream that a replica ended CANCELLED without the caller asking (its shutdown)."""


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def generate_command(args: Any) -> int:
    """`batchserve generate`: one request to a running server, printed as text or JSON."""
    import json
    import sys

    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    kwargs = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed}
    with Client(args.target, timeout=args.timeout, load_balancing=args.load_balancing) as client:
        try:
            if args.stream and not args.json:
                for chunk in client.stream(prompt, **kwargs):
                    print(chunk.text, end="", flush=True)
                print()
                return 0
            r = client.generate(prompt, **kwargs)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(
            json.dumps(
                {
                    "request_id": r.request_id,
                    "text": r.text,
                    "token_ids": list(r.token_ids),
                    "finish_reason": FINISH_REASON_NAMES[r.finish_reason],
                    "usage": {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens},
                    "stats": {
                        "steps": r.stats.steps,
                        "draft_tokens_proposed": r.stats.draft_tokens_proposed,
                        "draft_tokens_accepted": r.stats.draft_tokens_accepted,
                        "tokens_per_step": round(r.stats.tokens_per_step, 3),
                    },
                },
                ensure_ascii=False,
            )
        )
    else:
        print(r.text)
    return 0
