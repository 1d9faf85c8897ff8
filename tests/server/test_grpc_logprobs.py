"""gRPC logprobs, penalties and logit_bias: Generate and StreamGenerate against the offline engine's
own values; bad values are INVALID_ARGUMENT naming the field, with nothing queued."""

from __future__ import annotations

import grpc
import pytest

from batchserve import SamplingParams
from batchserve.llm import LLM
from batchserve.server.client import build_request
from batchserve.v1 import generation_pb2 as pb
from tests.server.conftest import tiny_core

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9]
# Values a float32 holds exactly, so the gRPC request's parameters equal the offline ones.
PENALTIES = {"frequency_penalty": 0.5, "presence_penalty": 0.25, "logit_bias": {11: 3.0, 12: -100.0}}


def _offline(params: SamplingParams):
    return LLM.from_core(tiny_core()).generate([PROMPT], params)[0]


def _entries(logprobs) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Proto TokenLogprobs (or the engine's) as plain tuples."""
    out = []
    for e in logprobs:
        top = [(t.token_id, t.logprob) for t in e.top] if e.top and hasattr(e.top[0], "token_id") else list(e.top)
        out.append((e.token_id, e.logprob, top))
    return out


async def _stream(stub, req: pb.GenerateRequest) -> list[pb.GenerateStreamResponse]:
    return [c async for c in stub.StreamGenerate(req)]


async def test_logprobs_unary_and_streamed_equal_the_engines(running):
    expected = _offline(SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3))
    kwargs = {"max_new_tokens": 8, "ignore_eos": True, "logprobs": 3}
    unary = await running.stub.Generate(build_request(PROMPT, **kwargs))
    assert list(unary.token_ids) == expected.token_ids
    assert _entries(unary.logprobs) == _entries(expected.logprobs)  # float32 values: exact through the proto
    assert [e.token_id for e in unary.logprobs] == list(unary.token_ids)
    for e in unary.logprobs:
        tops = [t.logprob for t in e.top]
        assert len(e.top) == 3 and e.logprob <= 0 and tops == sorted(tops, reverse=True)
        # Greedy without penalties picks the raw distribution's argmax: the first alternative.
        assert (e.top[0].token_id, e.top[0].logprob) == (e.token_id, e.logprob)
    chunks = await _stream(running.stub, build_request(PROMPT, **kwargs))
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert _entries(e for c in chunks for e in c.logprobs) == _entries(unary.logprobs)


async def test_no_logprobs_unless_asked_and_zero_means_no_alternatives(running):
    plain = await running.stub.Generate(build_request(PROMPT, max_new_tokens=4, ignore_eos=True))
    assert len(plain.token_ids) == 4 and not plain.logprobs
    chunks = await _stream(running.stub, build_request(PROMPT, max_new_tokens=4, ignore_eos=True))
    assert not any(c.logprobs for c in chunks)
    zero = await running.stub.Generate(build_request(PROMPT, max_new_tokens=4, ignore_eos=True, logprobs=0))
    assert [e.token_id for e in zero.logprobs] == list(zero.token_ids) == list(plain.token_ids)
    assert all(not e.top and e.logprob <= 0 for e in zero.logprobs)


async def test_penalties_and_bias_change_the_output_as_the_engine_does(running):
    base = SamplingParams(max_new_tokens=16, ignore_eos=True)
    penalized = _offline(SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=1, **PENALTIES))
    assert penalized.token_ids != _offline(base).token_ids  # the penalties do change this output
    done = await running.stub.Generate(
        build_request(PROMPT, max_new_tokens=16, ignore_eos=True, logprobs=1, **PENALTIES)
    )
    assert list(done.token_ids) == penalized.token_ids
    assert _entries(done.logprobs) == _entries(penalized.logprobs)  # the raw distribution, not the penalized one
    rep = await running.stub.Generate(build_request(PROMPT, max_new_tokens=16, ignore_eos=True, repetition_penalty=1.5))
    assert (
        list(rep.token_ids)
        == _offline(SamplingParams(max_new_tokens=16, ignore_eos=True, repetition_penalty=1.5)).token_ids
    )
    forced = await running.stub.Generate(build_request(PROMPT, max_new_tokens=4, ignore_eos=True, logit_bias={42: 100}))
    assert list(forced.token_ids) == [42] * 4


def _bad_cases(vocab: int) -> list[tuple[dict, str]]:
    return [
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 10.5}, "repetition_penalty"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {5: -101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {vocab: 1.0}}, "logit_bias"),  # the engine's check against the vocabulary
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
    ]


@pytest.mark.parametrize("call", ["Generate", "StreamGenerate"])
async def test_bad_values_are_invalid_argument_naming_the_field_and_nothing_is_queued(running, call):
    cases = _bad_cases(running.core.facts.vocab_size)
    for extra, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            result = getattr(running.stub, call)(build_request(PROMPT, max_new_tokens=2, **extra))
            if call == "StreamGenerate":
                _ = [c async for c in result]
            else:
                await result
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, extra
        assert field in e.value.details(), (extra, e.value.details())
        assert not running.core.scheduler.has_work(), extra
    rejected = running.server.metrics.registry.get_sample_value(
        "batchserve_requests_rejected_total", {"code": "INVALID_ARGUMENT"}
    )
    assert rejected == len(cases)
    ok = await running.stub.Generate(build_request(PROMPT, max_new_tokens=2, logprobs=20, repetition_penalty=10.0))
    assert len(ok.logprobs) == 2 and all(len(e.top) == 20 for e in ok.logprobs)  # the bounds themselves are taken


async def test_logprob_amplification_is_refused_before_queueing_as_over_http(running, monkeypatch):
    """4,096 tokens with 20 alternatives each: a unary answer that could outgrow the message limit is
    INVALID_ARGUMENT at once (it failed after the whole generation); past HTTP's bound
    (MAX_OUTPUT_LOGPROBS, made small here) unary and streamed calls refuse it alike; nothing is
    queued, and a call within both bounds runs."""
    from batchserve.server.grpc import convert

    submitted = []
    generate = running.server.engine.generate
    monkeypatch.setattr(running.server.engine, "generate", lambda sub: (submitted.append(sub), generate(sub))[1])
    big = build_request(PROMPT, max_new_tokens=4096, ignore_eos=True, logprobs=20)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await running.stub.Generate(big)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "message limit" in e.value.details()
    assert not submitted
    monkeypatch.setattr(convert, "MAX_OUTPUT_LOGPROBS", 1000)
    for call in (running.stub.Generate, _stream):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call(running.stub, big) if call is _stream else await call(big)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 1000" in e.value.details()
    assert not submitted
    small = build_request(PROMPT, max_new_tokens=40, ignore_eos=True, logprobs=20)  # 840 entries
    assert len((await running.stub.Generate(small)).logprobs) == 40
