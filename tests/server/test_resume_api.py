"""Resumed generations through gRPC (`resume_token_ids` on GenerateRequest) and the OpenAI API
(the `resume_token_ids` extra): a stream cut after any message, resumed with the tokens it had
delivered, gives what the uninterrupted stream still had to give; bad resumes are refused."""

from __future__ import annotations

import grpc
import pytest

from batchserve.server.client import build_request
from batchserve.v1 import generation_pb2 as pb
from tests.server.test_openai_api import _client, _raw

PROMPT = [72, 101, 108, 108, 111]


def _request(resume: list[int] = (), **sampling: object) -> pb.GenerateRequest:  # type: ignore[assignment]
    req = build_request(PROMPT, max_new_tokens=24, ignore_eos=True, **sampling)  # type: ignore[arg-type]
    req.resume_token_ids.extend(resume)
    return req


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 5}])
async def test_a_grpc_stream_resumed_after_any_message_continues_it(running, sampling):
    whole = [m async for m in running.stub.StreamGenerate(_request(**sampling))]
    tokens = [t for m in whole for t in m.token_ids]
    text = "".join(m.text for m in whole)
    for cut in range(1, len(whole) - 1):
        delivered = [t for m in whole[:cut] for t in m.token_ids]
        rest = [m async for m in running.stub.StreamGenerate(_request(delivered, **sampling))]
        assert delivered + [t for m in rest for t in m.token_ids] == tokens
        assert "".join(m.text for m in whole[:cut]) + "".join(m.text for m in rest) == text
        assert rest[-1].usage.completion_tokens == len(tokens)  # the whole output, as uninterrupted


async def test_a_resume_the_stream_could_not_have_reached_is_invalid_argument(running):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await running.stub.Generate(_request([72, 300]))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "resume_token_ids[1]" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await running.stub.Generate(_request([65] * 24))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "nothing of max_new_tokens" in e.value.details()


async def test_the_openai_extra_resumes_a_completion(api):
    from batchserve import SamplingParams
    from tests.server.test_openai_api import _offline

    client = _client(api)
    ids = _offline(PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True)).token_ids
    kwargs = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    whole = await client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    resumed = await client.completions.create(**kwargs, extra_body={"ignore_eos": True, "resume_token_ids": ids[:6]})
    rest = _offline(PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True, resume_token_ids=ids[:6]))
    assert rest.token_ids == ids and resumed.choices[0].text == rest.text  # the whole output; the text after
    assert whole.choices[0].text.endswith(resumed.choices[0].text) and resumed.usage.completion_tokens == 16
    status, reply = await _raw(api, "POST", "/v1/completions", {**kwargs, "n": 2, "resume_token_ids": ids[:6]})
    assert status == 400 and reply["error"]["param"] == "resume_token_ids"
