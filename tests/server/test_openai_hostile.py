"""Hostile input to the OpenAI front end (issue 79, items 3, 5 and 8): bodies that once reset the
connection or gave a 500 are 400 OpenAI error objects naming their field; echo with logprobs is
bounded per call and scored once per prompt; a response-format regex cannot end its grammar literal."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batchserve.grammar import GrammarCompiler, GrammarError, allows
from batchserve.request import Constraint
from batchserve.server.openai import bodies
from batchserve.server.openai.errors import ApiError
from batchserve.server.openai.options import MAX_SCHEMA_DEPTH, JsonSchemaFormat, ResponseFormat
from batchserve.server.openai.tools import parse_tool_request
from tests.conftest import TINY_VOCAB, make_tiny_tokenizer
from tests.server.test_openai_api import _client, _raw, _sse_frames

NOOP = {"type": "function", "function": {"name": "noop"}}
USER = [{"role": "user", "content": "hi"}]


def error_of(status: int, reply: dict[str, Any], param: str) -> str:
    """The message of a 400 OpenAI error object naming `param`."""
    assert status == 400, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error["message"]


def nested(depth: int, key: str = "items") -> dict[str, Any]:
    """A JSON Schema `depth` JSON levels deep (arrays of arrays of ...)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", key: schema}
    return schema


def with_nested(body: dict[str, Any], depth: int, key: str) -> bytes:
    """`body` as JSON with its "DEEP" value replaced by `nested(depth, key)`'s text (written
    without recursion: json.dumps would stop short of the depths under test)."""
    deep = f'{{"type": "array", "{key}": ' * (depth - 1) + '{"type": "string"}' + "}" * (depth - 1)
    return json.dumps(body).replace('"DEEP"', deep).encode()


# ---- item 5: 500s for bad input -------------------------------------------------------------


@pytest.mark.parametrize("key", ["²", "--5", "٣", "+5", " 5", "5\n", "1_0", "-0", "99999999999"])
async def test_a_logit_bias_key_that_is_not_a_token_id_is_a_400(api, key):
    for path, body in [
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1}),
        ("/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 1}),
    ]:
        status, reply = await _raw(api, "POST", path, {**body, "logit_bias": {key: 1.0}})
        assert "is not a token id" in error_of(status, reply, "logit_bias")


@pytest.mark.parametrize("fmt", ["json_object", ["json_object"], 3, True])
async def test_a_responses_text_format_that_is_not_an_object_is_a_400(api, fmt):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "text": {"format": fmt}}
    status, reply = await _raw(api, "POST", "/v1/responses", body)
    assert "must be an object" in error_of(status, reply, "text.format")


async def test_a_responses_field_is_named_as_the_request_sent_it(api):
    body = {"model": "tiny", "input": [{"type": "message", "content": "hi"}], "max_output_tokens": 2}
    status, reply = await _raw(api, "POST", "/v1/responses", body)
    error_of(status, reply, "input[0].role")
    fmt = {"type": "json_schema", "name": 7, "schema": {"type": "object"}}
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "text": {"format": fmt}}
    status, reply = await _raw(api, "POST", "/v1/responses", body)
    error_of(status, reply, "text.format.name")


async def deepest(api, path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    """The error for `body` with a schema at the deepest depth (from 1000 down) the server's JSON
    parser takes: the body just shallow enough to reach the handlers, which recurse further."""
    for depth in range(1000, 0, -1):
        status, reply = await _raw(api, "POST", path, with_nested(body, depth, key))
        assert status == 400, reply
        if reply["error"]["message"] != "There was an error parsing the body":
            return reply
    raise AssertionError("no depth parsed")


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("key", ["items", "additionalProperties"])
async def test_a_schema_nested_as_deep_as_a_body_parses_is_a_400(api, strict, key):
    """The issue's 957 levels (how deep a body parses depends on the stack the server runs on)."""
    schema = {"name": "deep", "schema": "DEEP", "strict": strict}
    fmt = {"model": "tiny", "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": schema}}
    param = "response_format.json_schema.schema"
    reply = await deepest(api, "/v1/chat/completions", fmt | {"messages": USER}, key)
    assert "MAX_SCHEMA_DEPTH" in error_of(400, reply, param)
    error_of(400, await deepest(api, "/v1/completions", fmt | {"prompt": "x"}, key), param)
    parameters = {"type": "object", "properties": {"x": "DEEP"}}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    body = {"model": "tiny", "max_tokens": 2, "messages": USER, "tools": [tool]}
    error_of(400, await deepest(api, "/v1/chat/completions", body, key), "tools[0].function.parameters")


def test_the_schema_depth_bound_is_exact():
    def fmt(depth: int) -> ResponseFormat:
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=nested(depth), strict=True))

    assert fmt(MAX_SCHEMA_DEPTH).constraint() is not None
    with pytest.raises(ApiError) as e:
        fmt(MAX_SCHEMA_DEPTH + 1).constraint()
    assert e.value.param == "response_format.json_schema.schema"


# ---- item 3: echo + logprobs -----------------------------------------------------------------


@pytest.fixture
def submitted(api) -> list[list[int]]:
    """The prompt of every request the engine is given."""
    seen: list[list[int]] = []
    real = api.core.add_request

    def spy(sub):
        seen.append(list(sub.prompt))
        return real(sub)

    api.core.add_request = spy
    return seen


PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


