"""Usage as a gateway reads it: chat's `n` counts the prompt once (as completions' does), and the
tokens a resumed generation carried in (`resume_token_ids`) are reported on their own, over HTTP
and gRPC, so that they can be counted with the prompt against an input limit; an over-long resume
is refused at its count, before any token is copied."""

from __future__ import annotations

import asyncio
import http.client
import json

import grpc
import pytest

from batchserve.config import LimitsConfig
from batchserve.server.client import build_request
from batchserve.server.grpc import convert
from tests.server.test_openai_api import _raw

PROMPT = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]
MESSAGES = [{"role": "user", "content": "hello there, how many times am I counted?"}]


async def test_chat_with_n_counts_the_prompt_once(api):
    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "temperature": 0.8, "seed": 1, "ignore_eos": True}
    status, one = await _chat_usage(api, chat)
    assert status == 200
    for stream in (False, True):
        body = {**chat, "n": 3, "stream": stream} | ({"stream_options": {"include_usage": True}} if stream else {})
        status, three = await _chat_usage(api, body)
        assert status == 200
        assert three["prompt_tokens"] == one["prompt_tokens"] > 0, stream  # computed once for the 3 samples
        assert three["completion_tokens"] == 3 * 4 and three["total_tokens"] == three["prompt_tokens"] + 12


async def _chat_usage(api, body: dict) -> tuple[int, dict]:
    """The usage of a chat call, streamed (its usage chunk) or not."""

    def call() -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", api.server.http_port, timeout=30)
        conn.request(
            "POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        raw = resp.read().decode()
        conn.close()
        if not body.get("stream"):
            return resp.status, json.loads(raw)["usage"]
        events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        return resp.status, [e["usage"] for e in events if e.get("usage")][-1]

    return await asyncio.to_thread(call)


async def test_resumed_tokens_are_reported_on_their_own(api):
    kwargs = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    status, whole = await _raw(api, "POST", "/v1/completions", kwargs)
    assert status == 200 and whole["usage"]["resumed_tokens"] == 0
    reply = await api.stub.Generate(build_request(PROMPT, max_new_tokens=10, ignore_eos=True))
    assert reply.usage.resumed_tokens == 0
    resumed = list(reply.token_ids[:4])
    status, rest = await _raw(api, "POST", "/v1/completions", {**kwargs, "resume_token_ids": resumed})
    assert status == 200
    usage = rest["usage"]
    # The whole output's tokens, as uninterrupted; of them, the 4 the client sent.
    assert usage["resumed_tokens"] == 4 and usage["completion_tokens"] == 10 and usage["prompt_tokens"] == len(PROMPT)
    req = build_request(PROMPT, max_new_tokens=10, ignore_eos=True)
    req.resume_token_ids.extend(resumed)
    grpc_rest = [m async for m in api.stub.StreamGenerate(req)]
    assert grpc_rest[-1].usage.resumed_tokens == 4 and grpc_rest[-1].usage.completion_tokens == 10


def test_an_over_long_resume_is_refused_at_its_count(monkeypatch: pytest.MonkeyPatch):
    req = build_request(PROMPT, max_new_tokens=1_000_000)
    req.resume_token_ids.extend([65] * 5000)

    def never(**_: object) -> None:
        raise AssertionError("the resumed tokens were copied before their count was checked")

    monkeypatch.setattr(convert, "SamplingParams", never)
    with pytest.raises(ValueError, match=r"resume_token_ids: 5000 tokens, at most 62.*context of 64"):
        convert.sampling_params(req, LimitsConfig(), max_model_len=64)


async def test_an_over_long_resume_is_invalid_argument_naming_the_field(running):
    context = running.core.facts.max_model_len
    req = build_request(PROMPT, max_new_tokens=10 * context, ignore_eos=True)
    req.resume_token_ids.extend([65] * context)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await running.stub.Generate(req)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"resume_token_ids: {context} tokens, at most {context - 2}" in e.value.details()
