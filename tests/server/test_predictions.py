"""Predicted outputs over both front ends: OpenAI's `prediction` (the official client) and gRPC's
`reference`, the usage counts they report, and the refusals of a bad or oversized one."""

from __future__ import annotations

import grpc
import openai
import pytest

from batchserve.server.client import build_request
from tests.server.test_openai_api import _client, _raw

MESSAGES = [{"role": "user", "content": "rewrite this"}]


@pytest.fixture
def api(ascii_api):
    return ascii_api


def _details(usage) -> tuple[int, int]:
    d = usage.completion_tokens_details
    return d.accepted_prediction_tokens, d.rejected_prediction_tokens


async def test_chat_with_a_prediction_gives_the_same_text_in_fewer_steps(api):
    client = _client(api)
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    plain = await client.chat.completions.create(**kw)
    text = plain.choices[0].message.content
    assert _details(plain.usage) == (0, 0)
    for content in (text, [{"type": "text", "text": text[:10]}, {"type": "text", "text": text[10:]}]):
        got = await client.chat.completions.create(**kw, prediction={"type": "content", "content": content})
        assert got.choices[0].message.content == text
        accepted, rejected = _details(got.usage)
        speculation = got.usage.model_extra["speculation"]
        assert accepted > 20 and accepted + rejected == len(api.core.text.tokenize_references([text])[0])
        assert speculation["steps"] < 20
    wrong = await client.chat.completions.create(**kw, prediction={"type": "content", "content": "zzzz"})
    assert wrong.choices[0].message.content == text and _details(wrong.usage) == (0, 4)


async def test_completions_and_streams_report_prediction_usage(api):
    legacy = _client(api, strict=False)  # streamed legacy completions: see _client
    kw = dict(model="tiny", prompt="abc", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = (await legacy.completions.create(**kw)).choices[0].text
    kw["extra_body"] = {"ignore_eos": True, "prediction": {"type": "content", "content": text}}
    whole = await legacy.completions.create(**kw)
    assert whole.choices[0].text == text and _details(whole.usage)[0] > 10
    stream = await legacy.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert _details(chunks[-1].usage) == _details(whole.usage)


@pytest.mark.parametrize(
    ("prediction", "param", "message"),
    [
        ({"type": "file", "content": "x"}, "prediction.type", "only 'content'"),
        ({"type": "content", "content": [{"type": "image_url", "image_url": {}}]}, "prediction.content[0]", "text"),
        ({"type": "content"}, "prediction.content", "required"),
        ({"type": "content", "content": "x" * 2000}, "prediction", "over 1024 tokens"),  # one token a byte here
        ({"type": "content", "content": "x" * (32 * 1024 + 1)}, "prediction", "characters cannot fit"),
    ],
)
async def test_a_bad_or_oversized_prediction_is_a_400_naming_it(api, prediction, param, message):
    for path, body in (
        ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES}),
        ("/v1/completions", {"model": "tiny", "prompt": "x"}),
    ):
        code, reply = await _raw(api, "POST", path, {**body, "max_tokens": 2, "prediction": prediction})
        assert code == 400 and reply["error"]["param"] == param and message in reply["error"]["message"], reply
        assert param is not None or "prediction" in reply["error"]["message"]
    assert not api.core.has_work()


async def test_the_official_client_gets_an_openai_error_for_an_unknown_type(api):
    """The client sends what it is given; the server names what it cannot take."""
    client = _client(api)
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=2,
            prediction={"type": "other", "content": "x"},  # type: ignore[arg-type]
        )
    assert e.value.status_code == 400 and "prediction.type" in str(e.value)


async def test_grpc_reference_drafts_and_reports_usage(api):
    stub = api.stub
    base = await stub.Generate(build_request([5, 6, 7], max_new_tokens=32, ignore_eos=True))
    request = build_request([5, 6, 7], max_new_tokens=32, ignore_eos=True, references=[base.text])
    got = await stub.Generate(request)
    assert got.token_ids == base.token_ids and got.stats.steps < 16
    assert got.usage.accepted_prediction_tokens > 16
    assert got.usage.accepted_prediction_tokens + got.usage.rejected_prediction_tokens == 32
    assert (base.usage.accepted_prediction_tokens, base.usage.rejected_prediction_tokens) == (0, 0)
    last = [c async for c in stub.StreamGenerate(request)][-1]
    assert last.usage.accepted_prediction_tokens == got.usage.accepted_prediction_tokens


@pytest.mark.parametrize(
    ("references", "message"),
    [(["x"] * 17, "reference: 17 references, at most 16"), (["x" * 1025], "reference: over 1024 tokens")],
)
async def test_grpc_refuses_too_many_or_too_large_references(api, references, message):
    request = build_request([5, 6, 7], max_new_tokens=2)
    request.reference.extend(references)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await api.stub.Generate(request)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
    assert not api.core.has_work()
