"""Fuzzing the gRPC request conversion with hypothesis (issue 79): any GenerateRequest protobuf
can hold (any input, sampling and lookahead options, references, constraint, resumed tokens)
becomes engine parameters or a ValueError naming its field (`server/grpc/convert.py`'s contract),
and, sent to a running server, an answer or INVALID_ARGUMENT naming the field: never another
status (UNKNOWN is an exception escaping), never a hang. The engine's outputs convert back to
protos whatever their values.

A fixed seed and a few hundred examples here (part of `make test`); `make fuzz` runs more with the
seed it is given (README.md, "Fuzzing")."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import math
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from batchserve.admission import Submission, client_id, id_namespace
from batchserve.config import CacheConfig, DraftConfig, EngineConfig, LimitsConfig, ModelConfig, SchedulerConfig
from batchserve.engine import EngineCore
from batchserve.request import FinishReason, RequestOutput, RequestStats, TokenLogprob
from batchserve.server.grpc import convert
from batchserve.v1 import generation_pb2 as pb
from batchserve.v1 import generation_pb2_grpc as pb_grpc
from tests.conftest import make_tiny_model, make_tiny_tokenizer
from tests.server.conftest import CHAT_TEMPLATE, Running, start_server

SCALE = int(os.environ.get("BATCHSERVE_FUZZ_SCALE", "1"))  # make fuzz: 25
SEED = int(os.environ.get("BATCHSERVE_FUZZ_SEED", "79"))
FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))
CONTEXT = 64  # a short context: a request the fuzzer lets run to the end costs little


def small_core(max_model_len: int = CONTEXT) -> EngineCore:
    """The tiny model behind a small engine with a short context."""
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    config = EngineConfig(
        model=ModelConfig(max_model_len=max_model_len),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        draft=DraftConfig(decoding_length=8, adaptive=False),
    )
    return EngineCore(config, make_tiny_model(), tokenizer)


@contextlib.contextmanager
def serving(core: EngineCore, **server_kwargs: Any) -> Iterator[Running]:
    """A server on an event loop of its own, in a thread: hypothesis drives synchronous tests."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzzed-server", daemon=True)
    thread.start()
    running = asyncio.run_coroutine_threadsafe(start_server(core, **server_kwargs), loop).result(120)

    async def stop() -> None:
        await running.channel.close()
        await running.server.shutdown()

    try:
        yield running
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def _field_names(descriptor: Any, names: set[str]) -> set[str]:
    names.update(o.name for o in descriptor.oneofs)
    for f in descriptor.fields:
        if f.name not in names:
            names.add(f.name)
            if f.message_type is not None:
                _field_names(f.message_type, names)
    return names


FIELDS = _field_names(pb.GenerateRequest.DESCRIPTOR, set())


def names_a_field(message: str) -> bool:
    """Whether an error message starts by naming a field of the request (`sampling.stop[2]: ...`,
    `request_id 'x' is already in use`)."""
    head = message.split(":", 1)[0]
    return any(word in FIELDS for word in re.split(r"[^A-Za-z0-9_]+", head))


