"""A benchmark sample: the record every dataset loader (`datasets`, `grounded`) returns, and the
same sample as token ids (`Encoded`, `encode`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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


@dataclass(slots=True)
class Encoded:
    prompt: list[int]
    output: list[int]
    prediction: list[int] = field(default_factory=list)  # a predicted output sent with the request, if any


def encode(samples: list[Sample], tokenizer: Any) -> list[Encoded]:
    """Each sample's prompt (chat samples rendered with the chat template) and reference as ids."""
    out = []
    for s in samples:
        if s.chat:
            text = tokenizer.apply_chat_template(s.messages(), tokenize=False, add_generation_prompt=True)
        else:
            text = s.prompt
        out.append(
            Encoded(
                tokenizer(text, add_special_tokens=False).input_ids,
                tokenizer(s.reference, add_special_tokens=False).input_ids,
            )
        )
    return out
