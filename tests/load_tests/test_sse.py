"""The HTTP load-test user's judgement of a stream: error events and missing [DONE] fail it."""

from __future__ import annotations

import json

from load_tests.sse import read_events


def _lines(*events: object, done: bool = True) -> list[bytes]:
    out = []
    for e in events:
        out += [b"data: " + json.dumps(e).encode(), b""]
    return out + ([b"data: [DONE]", b""] if done else [])


CHUNK = {"choices": [{"text": "a"}]}


def test_a_whole_stream_with_done_succeeds_and_counts_its_chunks():
    firsts = []
    assert read_events(_lines(CHUNK, CHUNK, CHUNK), on_first=lambda: firsts.append(1)) == (3, None)
    assert firsts == [1]


def test_an_error_event_fails_the_stream_even_with_done():
    chunks, failed = read_events(_lines(CHUNK, {"error": {"message": "engine error: boom"}}))
    assert chunks == 1 and failed is not None and "boom" in failed


def test_a_stream_cut_before_done_fails():
    chunks, failed = read_events(_lines(CHUNK, CHUNK, done=False))
    assert chunks == 2 and failed is not None and "[DONE]" in failed
    assert read_events([b"data: {not json"])[1] is not None


def test_walking_away_on_purpose_owes_no_done():
    assert read_events(_lines(CHUNK, CHUNK, CHUNK, done=False), stop_after=1) == (2, None)