def mostly(valid: st.SearchStrategy[Any], wild: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid` 7 times in 8, else `wild` (anything the field's type holds): most requests get past
    most fields to the deeper checks and to the engine, and every field is still tried wild."""
    return st.one_of(*[valid] * 7, wild)


INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
FLOAT = st.floats(width=32)  # NaN, infinities, subnormals: what a float field holds
TEXT = st.text(max_size=24)
WORDS = st.text(st.characters(codec="ascii"), min_size=1, max_size=12)
TOKEN = st.integers(0, 255)  # the tiny model's vocabulary
IDS = mostly(st.lists(TOKEN, max_size=6), st.lists(INT64 | st.integers(0, 300), max_size=6))
SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": mostly(st.integers(1, 16), INT32),
        "temperature": mostly(st.sampled_from([0.0, 0.7, 1.0]) | st.floats(0, 2), FLOAT),
        "top_k": mostly(st.integers(0, 300), INT32),
        "top_p": mostly(st.floats(0.05, 1), FLOAT),
        "seed": st.integers(0, 2**64 - 1),
        "stop": mostly(st.lists(WORDS.map(str.encode), max_size=3), st.lists(st.binary(max_size=4), max_size=20)),
        "stop_token_ids": IDS,
        "ignore_eos": st.booleans(),
        "logprobs": mostly(st.integers(0, 5), INT32),
        "frequency_penalty": mostly(st.floats(-2, 2), FLOAT),
        "presence_penalty": mostly(st.floats(-2, 2), FLOAT),
        "repetition_penalty": mostly(st.floats(0.5, 2), FLOAT),
        "logit_bias": st.dictionaries(mostly(TOKEN, INT64), mostly(st.floats(-100, 100), FLOAT), max_size=4),
    },
).map(lambda d: pb.SamplingOptions(**d))
LOOKAHEAD = st.fixed_dictionaries(
    {},
    optional={
        "enable": st.booleans(),
        "decoding_length": mostly(st.integers(0, 16), INT32),
        "layout": mostly(st.sampled_from(["hierarchical", "parallel", "single"]), TEXT),
        "jacobi_window": mostly(st.integers(1, 5), INT32),
        "jacobi_ngram": mostly(st.integers(2, 5), INT32),
        "jacobi_guesses": mostly(st.integers(0, 5), INT32),
    },
).map(lambda d: pb.LookaheadOptions(**d))
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
MESSAGES = st.lists(st.builds(pb.ChatMessage, role=mostly(ROLES, TEXT), content=TEXT), max_size=4)
INPUT = mostly(
    st.one_of(
        st.fixed_dictionaries({"text": mostly(WORDS, TEXT)}),
        st.fixed_dictionaries({"token_ids": st.builds(pb.TokenIds, ids=IDS)}),
        st.fixed_dictionaries({"chat": st.builds(pb.ChatMessages, messages=MESSAGES)}),
    ),
    st.just({}),
)
SCHEMAS = st.sampled_from(['{"type": "object"}', '{"type": "string", "maxLength": 3}', "{}", "[]"])
CONSTRAINT = st.one_of(
    *[st.just({})] * 4,
    st.fixed_dictionaries({"json_object": st.booleans()}),
    st.fixed_dictionaries({"json_schema": mostly(SCHEMAS, TEXT)}),
    st.fixed_dictionaries({"regex": mostly(st.sampled_from(["[a-z]+", "a|b", "x{2,5}"]), TEXT)}),
    st.fixed_dictionaries({"grammar": mostly(st.sampled_from(['start: "a"+', "start: /[0-9]+/"]), TEXT)}),
)
KEY = mostly(st.sampled_from(["", "r-1", "tenant.a"]), TEXT)


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    fields: dict[str, Any] = {"request_id": draw(KEY), "tenant": draw(KEY)}
    fields |= draw(INPUT) | draw(CONSTRAINT)
    fields["sampling"], fields["lookahead"] = draw(SAMPLING), draw(LOOKAHEAD)
    fields["reference"] = draw(mostly(st.lists(WORDS, max_size=2), st.lists(TEXT, max_size=20)))
    fields["resume_token_ids"] = draw(mostly(st.just([]), IDS))
    return pb.GenerateRequest(**fields)


SAMPLING_PARAMETERS = inspect.signature(convert.sampling_params).parameters


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return small_core()


def _refused_naming_a_field(call: Any) -> None:
    """`call()` returns, or raises a ValueError whose message names a field; anything else fails."""
    try:
        call()
    except ValueError as e:
        assert names_a_field(str(e)), f"the error names no field: {e}"


@seed(SEED)
@settings(FUZZ, max_examples=400 * SCALE)
@given(request=generate_requests())
def test_a_request_converts_or_is_refused_naming_its_field(core: EngineCore, request: pb.GenerateRequest) -> None:
    _refused_naming_a_field(lambda: convert.prompt_of(request, core.text))
    _refused_naming_a_field(lambda: convert.references_of(request, core.text))
    context = {"max_model_len": core.facts.max_model_len} if "max_model_len" in SAMPLING_PARAMETERS else {}
    _refused_naming_a_field(lambda: convert.sampling_params(request, LimitsConfig(), **context))


COUNT = st.integers(0, 2**32 - 1)


@st.composite
def outputs(draw: st.DrawFn) -> RequestOutput:
    logprob = st.floats(allow_nan=True) | st.floats(-30, 0)
    entry = st.builds(TokenLogprob, st.integers(0, 2**31 - 1), logprob, st.lists(st.tuples(COUNT, logprob)))
    counters = [f.name for f in dataclasses.fields(RequestStats) if type(f.default) is int]
    stats = RequestStats(**draw(st.fixed_dictionaries({k: COUNT for k in counters})))
    stats.reference_drafts_accepted = draw(st.integers(0, stats.prediction_tokens))  # a share of them
    return RequestOutput(
        request_id=draw(TEXT),
        new_token_ids=draw(st.lists(st.integers(0, 2**31 - 1), max_size=4)),
        new_text=draw(TEXT),
        finished=draw(st.booleans()),
        finish_reason=draw(st.none() | st.sampled_from(list(FinishReason))),
        num_prompt_tokens=draw(COUNT),
        num_output_tokens=draw(COUNT),
        stats=stats,
        new_logprobs=draw(st.none() | st.lists(entry, max_size=3)),
    )


@seed(SEED)
@settings(FUZZ, max_examples=200 * SCALE)
@given(out=outputs())
def test_any_engine_output_converts_to_its_proto(out: RequestOutput) -> None:
    chunk = convert.stream_chunk(out)
    # The engine's id is namespaced per tenant; the client reads back the id it chose.
    assert (chunk.request_id, chunk.text, list(chunk.token_ids)) == (
        client_id(out.request_id),
        out.new_text,
        out.new_token_ids,
    )
    assert chunk.usage.prompt_tokens == out.num_prompt_tokens and chunk.stats.steps == out.stats.steps
    assert len(chunk.logprobs) == len(out.new_logprobs or ())
    assert math.isfinite(chunk.stats.tokens_per_step) or out.stats.steps == 0


# What a server may answer a fuzzed request: anything else is a failure (UNKNOWN: an exception
# escaped the servicer; DEADLINE_EXCEEDED: it hung).
ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


@pytest.fixture(scope="module")
def stub() -> Iterator[pb_grpc.TextGenerationStub]:
    with serving(small_core()) as running, grpc.insecure_channel(f"127.0.0.1:{running.server.port}") as channel:
        yield pb_grpc.TextGenerationStub(channel)


@seed(SEED)
@settings(FUZZ, max_examples=200 * SCALE)
@given(request=generate_requests(), streamed=st.booleans())
def test_a_server_answers_any_request_or_refuses_it_naming_the_field(
    stub: pb_grpc.TextGenerationStub, request: pb.GenerateRequest, streamed: bool
) -> None:
    try:
        if streamed:
            finish = list(stub.StreamGenerate(request, timeout=30))[-1].finish_reason
        else:
            finish = stub.Generate(request, timeout=30).finish_reason
        assert finish != pb.FINISH_REASON_ERROR, f"the engine failed the request\n{request}"
        kind = request.WhichOneof("input")  # Tokenize takes text or chat
        given = {kind: getattr(request, kind)} if kind in ("text", "chat") else {}
        stub.Tokenize(pb.TokenizeRequest(**given), timeout=30)
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""  # type: ignore[attr-defined]
        assert code in ANSWERS, f"{code.name}: {details}\n{request}"
        assert names_a_field(details), f"INVALID_ARGUMENT names no field: {details}\n{request}"


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_a_text_or_chat_prompt_over_the_context_is_refused_naming_its_field(
    stub: pb_grpc.TextGenerationStub, kind: str
) -> None:
    """Found by the fuzzer above: only input.token_ids was measured against the context before
    the engine, whose refusal ("prompt has N tokens") named no field."""
    words = "a b c d " * CONTEXT
    given = (
        {"text": words}
        if kind == "text"
        else {"chat": pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=words)])}
    )
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(**given), timeout=30)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert e.value.details().startswith(f"input.{kind}: "), e.value.details()  # type: ignore[attr-defined]


def test_a_repetition_penalty_too_small_for_float32_is_refused(stub: pb_grpc.TextGenerationStub) -> None:
    """Found by the fuzzer above: a penalty this small divided a logit to inf, the draw was -1 and
    the request failed (INTERNAL); the range is now a factor of 10 either way."""
    sampling = pb.SamplingOptions(max_new_tokens=4, repetition_penalty=1e-37)
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(text="hello", sampling=sampling), timeout=30)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert e.value.details().startswith("sampling: repetition_penalty must be"), e.value.details()  # type: ignore[attr-defined]


def test_a_namespaced_id_comes_back_as_the_one_the_client_chose() -> None:
    for rid in ("job-7", "a.b", "0.", "0", "x." + "f" * 12):
        engine = Submission([1], request_id=rid, namespace=id_namespace("acme")).engine_id
        assert engine is not None and engine != rid and client_id(engine) == rid
    assert client_id("req-3") == "req-3" and client_id("a.b") == "a.b" and client_id("0.") == "0."
