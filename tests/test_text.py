"""TextCodec: every input bounded before it is tokenized."""

from __future__ import annotations

import pytest

from batchserve.config import LimitsConfig
from batchserve.text import PROBE_CHARS_PER_TOKEN, TextCodec, TokenIds
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


def test_ids_a_codec_made_are_checked_once():
    """What `tokenize` and `render_chat` return is `TokenIds`: checked where it was made (off the
    loop, at the front end), measured again at admission but never checked id by id again."""
    codec = _codec()
    made = codec.tokenize("hi")
    assert isinstance(made, TokenIds) and made == [104, 105]
    assert codec.tokenize(TokenIds([300])) == [300]  # trusted: no per-id check
    with pytest.raises(ValueError, match="300 is not a token id"):
        codec.tokenize([300])  # a client's ids are checked
    with pytest.raises(ValueError, match="64 tokens"):
        codec.tokenize(TokenIds([1] * 64))  # the context still bounds them
    refs = codec.tokenize_references(["ab", [1, 2]])
    assert all(isinstance(r, TokenIds) for r in refs)


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


def test_tool_call_arguments_nested_too_deep_to_parse_are_kept_as_sent():
    """A client's own arguments string nested past the parser's stack: the text it sent, not a 500."""
    from batchserve.text import _checked_message

    deep = "[" * 100_000 + "]" * 100_000
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    out = _checked_message(0, {"role": "assistant", "content": None, "tool_calls": [call]})
    assert out["tool_calls"][0]["function"]["arguments"] == deep


def test_dense_text_is_refused_after_its_head_is_tokenized_not_the_whole_body(monkeypatch):
    """A text of about one token a character (CJK in a real vocabulary; here characters the tiny
    tokenizer takes one by one) past the context: only its first PROBE_CHARS_PER_TOKEN x context
    characters are tokenized before the refusal, which names the field."""
    codec = _codec()
    tokenized: list[int] = []
    real = codec.tokenizer.__class__.__call__

    def counting(self, text, *args, **kwargs):
        tokenized.append(len(text))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(codec.tokenizer.__class__, "__call__", counting)
    body = "\u4e00" * (30 * codec.max_model_len)  # within the character bound (32 a token), far past the context
    with pytest.raises(ValueError, match=r"^prompt: its first 256 characters alone are"):
        codec.tokenize(body)
    assert tokenized == [PROBE_CHARS_PER_TOKEN * codec.max_model_len]
    tokenized.clear()
    with pytest.raises(ValueError, match=r"^prompt: 6[0-9] tokens; the model's context is 64"):
        codec.tokenize("a" * 65)  # short enough to tokenize whole, one token too many: named too
    tokenized.clear()
    short = "hello " * 5
    assert len(codec.tokenize(short)) < 64 and tokenized == [len(short)]
