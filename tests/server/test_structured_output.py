"""Structured output over both front ends: OpenAI's `response_format` (the official client), its
regex and grammar extras, gRPC's `constraint` oneof, and the refusals of a bad or oversized one."""

from __future__ import annotations

import json
import re
from collections import Counter

import grpc
import httpx
import pytest

from batchserve.grammar.steps import GrammarSteps
from batchserve.request import Constraint
from batchserve.server.client import build_request
from batchserve.v1 import generation_pb2 as pb
from tests.server.test_openai_api import _client, _raw

MESSAGES = [{"role": "user", "content": "give me a record"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["book", "film"]},
        "title": {"type": "string", "maxLength": 10},
    },
    "required": ["id", "kind", "title"],
    "additionalProperties": False,
}

# An object that must hold itself: no finite document matches.
ENDLESS = {
    "$ref": "#/$defs/a",
    "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
}


@pytest.fixture
def api(ascii_api):
    return ascii_api


def _valid(text: str) -> bool:
    doc = json.loads(text)
    return set(doc) == {"id", "kind", "title"} and doc["kind"] in ("book", "film") and 0 <= doc["id"] <= 999


async def test_the_official_client_gets_documents_that_match_its_schema(api):
    client = _client(api)
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0, response_format=fmt)
    drafted = await client.chat.completions.create(**kw)
    plain = await client.chat.completions.create(**kw, extra_body={"lookahead": {"enable": False}})
    assert _valid(drafted.choices[0].message.content)
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    assert drafted.choices[0].finish_reason == "stop"
    mode = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=300, temperature=0, response_format={"type": "json_object"}
    )
    assert mode.choices[0].message.content.startswith("{")  # an object, closed or cut at max_tokens
    if mode.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(mode.choices[0].message.content), dict)
    # Streamed, and on legacy completions too (an extra there, as vLLM takes it).
    stream = await client.chat.completions.create(**kw, stream=True)
    streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert streamed == drafted.choices[0].message.content
    legacy = _client(api, strict=False)
    done = await legacy.completions.create(
        model="tiny",
        prompt="id: ",
        max_tokens=20,
        temperature=0,
        extra_body={"response_format": {"type": "regex", "regex": "[0-9]{4}"}},
    )
    assert re.fullmatch("[0-9]{4}", done.choices[0].text)


@pytest.mark.parametrize(
    ("fmt", "message"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "strin"),
        ({"type": "json_schema"}, "json_schema is required"),
        ({"type": "regex", "regex": "[0-9"}, "unclosed character class"),
        ({"type": "grammar"}, "grammar is required"),
        ({"type": "grammar", "grammar": "start: nowhere"}, "nowhere"),
        ({"type": "regex", "regex": "a" * 70000}, "limit is 65536"),
        ({"type": "xml"}, "type"),
        # Grammars that compile but can never be satisfied: refused before anything is queued.
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}, "admits no text"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": ENDLESS}}, "admits no text"),
        ({"type": "regex", "regex": "[^\\x00-\\U0010FFFF]"}, "admits no text"),
    ],
)
async def test_a_bad_response_format_is_a_400_naming_the_problem(api, fmt, message):
    for path, body in (
        ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES}),
        ("/v1/completions", {"model": "tiny", "prompt": "x"}),
    ):
        code, reply = await _raw(api, "POST", path, {**body, "max_tokens": 2, "response_format": fmt})
        assert code == 400 and message in reply["error"]["message"], reply
    assert not api.core.has_work()


async def test_grpc_constraints_and_their_refusals(api):
    got = await api.stub.Generate(
        build_request("code:", max_new_tokens=20, constraint=Constraint("grammar", 'start: "A" ("-" "B")*'))
    )
    assert re.fullmatch(r"A(-B)*", got.text), got.text
    schema = await api.stub.Generate(
        build_request("x", max_new_tokens=200, constraint=Constraint("json_schema", json.dumps(SCHEMA)))
    )
    assert _valid(schema.text)
    for bad, problem in (
        (Constraint("json_schema", "{nope"), "invalid json_schema"),
        (Constraint("regex", "(unclosed"), "regex"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await api.stub.Generate(build_request("x", max_new_tokens=4, constraint=bad))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and problem in err.value.details()
    request = build_request("x", max_new_tokens=4)
    request.regex = ""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await api.stub.Generate(request)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "non-empty" in err.value.details()
    assert not api.core.has_work()


async def test_a_grammar_failing_mid_answer_ends_it_with_an_error_finish_not_a_500(api, monkeypatch):
    """A grammar that admits no continuation after some tokens (an llguidance limit met mid-text)
    ends that request with its text so far and an error finish: never a 500 or parser internals."""
    real, calls = GrammarSteps.advance, Counter()

    def failing(self, req, token):
        # Each request's second token (one counter for all calls left a short answer, as the
        # Responses call's `{}` can be, ending before its turn came: a flaky pass as "completed").
        calls[req.request_id] += 1
        if calls[req.request_id] == 2:
            return "structured output failed: the grammar admits no continuation here (injected)"
        return real(self, req, token)

    monkeypatch.setattr(GrammarSteps, "advance", failing)
    fmt = {"type": "regex", "regex": "[a-z]{8}"}
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 20, "response_format": fmt}
    code, reply = await _raw(api, "POST", "/v1/chat/completions", body)
    assert code == 400 and reply["error"]["param"] == "response_format", reply
    assert "injected" in reply["error"]["message"] and "<state>" not in reply["error"]["message"]
    # Streamed: the text so far, then an error event (no finish reason strict clients would refuse).
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api.server.http_port}", timeout=30) as http:
        got = await http.post("/v1/chat/completions", json={**body, "stream": True})
        events = [json.loads(line[6:]) for line in got.text.splitlines() if line.startswith("data: {")]
        assert got.status_code == 200 and "injected" in events[-1]["error"]["message"]
        assert all(c["finish_reason"] is None for e in events[:-1] for c in e["choices"])
        assert "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e["choices"])
        assert got.text.endswith("data: [DONE]\n\n")
        got = await http.post(
            "/v1/responses",
            json={"model": "tiny", "input": "x", "stream": True, "text": {"format": {"type": "json_object"}}},
        )
    kinds = [line[7:] for line in got.text.splitlines() if line.startswith("event: ")]
    assert kinds[-1] == "error" and "response.completed" not in kinds and "injected" in got.text
    # gRPC has an error finish of its own: the text so far and FINISH_REASON_ERROR.
    got = await api.stub.Generate(build_request("x", max_new_tokens=20, constraint=Constraint("regex", "[a-z]{8}")))
    assert got.finish_reason == pb.FINISH_REASON_ERROR and len(got.token_ids) == 1  # the token before the failing one
    assert not api.core.has_work()
