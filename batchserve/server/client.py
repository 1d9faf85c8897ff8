"""A small synchronous Python client for the TextGeneration service."""

from __future__ import annotations

import json
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


class Client:
    """`Client("127.0.0.1:50051").generate("def fib(n):", max_new_tokens=64).text`

    `target` may name several replicas (`dns:///batchserve-headless:50051`,
    `ipv4:10.0.0.1:50051,10.0.0.2:50051`); `load_balancing` spreads calls over them
    (`round_robin`, or `pick_first`; None: grpc's defaults) and retries UNAVAILABLE."""

    def __init__(
        self, target: str = "127.0.0.1:50051", timeout: float | None = None, load_balancing: str | None = "round_robin"
    ) -> None:
        self.channel = grpc.insecure_channel(target, options=channel_options(load_balancing))
        self.stub = pb_grpc.TextGenerationStub(self.channel)
        self.timeout = timeout

    def generate(self, prompt: Any, **kwargs: Any) -> pb.GenerateResponse:
        """`kwargs`: build_request's; a `tenant` goes in the field and the metadata, so the
        server finds it under every --tenant-source."""
        return self.stub.Generate(build_request(prompt, **kwargs), timeout=self.timeout, metadata=_tenant(kwargs))

    def stream(self, prompt: Any, **kwargs: Any) -> Iterator[pb.GenerateStreamResponse]:
        return self.stub.StreamGenerate(build_request(prompt, **kwargs), timeout=self.timeout, metadata=_tenant(kwargs))

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
