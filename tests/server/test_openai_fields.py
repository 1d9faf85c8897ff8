"""docs/http-api.md's table of every request field, walked: it covers every field of the official
client's two requests and every field the server declares, and each row's examples get the
answer the row says (200 accepted and ignored, 400 naming the field refused)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import chat_completion_stream_options_param as stream_options
from openai.types.chat import completion_create_params as chat_params

from batchserve.server.openai.bodies import ChatRequest, CompletionRequest
from batchserve.server.openai.fields import NEUTRAL
from batchserve.server.openai.options import StreamOptions
from tests.server.test_openai_api import _raw

DOC = Path(__file__).resolve().parents[2] / "docs" / "http-api.md"
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def _rows() -> list[dict[str, str]]:
    text = DOC.read_text()
    table = text[text.index("| field | endpoint | here |") :].split("\n\n")[0].splitlines()[2:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    keys = ("field", "endpoint", "here", "why", "accepted", "refused")
    return [dict(zip(keys, [c.strip("`") if i in (0, 4, 5) else c for i, c in enumerate(row)])) for row in cells]


ROWS = _rows()


def _fields(endpoint: str) -> set[str]:
    return {r["field"] for r in ROWS if r["endpoint"] in (endpoint, "both")}


def _declared(model: Any) -> set[str]:
    options = {f"stream_options.{f}" for f in StreamOptions.model_fields}
    return (set(model.model_fields) - {"stream_options"}) | options


def test_the_table_covers_the_official_clients_fields_and_every_declared_one():
    sdk_options = {f"stream_options.{f}" for f in stream_options.ChatCompletionStreamOptionsParam.__annotations__}
    sdk = {
        "chat": (set(chat_params.CompletionCreateParamsBase.__annotations__) - {"stream_options"}) | sdk_options,
        "completions": (set(completion_params.CompletionCreateParamsBase.__annotations__) - {"stream_options"})
        | sdk_options,
    }
    for endpoint, model in (("chat", ChatRequest), ("completions", CompletionRequest)):
        documented = _fields(endpoint)
        assert sdk[endpoint] - documented == set(), f"{endpoint}: the client's fields missing from the table"
        assert _declared(model) == documented, f"{endpoint}: the table and the server's fields differ"
    assert len({(r["field"], r["endpoint"]) for r in ROWS}) == len(ROWS)
    assert {r["here"] for r in ROWS} == {"supported", "ignored", "refused"}


def test_every_ignored_or_refused_chat_field_gives_the_codes_reason():
    rows = {r["field"]: r for r in ROWS if r["endpoint"] == "chat" and r["here"] != "supported"}
    assert set(NEUTRAL) == set(rows)
    for name, rule in NEUTRAL.items():
        row = rows[name]
        assert row["here"] == ("refused" if rule.ignored == "-" else "ignored"), name
        assert row["why"] == (rule.refused if row["here"] == "refused" else rule.ignored), name


def _body(endpoint: str, field: str, value: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 2}
    body |= {"prompt": [5, 6, 7]} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    if field.startswith("stream_options."):
        return body | {"stream_options": {field.split(".", 1)[1]: value}}
    return body | {field: value}


EXAMPLES = [
    (endpoint, r["field"], kind, r[kind])
    for r in ROWS
    for kind in ("accepted", "refused")
    if r[kind] != "-"
    for endpoint in (("chat", "completions") if r["endpoint"] == "both" else (r["endpoint"],))
]


@pytest.mark.parametrize(("endpoint", "field", "kind", "example"), EXAMPLES)
async def test_each_rows_examples_get_the_answer_the_row_says(api, endpoint, field, kind, example):
    status, reply = await _raw(api, "POST", ENDPOINTS[endpoint], _body(endpoint, field, json.loads(example)))
    if kind == "accepted":
        assert status == 200, reply
    else:
        assert status == 400 and reply["error"]["param"] == field.split(".")[0], reply
        assert re.search(re.escape(field.split(".")[-1]), reply["error"]["message"]), reply


async def test_an_unknown_field_is_still_a_400_naming_it(api):
    for endpoint in ENDPOINTS:
        status, reply = await _raw(api, "POST", ENDPOINTS[endpoint], _body(endpoint, "temprature", 0.5))
        assert status == 400 and reply["error"]["param"] == "temprature"


async def test_the_official_client_with_openais_own_options_gets_an_answer(api):
    from tests.server.test_openai_api import _client

    messages = [{"role": "user", "content": "hi"}]
    plain = await _client(api).chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    options = {
        "store": True, "metadata": {"run": "1"}, "service_tier": "default", "prompt_cache_key": "k",
        "prompt_cache_retention": "in_memory", "safety_identifier": "user-1", "modalities": ["text"],
        "verbosity": "medium", "reasoning_effort": "none",
    }  # fmt: skip
    done = await _client(api).chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, temperature=0, **options
    )
    assert done.choices[0].message.content == plain.choices[0].message.content  # ignored: the same answer
    stream = await _client(api).chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False}, **options,
    )  # fmt: skip
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == plain.choices[0].message.content