async def test_scoring_past_the_bound_is_a_400_naming_it(api, submitted, monkeypatch):
    monkeypatch.setattr(bodies, "MAX_PROMPT_SCORES", 200)
    body = {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 4}
    # 10 tokens x (4 + 1) x 4 samples = 200: at the bound; a fifth sample or alternative passes it.
    ok, _ = await _raw(api, "POST", "/v1/completions", {**body, "max_tokens": 0, "n": 4})
    assert ok == 200
    for extra in [{"n": 5}, {"logprobs": 5, "n": 4}, {"n": 2, "best_of": 5, "max_tokens": 2}, {"n": 3, "stream": True}]:
        fields = {"max_tokens": 0} | extra
        if "stream" in fields:
            fields["prompt"] = PROMPT * 2
        status, reply = await _raw(api, "POST", "/v1/completions", {**body, **fields})
        message = error_of(status, reply, "prompt")
        assert "MAX_PROMPT_SCORES" in message and "at most 200" in message
    assert len(submitted) == 1  # nothing past the bound reached the engine
    # Without echo nothing is scored: no bound.
    status, _ = await _raw(api, "POST", "/v1/completions", {**body, "echo": False, "max_tokens": 1, "n": 5})
    assert status == 200


async def test_scoring_samples_share_one_request_per_prompt(api, submitted):
    prompts = [PROMPT, PROMPT[:6]]
    kwargs = dict(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=2, temperature=0)
    client = _client(api, strict=False)
    alone = [(await client.completions.create(**kwargs | {"prompt": p})).choices[0] for p in prompts]
    submitted.clear()
    done = await client.completions.create(**kwargs, n=3, best_of=4)
    assert submitted == prompts  # one request per prompt, not one per sample
    assert [c.index for c in done.choices] == list(range(6))
    for i, c in enumerate(done.choices):
        want = alone[i // 3]
        assert (c.text, c.finish_reason) == (want.text, want.finish_reason)
        assert c.logprobs.token_logprobs == want.logprobs.token_logprobs
        assert c.logprobs.top_logprobs == want.logprobs.top_logprobs
    assert done.usage.prompt_tokens == len(PROMPT) + 6 and done.usage.completion_tokens == 0


async def test_streamed_scoring_samples_share_one_request(api, submitted):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "n": 3,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    frames = await _sse_frames(api, "/v1/completions", body)
    assert submitted == [PROMPT] and frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    texts: dict[int, str] = {}
    scores: dict[int, list[Any]] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            scores.setdefault(c["index"], []).extend((c["logprobs"] or {}).get("token_logprobs", []))
    assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) == 1
    assert len(scores[0]) == len(PROMPT) and scores[0] == scores[1] == scores[2]
    assert chunks[-1]["usage"]["prompt_tokens"] == len(PROMPT) and chunks[-1]["usage"]["completion_tokens"] == 0


# ---- item 8: the regex literal of the tools `auto` union ---------------------------------------


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(make_tiny_tokenizer(), TINY_VOCAB, max_chars=65536)


def takes(compiler: GrammarCompiler, constraint: Constraint, text: str) -> bool:
    """Whether `constraint` takes `text` whole and may end there."""
    g = compiler.matcher(compiler.compile(constraint))
    try:
        g.commit(list(text.encode()))  # the tiny tokenizer's ids are the bytes
    except GrammarError:
        return False
    return allows(g.prune(None)[1][0], g.eos_token_id)


def union(regex: str) -> Constraint:
    tools = parse_tool_request([NOOP], "auto", None, 65536)
    assert tools is not None
    out = tools.constraint(Constraint("regex", regex))
    assert out is not None and out.kind == "grammar"
    return out


# (regex, texts it takes, texts it must not): each a pattern that ends or bends a naive literal.
REGEXES = [
    (r"[a-z]+\/[0-9]+", ["ab/12"], ["ab\\/12", "ab12"]),
    (r"x\/ | \"INJECTED\"", ["x/ ", ' "INJECTED"'], ["INJECTED", "x\\"]),
    (r"a\\/b", ["a\\/b"], ["a/b", "a"]),  # an escaped backslash, then a slash
    (r"a\\\/b", ["a\\/b"], ["a/b"]),
    ("[/]x/", ["/x/"], ["x"]),
    ("a\nb", ["a\nb"], ["ab"]),
    (r"q/ | %json \{\} | /z", ["q/ ", " %json {} ", " /z"], ["{}", "q"]),
]


@pytest.mark.parametrize(("regex", "good", "bad"), REGEXES)
def test_a_regex_beside_tools_means_what_it_means_alone(compiler, regex, good, bad):
    alone, beside = Constraint("regex", regex), union(regex)
    for text in good:
        assert takes(compiler, alone, text) and takes(compiler, beside, text), text
    for text in bad:
        assert not takes(compiler, alone, text) and not takes(compiler, beside, text), text
    assert takes(compiler, beside, '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')


def test_a_regex_ending_in_a_lone_backslash_is_a_400():
    with pytest.raises(ApiError) as e:
        union("abc\\")
    assert e.value.param == "response_format.regex"
    assert union("abc\\\\") is not None  # an escaped one is a backslash


async def test_a_regex_with_an_escaped_slash_beside_tools_is_served(api):
    body = {"model": "tiny", "messages": USER, "max_tokens": 8, "tools": [NOOP], "tool_choice": "auto",
            "response_format": {"type": "regex", "regex": r"[0-9]{2}\/[0-9]{2}"}}  # fmt: skip
    status, reply = await _raw(api, "POST", "/v1/chat/completions", body)
    assert status == 200, reply
