"""Fuzzing the OpenAI-compatible HTTP API with schemathesis over its own /openapi.json (issue 79):
every operation the document lists, with bodies that match its schemas and bodies that break
them, sent to a running server over loopback. Whatever comes, the answer is a 2xx or an OpenAI
error object with a 4xx status: never a 5xx, never a connection cut without a response, never a
stream with a server error among its events.

A fixed seed and a few hundred examples per operation here (part of `make test`); `make fuzz` runs
more with the seed it is given (README.md, "Fuzzing")."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.server.conftest import Running
from tests.server.test_fuzz_convert import serving, small_core

SCALE = int(os.environ.get("BATCHSERVE_FUZZ_SCALE", "1"))  # make fuzz: 25
SEED = int(os.environ.get("BATCHSERVE_FUZZ_SEED", "79"))
FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))
MODES = {"valid": GenerationMode.POSITIVE, "invalid": GenerationMode.NEGATIVE}
EXAMPLES = {"valid": 100, "invalid": 60}  # per operation, times SCALE
BODIES = ("CompletionRequest", "ChatRequest", "ResponsesRequest")


@pytest.fixture(scope="module")
def api() -> Iterator[Running]:
    with serving(small_core(), http=True) as running:
        yield running


def _focused(document: dict[str, Any], model: str) -> dict[str, Any]:
    """The served document with `model` fixed to the one served and chat roles to the five there
    are, so that generated bodies get past those checks to the rest of the request (a wrong
    model is a plain 404, a wrong role a plain 400; the bodies that break the schema still try
    both)."""
    schemas = document.get("components", {}).get("schemas", {})
    for name in BODIES:
        properties = schemas.get(name, {}).get("properties", {})
        if "model" in properties:
            properties["model"] = {"type": "string", "enum": [model]}
    role = schemas.get("ChatMessage", {}).get("properties", {})
    if "role" in role:
        role["role"] = {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]}
    return document


@pytest.fixture(scope="module")
def base_url(api: Running) -> str:
    return f"http://127.0.0.1:{api.server.http_port}"


@pytest.fixture(scope="module")
def schema(base_url: str) -> Any:
    document = requests.get(f"{base_url}/openapi.json", timeout=30).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses"} <= set(document["paths"])
    return schemathesis.openapi.from_dict(_focused(document, "tiny"))


def check_answer(response: Any) -> None:
    """A 2xx (a JSON body, or a stream of JSON events with no server error) or a 4xx OpenAI error
    object; `response`: requests' or schemathesis' (headers as lists)."""
    assert response.status_code < 500, f"{response.status_code}: {response.text[:2000]}"
    if response.status_code >= 400:
        error = response.json().get("error")
        assert isinstance(error, dict), response.text[:2000]
        assert isinstance(error.get("message"), str) and error["message"], error
        assert isinstance(error.get("type"), str) and "param" in error and "code" in error, error
        return
    content_type = response.headers.get("content-type") or response.headers.get("Content-Type") or ""
    if not "".join(content_type).startswith("text/event-stream"):
        json.loads(response.text)
        return
    events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events, response.text[:2000]
    for data in events:
        if data != "[DONE]":
            event = json.loads(data)
            assert "server_error" not in (event.get("error") or {}).get("type", ""), data
            assert event.get("type") != "error", data


def _operations(schema: Any) -> list[Any]:
    return [result.ok() for result in schema.get_all_operations()]


def _fuzz(operation: Any, base_url: str, mode: str) -> None:
    """One operation's examples; a failure names the request (as curl) and what came back."""

    @seed(SEED)
    @settings(FUZZ, max_examples=EXAMPLES[mode] * SCALE)
    @given(case=operation.as_strategy(generation_mode=MODES[mode]))
    def fuzz(case: Any) -> None:
        request = case.as_curl_command(base_url=base_url)
        try:
            check_answer(case.call(base_url=base_url, timeout=60))
        except requests.ConnectionError as e:  # the server dropped the connection: no answer at all
            raise AssertionError(f"no response to {request}: {e}") from None
        except AssertionError as e:
            raise AssertionError(f"{request}\n{e}") from None

    fuzz()


@pytest.mark.parametrize("mode", list(MODES))
def test_every_operation_answers_any_body_without_a_server_error(schema: Any, base_url: str, mode: str) -> None:
    operations = _operations(schema)
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/responses"}
    failures = []
    for operation in operations:  # each one fuzzed whatever the others found
        if mode == "invalid" and not operation.get_request_payload_content_types():
            continue  # no body: a GET of the models or health, nothing in it to break
        try:
            _fuzz(operation, base_url, mode)
        except AssertionError as e:
            failures.append(f"{operation.method.upper()} {operation.path}: {e}")
    assert not failures, "\n\n".join(failures)


