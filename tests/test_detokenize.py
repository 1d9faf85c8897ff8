"""Detokenizer: incremental detokenizing with stop strings, text held back while a stop string may
complete, resumed tokens decoded at once, state freed at the end."""

from __future__ import annotations

import pytest

from batchserve.detokenize import Detokenizer
from tests.conftest import make_tiny_tokenizer


def _codec() -> Detokenizer:
    return Detokenizer(make_tiny_tokenizer())


def test_text_is_held_back_while_a_stop_string_may_complete_then_cut():
    codec = _codec()
    codec.start("r", ("END",))
    taken = []
    for ch in "okEN":
        assert not codec.on_token("r", ord(ch))
        taken.append(codec.take("r", finished=False))
    assert "".join(taken) == "ok"  # "EN" may still become "END": held back
    assert codec.on_token("r", ord("D"))  # the stop string: text cut before it
    assert codec.take("r", finished=True) == "" and codec.num_active == 0


def test_a_finished_request_gets_its_held_back_text_and_its_state_is_dropped():
    codec = _codec()
    codec.start("r", ("END",))
    for ch in "hi E":
        codec.on_token("r", ord(ch))
    assert codec.take("r", finished=False) == "hi" and codec.num_active == 1
    assert codec.take("r", finished=True) == " E" and codec.num_active == 0


def test_the_earliest_stop_string_wins_when_several_complete_on_one_token():
    codec = _codec()
    codec.start("r", (".i", "T.i"))  # both complete on the last "i"; "T.i" starts first
    hits = [codec.on_token("r", ord(ch)) for ch in "abT.i"]
    assert hits == [False] * 4 + [True]
    assert codec.take("r", finished=True) == "ab"


def _piecewise(codec: Detokenizer, rid: str, ids: list[int]) -> int | None:
    """`Detokenizer.resume`'s answer the slow way: one token at a time."""
    for i, t in enumerate(ids):
        if codec.on_token(rid, t):
            return i
    return None


RESUMED = [("héllo wörld, hi", ()), ("abc déf END ghi", ("END", "f E")), ("xyz", ("y",))]


@pytest.mark.parametrize(("text", "stop"), RESUMED)
def test_resumed_tokens_decode_at_once_as_one_at_a_time(text: str, stop: tuple[str, ...]):
    ids = list(text.encode())  # multi-byte characters: tokens that end no character
    fast, slow = _codec(), _codec()
    fast.start("r", stop)
    slow.start("r", stop)
    stopped_at = fast.resume("r", ids)
    assert stopped_at == _piecewise(slow, "r", ids)
    if stopped_at is None:  # else the request is refused: its text is dropped unread
        assert fast.take("r", finished=False) == slow.take("r", finished=False)
    fast.take("r", finished=True)
    slow.take("r", finished=True)
    assert fast.num_active == slow.num_active == 0


def test_text_handed_out_is_dropped_so_appending_stays_cheap():
    # Appending a token's text copies what is held: it must be the held-back tail, never the
    # whole output (that made a long output, or a long resume, quadratic).
    codec = _codec()
    codec.start("r", ("STOP!",))
    out = []
    for i in range(2000):
        codec.on_token("r", 97 + i % 26)
        out.append(codec.take("r", finished=False))
        assert len(codec._states["r"].text) <= 4  # the longest stop string less one
    out.append(codec.take("r", finished=True))
    assert "".join(out) == "".join(chr(97 + i % 26) for i in range(2000))
