"""TextCodec: bounded input, incremental detokenizing with stop strings, state freed at the end."""

from __future__ import annotations

import pytest

from batchserve.config import LimitsConfig
from batchserve.text import TextCodec
from tests.conftest import make_tiny_tokenizer


def _codec(**limits: int) -> TextCodec:
    return TextCodec(make_tiny_tokenizer(), vocab_size=256, max_model_len=64, limits=LimitsConfig(**limits))


def test_input_is_bounded_before_it_is_tokenized():
    codec = _codec(max_prompt_chars_per_token=2)
    assert codec.tokenize("hi") == [104, 105] and codec.tokenize([1, 2]) == [1, 2]
    with pytest.raises(ValueError, match="cannot fit a context of 64"):
        codec.tokenize("x" * 129)  # 64 tokens x 2 characters
    for bad in ([256], [-1], [True], ["a"]):
        with pytest.raises(ValueError, match="not a token id"):
            codec.tokenize(bad)
    with pytest.raises(ValueError, match="empty"):
        codec.tokenize("")
    with pytest.raises(ValueError, match="no chat template"):
        codec.render_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="role"):
        codec.render_chat([{"role": "root", "content": "hi"}])


def test_stop_strings_are_bounded():
    codec = _codec(max_stop_sequences=2, max_stop_length=3)
    codec.check_stop(["ab", "abc"])
    with pytest.raises(ValueError, match="3 stop strings, at most 2"):
        codec.check_stop(["a", "b", "c"])
    with pytest.raises(ValueError, match=r"stop\[1\]: 4 characters"):
        codec.check_stop(["a", "abcd"])


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
