"""Text in and out of the engine: tokenize, chat templates, incremental detokenize, stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchserve.config import LimitsConfig

Prompt = str | Sequence[int]
CHAT_ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


@dataclass(slots=True)
class _TextState:
    """Incremental detokenization of one request's output (multi-byte safe)."""

    stream: Any  # tokenizers.decoders.DecodeStream
    stop: tuple[str, ...]
    text: str = ""
    num_emitted_chars: int = 0  # text[:num_emitted_chars] has been handed out

    @property
    def holdback(self) -> int:
        # A stop string may still complete across the next step: hold back its possible prefix.
        return max((len(s) for s in self.stop), default=1) - 1


class TextCodec:
    """One tokenizer's text handling for the engine, with every input bounded before it is tokenized."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, limits: LimitsConfig) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.limits = limits
        self._states: dict[str, _TextState] = {}

    # ---- input -----------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt, or a checked copy of a token-id prompt."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            self.check_text_size(len(prompt), "prompt")
            return list(self.tokenizer(prompt, add_special_tokens=True).input_ids)
        # The length first: no per-id work (on whichever thread) for a prompt that cannot fit.
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; the model's context is {self.max_model_len}, "
                "which must also hold at least one new token"
            )
        ids = list(prompt)
        vocab = self.vocab_size
        if not all(type(t) is int and 0 <= t < vocab for t in ids):
            bad = next(t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab)
            raise ValueError(f"prompt_token_ids: {bad!r} is not a token id in [0, {vocab})")
        return ids

    def tokenize_references(self, references: Sequence[Prompt], field: str = "references") -> list[list[int]]:
        """Token ids of a request's references (texts, tokenized on their own without special
        tokens, or token ids), the empty ones dropped. Bounded like a prompt, on a bound of
        their own: at most `max_references`, their text within a prompt's characters before
        any is tokenized, and their tokens together at most the context."""
        limit = self.limits.max_references
        if len(references) > limit:
            raise ValueError(f"{field}: {len(references)} references, at most {limit}")
        self.check_text_size(sum(len(r) for r in references if isinstance(r, str)), field)
        out: list[list[int]] = []
        total = 0
        for i, ref in enumerate(references):
            if isinstance(ref, str):
                ids = list(self.tokenizer(ref, add_special_tokens=False).input_ids) if ref else []
            elif total + len(ref) <= self.max_model_len:  # the length first, as for a prompt
                ids = list(ref)
                if not all(type(t) is int and 0 <= t < self.vocab_size for t in ids):
                    raise ValueError(f"{field}[{i}]: token ids must be ints in [0, {self.vocab_size})")
            else:
                ids = ref  # type: ignore[assignment]  # too long: refused below, never copied
            total += len(ids)
            if total > self.max_model_len:
                raise ValueError(f"{field}: over {self.max_model_len} tokens in all, the model's context")
            if ids:
                out.append(ids)
        return out

    def check_text_size(self, num_chars: int, field: str) -> None:
        """Refuse text that cannot fit the context whatever it tokenizes to, before tokenizing it."""
        limit = self.max_model_len * self.limits.max_prompt_chars_per_token
        if num_chars > limit:
            raise ValueError(f"{field}: {num_chars} characters cannot fit a context of {self.max_model_len} tokens")

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of chat messages rendered with the model's chat template. Every bound is
        checked before the work it bounds: the message count and size before templating, the
        rendered text's size before tokenizing."""
        if not messages:
            raise ValueError("input.chat: no messages")
        limit = min(self.limits.max_chat_messages, self.max_model_len)
        if len(messages) > limit:
            raise ValueError(f"input.chat: {len(messages)} messages, at most {limit}")
        # A message costs its content plus the template's markup (counted as one character).
        self.check_text_size(sum(len(m.get("content") or "") + 1 for m in messages), "input.chat")
        rendered = []
        for i, m in enumerate(messages):
            role = ROLE_ALIASES.get(m.get("role", ""), m.get("role"))
            if role not in CHAT_ROLES:
                raise ValueError(
                    f"input.chat.messages[{i}].role must be system, developer, user or assistant, got {m.get('role')!r}"
                )
            rendered.append({**m, "role": role})
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("input.chat: the model has no chat template; send text or token_ids")
        try:
            text = self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template's own checks (jinja raise_exception, bad fields)
            raise ValueError(f"input.chat: the model's chat template refused the messages: {e}") from None
        self.check_text_size(len(text), "input.chat (rendered)")
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def check_stop(self, stop: Sequence[str], stop_token_ids: Sequence[int] = ()) -> None:
        """Bound the stop strings (each one is searched for after every token) and stop ids."""
        limits = self.limits
        if len(stop) > limits.max_stop_sequences:
            raise ValueError(f"stop: {len(stop)} stop strings, at most {limits.max_stop_sequences}")
        for i, s in enumerate(stop):
            if len(s) > limits.max_stop_length:
                raise ValueError(f"stop[{i}]: {len(s)} characters, at most {limits.max_stop_length}")
        if len(stop_token_ids) > limits.max_stop_token_ids:
            raise ValueError(f"stop_token_ids: {len(stop_token_ids)} ids, at most {limits.max_stop_token_ids}")

    # ---- output ----------------------------------------------------------------------------

    def start(self, request_id: str, stop: tuple[str, ...]) -> None:
        """Begin detokenizing a request's output."""
        from tokenizers.decoders import DecodeStream

        self._states[request_id] = _TextState(DecodeStream(skip_special_tokens=True), stop)

    def on_token(self, request_id: str, token_id: int) -> bool:
        """Detokenize one new token; True if a stop string now appears (text cut before it)."""
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

    def take(self, request_id: str, finished: bool) -> str:
        """The text not yet handed out. While running, the tail that a stop string could still
        claim is held back; once finished, everything is, and the request's state is dropped."""
        state = self._states.pop(request_id) if finished else self._states[request_id]
        end = len(state.text) if finished else max(state.num_emitted_chars, len(state.text) - state.holdback)
        new_text = state.text[state.num_emitted_chars : end]
        state.num_emitted_chars = end
        return new_text

    @property
    def num_active(self) -> int:
        """Requests being detokenized (for leak checks)."""
        return len(self._states)
