"""A small synchronous Python client for the TextGeneration service."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc

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
) -> pb.GenerateRequest:
    """A GenerateRequest from text, token ids, or chat messages ({"role", "content"} dicts)."""
    req = pb.GenerateRequest(request_id=request_id, tenant=tenant)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)  # type: ignore[index]
    else:
        req.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    s = req.sampling
    for name, value in (
        ("max_new_tokens", max_new_tokens),
        ("temperature", temperature),
        ("top_k", top_k),
        ("top_p", top_p),
        ("seed", seed),
        ("ignore_eos", ignore_eos),
    ):
        if value is not None:
            setattr(s, name, value)
    s.stop.extend(x.encode("utf-8") for x in stop)
    s.stop_token_ids.extend(stop_token_ids)
    if lookahead is not None:
        req.lookahead.enable = lookahead
    if decoding_length is not None:
        req.lookahead.decoding_length = decoding_length
    if layout is not None:
        req.lookahead.layout = layout
    for name, value in zip(("jacobi_window", "jacobi_ngram", "jacobi_guesses"), jacobi or ()):
        if value is not None:
            setattr(req.lookahead, name, value)
    return req


class Client:
    """`Client("127.0.0.1:50051").generate("def fib(n):", max_new_tokens=64).text`"""

    def __init__(self, target: str = "127.0.0.1:50051", timeout: float | None = None) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.TextGenerationStub(self.channel)
        self.timeout = timeout

    def generate(self, prompt: Any, **kwargs: Any) -> pb.GenerateResponse:
        return self.stub.Generate(build_request(prompt, **kwargs), timeout=self.timeout)

    def stream(self, prompt: Any, **kwargs: Any) -> Iterator[pb.GenerateStreamResponse]:
        return self.stub.StreamGenerate(build_request(prompt, **kwargs), timeout=self.timeout)

    def tokenize(self, text: str) -> list[int]:
        return list(self.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=self.timeout).token_ids)

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
    with Client(args.target, timeout=args.timeout) as client:
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
