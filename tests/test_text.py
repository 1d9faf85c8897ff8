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


def test_a_token_prompt_is_measured_before_any_id_is_checked():
    codec = _codec()
    # 64 ids, every one invalid: the length is what the error names (no per-id work was done).
    with pytest.raises(ValueError, match="64 tokens; the model's context is 64"):
        codec.tokenize(["not an id"] * 64)
    assert codec.tokenize([7] * 63) == [7] * 63


def test_chat_is_bounded_by_message_count_and_rendered_size_before_tokenizing(monkeypatch):
    codec = _codec(max_chat_messages=4, max_prompt_chars_per_token=1)
    codec.tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    tokenized: list[str] = []
    real = codec.tokenizer.__class__.__call__

    def spy(self, text, **kwargs):
        tokenized.append(text)
        return real(self, text, **kwargs)

    monkeypatch.setattr(codec.tokenizer.__class__, "__call__", spy)
    with pytest.raises(ValueError, match="5 messages, at most 4"):
        codec.render_chat([{"role": "user", "content": ""}] * 5)
    # 4 x "<assistant>abcdef\n" = 72 characters: within 64 x 1 by content (28), over it once
    # rendered. Refused before the rendered text is tokenized.
    with pytest.raises(ValueError, match=r"input.chat \(rendered\): 72 characters"):
        codec.render_chat([{"role": "assistant", "content": "abcdef"}] * 4)
    assert tokenized == []
    # OpenAI's developer role is the system role.
    ids = codec.render_chat([{"role": "developer", "content": "be brief"}])
    assert bytes(ids).decode() == "<system>be brief\n"


def test_stop_token_ids_are_counted():
    codec = _codec(max_stop_token_ids=3)
    codec.check_stop([], [1, 2, 3])
    with pytest.raises(ValueError, match="stop_token_ids: 4 ids, at most 3"):
        codec.check_stop([], [1, 2, 3, 4])


def _piecewise(codec: TextCodec, rid: str, ids: list[int]) -> int | None:
    """`TextCodec.resume`'s answer the slow way: one token at a time."""
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


def test_tool_call_arguments_nested_too_deep_to_parse_are_kept_as_sent():
    """A client's own arguments string nested past the parser's stack: the text it sent, not a 500."""
    from batchserve.text import _checked_message

    deep = "[" * 100_000 + "]" * 100_000
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    out = _checked_message(0, {"role": "assistant", "content": None, "tool_calls": [call]})
    assert out["tool_calls"][0]["function"]["arguments"] == deep
