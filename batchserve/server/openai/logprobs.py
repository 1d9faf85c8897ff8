"""Output tokens' logprobs in the OpenAI API's two shapes: chat's `logprobs.content` (a token,
its logprob, its UTF-8 bytes and its top alternatives) and completions' parallel lists (tokens,
token_logprobs, top_logprobs as token -> logprob, the chosen token always among them,
text_offset; with `echo`, the prompt's tokens first). The values are the model's raw
distribution at the row that chose each token (`batchserve.runner.penalties`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchserve.request import TokenLogprob


class TokenText:
    """Each token id's own text (decoded alone, as vLLM reports it), cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion (or one chunk's share)."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        s = text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {
        "content": [one(e.token_id, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries],
        "refusal": None,
    }


def completion_logprobs(
    entries: Sequence[TokenLogprob], text: TokenText, offset: int = 0, first: int | None = None
) -> dict[str, Any]:
    """`choices[i].logprobs` of a completion (or one chunk's share), text offsets from `offset`
    (the characters of the completion before these tokens). `first`: an echoed prompt's first
    token, before the entries: nothing predicts it, so its logprob and alternatives are null."""
    lead = [] if first is None else [None]
    tokens = [text(t) for t in ([] if first is None else [first]) + [e.token_id for e in entries]]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": lead + [e.logprob for e in entries],
        "top_logprobs": lead + [_with_chosen(e, text) for e in entries],
        "text_offset": offsets,
    }


def _with_chosen(entry: TokenLogprob, text: TokenText) -> dict[str, float]:
    """A completion token's alternatives: the top `logprobs`, and the chosen token where it is not
    among them (up to `logprobs + 1` entries, as OpenAI and vLLM return them)."""
    top = {text(t): lp for t, lp in entry.top}
    if all(t != entry.token_id for t, _ in entry.top):
        top[text(entry.token_id)] = entry.logprob
    return top