def test_a_top_p_that_is_zero_in_float32_samples_the_top_token(base_url: str) -> None:
    """Found by the fuzzer above: 5e-324 is a valid top_p in (0, 1] but 0 on the device, which
    kept no token; the draw was -1 and the answer a 500. The top token is always kept."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 1.0, "top_p": 5e-324, "seed": 1}
    response = requests.post(f"{base_url}/v1/completions", json=body, timeout=60)
    check_answer(response)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    greedy = requests.post(f"{base_url}/v1/completions", json=body | {"temperature": 0}, timeout=60).json()
    assert response.json()["choices"][0]["text"] == greedy["choices"][0]["text"]  # only the top token is kept


# Text with surrogates (hypothesis's text strategies never draw them, nor schemathesis's): in every
# field a tokenizer reads, a lone one must be a 400 naming the field, anything else not a 5xx.
SURROGATES = st.text(
    st.one_of(st.characters(categories=["Cs"]), st.characters(exclude_categories=[])), min_size=1, max_size=6
)
TEXT_FIELDS = [
    ("/v1/completions", "prompt", lambda t: {"prompt": t}),
    ("/v1/chat/completions", "messages[0].content", lambda t: {"messages": [{"role": "user", "content": t}]}),
    (
        "/v1/chat/completions",
        "prediction.content",
        lambda t: {"messages": [{"role": "user", "content": "x"}], "prediction": {"type": "content", "content": t}},
    ),
    ("/v1/responses", "input", lambda t: {"input": t}),
    ("/v1/chat/completions", "stop", lambda t: {"messages": [{"role": "user", "content": "x"}], "stop": t}),
]


@seed(SEED)
@settings(FUZZ, max_examples=40 * SCALE)
@given(place=st.sampled_from(TEXT_FIELDS), text=SURROGATES)
def test_text_with_surrogates_in_any_field_is_a_400_naming_it_or_served(base_url: str, place: Any, text: str) -> None:
    path, param, body = place
    data = json.dumps({"model": "tiny", "max_tokens": 2, **body(text)})  # escapes: \ud800 as JSON has it
    response = requests.post(f"{base_url}{path}", data=data, headers={"Content-Type": "application/json"}, timeout=60)
    if not _encodes(json.loads(data)):  # what the server reads (an escaped pair is one character)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    else:
        assert response.status_code < 500, response.text


def _encodes(value: Any) -> bool:
    if isinstance(value, str):
        return not any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, dict):
        return all(_encodes(k) and _encodes(v) for k, v in value.items())
    return all(_encodes(v) for v in value) if isinstance(value, list) else True


def _raw(base_url: str, head: bytes, chunks: list[bytes], pause: float = 0.0) -> tuple[int, bytes]:
    """One request as raw bytes (its head, then its body in `chunks`, `pause` s apart): the status
    and body of the answer, or (0, b"") where the server closed without one."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        try:
            for chunk in chunks:
                time.sleep(pause)
                sock.sendall(chunk)
        except OSError:  # answered (and closed) before the body was all sent: a refusal
            pass
        data = b""
        try:
            while b"\r\n\r\n" not in data or len(data) < _length(data):
                more = sock.recv(65536)
                if not more:
                    break
                data += more
        except OSError:
            pass
    if not data.startswith(b"HTTP/1.1 "):
        return 0, b""
    return int(data[9:12]), data.partition(b"\r\n\r\n")[2]


def _length(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(head) + 4 + int(line.split(b":")[1])
    return len(data) + 1 << 30


@seed(SEED)
@settings(FUZZ, max_examples=12 * SCALE)
@given(
    kind=st.sampled_from(("nested", "length", "trickled")),
    depth=st.integers(1, 200_000),
    length=st.integers(1 << 30, 10**18),
    cuts=st.lists(st.integers(1, 64), min_size=1, max_size=6),
)
def test_deep_nesting_huge_lengths_and_trickled_bodies_are_never_a_server_error(
    base_url: str, kind: str, depth: int, length: int, cuts: list[int]
) -> None:
    """Bodies no schema describes: JSON nested `depth` deep in a field, a Content-Length of 1 GiB to
    10^18 with a few bytes behind it, a valid body sent in pieces. Each is answered, a 4xx OpenAI
    error object or served, never a 5xx."""
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n"
    if kind == "nested":
        body = ('{"model": "tiny", "max_tokens": 1, "prompt": ' + "[" * depth + "1" + "]" * depth + "}").encode()
        status, answer = _raw(base_url, head.format(len(body)).encode(), [body])
    elif kind == "length":
        status, answer = _raw(base_url, head.format(length).encode(), [b'{"model": "tiny"'])
        assert status == 413, answer[:500]  # at once, by the declared length (one that never comes: test_door)
    else:
        body = b'{"model": "tiny", "prompt": "Hi", "max_tokens": 2}'
        pieces, at = [], 0
        for cut in [*cuts, len(body)]:
            pieces.append(body[at : at + cut])
            at += cut
        status, answer = _raw(base_url, head.format(len(body)).encode(), [p for p in pieces if p], pause=0.01)
        assert status == 200, answer[:500]
    if status:
        assert status < 500, answer[:2000]
        if status >= 400:
            assert isinstance(json.loads(answer)["error"]["message"], str)
