"""The output's text: each request's tokens detokenized incrementally (multi-byte safe), its stop
strings found as they complete, and its text handed out with the tail a stop string could still
claim held back. One `Detokenizer` per engine: the engine begins a request's text as it queues it
(`begin`), the step's outputs (`pipeline.py`) decode its tokens and take its text, and the
scheduler's commit asks the stop hook there (`pipeline.stop_hook`) whether a token completed a
stop string."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchserve.request import Request


@dataclass(slots=True)
class _TextState:
    """Incremental detokenization of one request's output (multi-byte safe)."""

    stream: Any  # tokenizers.decoders.DecodeStream
    stop: tuple[str, ...]
    # The text decoded and not yet handed out. What was handed out is dropped, so appending a
    # token's piece copies only this tail, never the whole output (that was quadratic).
    text: str = ""

    @property
    def holdback(self) -> int:
        # A stop string may still complete across the next step: hold back its possible prefix.
        return max((len(s) for s in self.stop), default=1) - 1


class Detokenizer:
    """Every running request's output text, by request id, over one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _TextState] = {}

    def begin(self, req: Request) -> None:
        """Begin detokenizing `req`'s output; for a resumed one, decode its tokens at once (linear
        in their text), marking what the interrupted stream had handed out by then as sent (the
        held-back tail a stop string could still claim was not). ValueError, with nothing kept,
        for a stop string among the resumed tokens."""
        self.start(req.request_id, req.params.stop, req.params.skip_special_tokens)
        if not req.params.resume_token_ids:
            return
        stopped_at = self.resume(req.request_id, req.params.resume_token_ids)
        if stopped_at is not None:
            self.take(req.request_id, True)  # drops its text state
            raise ValueError(f"resume_token_ids[{stopped_at}]: a stop string ends the generation there")
        self.take(req.request_id, False)

    def start(self, request_id: str, stop: tuple[str, ...], skip_special: bool = True) -> None:
        """Begin detokenizing a request's output (`skip_special`: without special tokens' text)."""
        from tokenizers.decoders import DecodeStream

        self._states[request_id] = _TextState(DecodeStream(skip_special_tokens=skip_special), stop)

    def on_token(self, request_id: str, token_id: int) -> bool:
        """Detokenize one new token; True if a stop string now appears (text cut before it). The
        held-back tail is at least a stop string's length less one, so a stop string that this
        piece completes lies within the text not yet handed out."""
        state = self._states[request_id]
        piece = state.stream.step(self.tokenizer.backend_tokenizer, token_id)
        if not piece:
            return False
        start = len(state.text)
        state.text += piece
        # The earliest occurrence wins, whichever stop string it is (several may complete at once).
        found = [i for s in state.stop if (i := state.text.find(s, max(0, start - len(s) + 1))) >= 0]
        if found:
            state.text = state.text[: min(found)]
            return True
        return False

    def resume(self, request_id: str, token_ids: Sequence[int]) -> int | None:
        """Detokenize a resumed request's tokens, just started, at once: their pieces joined once
        (linear in the text, where a token at a time re-copies it per token). The index of the
        token a stop string completes at (the request must not resume), else None."""
        state = self._states[request_id]
        backend, step = self.tokenizer.backend_tokenizer, state.stream.step
        pieces: list[str] = []
        ends: list[int] = []  # ends[k]: the text's length after token k
        length = 0
        for token_id in token_ids:
            piece = step(backend, token_id)
            if piece:
                pieces.append(piece)
                length += len(piece)
            ends.append(length)
        text = "".join(pieces)
        # The first token at which any stop string is complete: the one its earliest end falls in.
        done = [i + len(s) for s in state.stop if (i := text.find(s)) >= 0]
        if done:
            return bisect.bisect_left(ends, min(done))
        state.text += text
        return None

    def take(self, request_id: str, finished: bool) -> str:
        """The text not yet handed out. While running, the tail that a stop string could still
        claim is held back; once finished, everything is, and the request's state is dropped."""
        state = self._states.pop(request_id) if finished else self._states[request_id]
        end = len(state.text) if finished else max(0, len(state.text) - state.holdback)
        new_text, state.text = state.text[:end], state.text[end:]
        return new_text

    def is_active(self, request_id: str) -> bool:
        """Whether the request's output is being detokenized (started, not yet finished)."""
        return request_id in self._states

    @property
    def num_active(self) -> int:
        """Requests being detokenized (for leak checks)."""
        return len(self._states)
