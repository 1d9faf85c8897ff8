"""A benchmark sample: the record every dataset loader (`datasets`, `grounded`) returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sample:
    id: str
    prompt: str  # plain text; chat samples are rendered with the chat template by the caller
    reference: str  # a known good output (canonical solution / first reply)
    chat: bool  # True: `prompt` is a user turn to wrap in the chat template
    history: tuple[tuple[str, str], ...] = ()  # chat: (role, content) messages before the user turn
    prediction: str = ""  # the text a client expects back (OpenAI's predicted outputs), if any
    constraint: str = ""  # a JSON Schema (as JSON text) the output must match (structured output), if any

    def messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.history] + [{"role": "user", "content": self.prompt}]
