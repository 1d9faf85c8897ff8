"""Stop strings over gRPC streaming: the holdback never sends text a stop string later claims.

The tiny model is random, so each case rests on a prompt whose greedy output is known (checked
first, from the server's own greedy run without stop strings): its first bytes are valid UTF-8,
and with the byte-level tokenizer every byte is one token, so each non-ASCII character spans
several tokens (and, with drafting off, several steps).
"""

from __future__ import annotations

import grpc
import pytest

from batchserve.server.client import build_request
from batchserve.v1 import generation_pb2 as pb

# Prompt token ids -> the start of their greedy output (valid UTF-8; what follows is not).
ASCII_PROMPT, ASCII_OUTPUT = [27, 191, 96], "s>k%-{jFT.i(\x17˙"  # 15 bytes
MIXED_PROMPT, MIXED_OUTPUT = [27, 189, 142], "r\x99t˔߽"  # r, U+0099, t, U+02D4, U+07FD: 8 bytes
WIDE_PROMPT, WIDE_OUTPUT = [6, 58, 5], "&~ڵ)bωQ&"  # 10 bytes
MAX_NEW_TOKENS = 24  # past the valid prefix: a stop string that is missed shows as LENGTH


async def _greedy_ids(stub, prompt: list[int], known: str) -> list[int]:
    """The server's greedy token ids without stop strings; their start must be `known`."""
    reply = await stub.Generate(build_request(prompt, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True))
    raw = known.encode()
    assert bytes(reply.token_ids[: len(raw)]) == raw, f"the tiny model's greedy output changed: {reply.text!r}"
    assert reply.text.startswith(known)
    return list(reply.token_ids)


async def _unary_and_stream(stub, req: pb.GenerateRequest):
    unary = await stub.Generate(req)
    call = stub.StreamGenerate(req)
    chunks = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        chunks.append(chunk)
    assert await call.code() == grpc.StatusCode.OK
    return unary, chunks


@pytest.mark.parametrize("lookahead", [False, None], ids=["one-token-steps", "drafted-steps"])
@pytest.mark.parametrize(
    ("prompt", "known", "stop", "expected"),
    [
        # One ASCII stop string of 4 tokens: held back while it may still complete.
        pytest.param(ASCII_PROMPT, ASCII_OUTPUT, ["T.i("], "s>k%-{jF", id="ascii"),
        # Several: the earliest occurrence wins, whatever the order of the list (the first one
        # listed is shorter and occurs later, so the holdback must come from the longest one).
        pytest.param(ASCII_PROMPT, ASCII_OUTPUT, ["i(", "{jF", "~~~~~~"], "s>k%-", id="several"),
        # Multi-byte characters: the stop string is 2 characters, 4 tokens (so 4 one-token steps).
        pytest.param(MIXED_PROMPT, MIXED_OUTPUT, ["˔߽"], "r\x99t", id="multibyte"),
        pytest.param(MIXED_PROMPT, MIXED_OUTPUT, ["߽", "t˔"], "r\x99", id="multibyte-several"),
        pytest.param(WIDE_PROMPT, WIDE_OUTPUT, ["bωQ"], "&~ڵ)", id="multibyte-mixed"),
    ],
)
async def test_streamed_text_stops_right_before_the_first_stop_string(
    running, prompt, known, stop, expected, lookahead
):
    stub = running.stub
    greedy = await _greedy_ids(stub, prompt, known)
    # Independently of the server's detokenizer: the greedy text cut before the earliest stop.
    first = min((s for s in stop if s in known), key=known.index)
    assert known[: known.index(first)] == expected
    assert all(s not in expected for s in stop) and "\ufffd" not in known
    num_tokens = len((expected + first).encode())  # through the token that completes the stop
    assert num_tokens < MAX_NEW_TOKENS

    req = build_request(prompt, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, stop=stop, lookahead=lookahead)
    unary, chunks = await _unary_and_stream(stub, req)

    for reply in (unary, chunks[-1]):
        assert reply.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
        assert reply.usage.completion_tokens == num_tokens
    assert list(unary.token_ids) == greedy[:num_tokens]
    assert [t for c in chunks for t in c.token_ids] == greedy[:num_tokens]
    assert unary.text == expected
    # Chunks are never taken back: any part of the stop string sent early would be in here.
    assert "".join(c.text for c in chunks) == expected
    assert not any("\ufffd" in c.text for c in chunks)  # no character was cut between chunks
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    if lookahead is False:  # one token a step: the text really was streamed, not sent at the end
        assert len(chunks) == num_tokens
        assert sum(bool(c.text) for c in chunks) >= 2
    else:  # the trie has the greedy output: steps accept drafts, a stop may complete mid-step
        assert len(chunks) < num_tokens, [list(c.token_ids) for c in chunks]


@pytest.mark.parametrize("lookahead", [False, None], ids=["one-token-steps", "drafted-steps"])
async def test_text_held_back_for_a_stop_string_that_never_completes_is_sent(running, lookahead):
    # "{j" and "˙" begin stop strings that never complete: their text is held back, then sent.
    stub = running.stub
    greedy = await _greedy_ids(stub, ASCII_PROMPT, ASCII_OUTPUT)
    num_tokens = len(ASCII_OUTPUT.encode())
    req = build_request(
        ASCII_PROMPT,
        max_new_tokens=num_tokens,
        ignore_eos=True,
        stop=["{jX", "˙˙", "s>k%-{jFT.i(\x17!"],
        lookahead=lookahead,
    )
    unary, chunks = await _unary_and_stream(stub, req)
    for reply in (unary, chunks[-1]):
        assert reply.finish_reason == pb.FINISH_REASON_LENGTH
        assert reply.usage.completion_tokens == num_tokens
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids) == greedy[:num_tokens]
    assert unary.text == "".join(c.text for c in chunks) == ASCII_OUTPUT
    assert not any("\ufffd" in c.text for c in chunks)
