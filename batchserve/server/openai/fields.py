"""OpenAI's chat request fields that ask for nothing a self-hosted server does: accepted at the
values that ask for nothing (what OpenAI's own clients send by default, or an option that has no
meaning here), each refused otherwise with why. The whole field table, supported fields too, is
in docs/http-api.md (a test walks it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel


def _text(limit: int) -> Callable[[Any], bool]:
    return lambda v: v is None or (isinstance(v, str) and len(v) <= limit)


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or v in values


def _metadata(v: Any) -> bool:
    """OpenAI's bounds: 16 pairs of strings, keys of at most 64 characters, values of 512."""
    if v is None:
        return True
    pairs = v.items() if isinstance(v, dict) else ()
    ok = all(isinstance(k, str) and isinstance(x, str) and len(k) <= 64 and len(x) <= 512 for k, x in pairs)
    return isinstance(v, dict) and len(v) <= 16 and ok


def _small_dict(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and len(v) <= 16)


@dataclass(frozen=True, slots=True)
class Neutral:
    """A field accepted where `accepts(value)` and ignored (`ignored`: why nothing here depends on
    it); any other value is a 400 saying `refused`."""

    accepts: Callable[[Any], bool]
    ignored: str
    refused: str


NEUTRAL: dict[str, Neutral] = {
    "store": Neutral(
        lambda v: v is None or isinstance(v, bool),
        "nothing is stored here: an answer is kept only until it is sent",
        "store is true or false",
    ),
    "metadata": Neutral(_metadata, "tags of OpenAI's stored completions; nothing is stored here",
                        "at most 16 pairs of strings, keys up to 64 characters, values up to 512"),
    "service_tier": Neutral(_one_of("auto", "default"), "there is one processing tier here",
                            "one processing tier here: 'auto' or 'default'"),
    "prompt_cache_key": Neutral(
        _text(1024),
        "the prefix cache is automatic, shared within a tenant's scope (x-batchserve-tenant), not keyed by clients",
        "a string of at most 1024 characters",
    ),
    "prompt_cache_retention": Neutral(_one_of("in_memory", "24h"), "cached prefixes stay while the KV pool has room",
                                      "'in_memory' or '24h'"),
    "prompt_cache_options": Neutral(_small_dict, "cached prefixes stay while the KV pool has room",
                                    "an object of at most 16 options"),
    "safety_identifier": Neutral(_text(64), "an end-user id for OpenAI's abuse detection; none runs here",
                                 "a string of at most 64 characters"),
    "modalities": Neutral(lambda v: v is None or v == ["text"], "text is the output", "text is the only output here"),
    "audio": Neutral(lambda v: v is None, "-", "no audio output here"),
    "verbosity": Neutral(_one_of("medium"), "'medium' is the default: the model answers as it does",
                         "the model's verbosity cannot be steered here (ask for it in the prompt)"),
    "reasoning_effort": Neutral(_one_of("none"), "'none': no reasoning is asked for",
                                "no reasoning effort to set here"),
    "web_search_options": Neutral(lambda v: v is None, "-", "no web search here"),
    "moderation": Neutral(lambda v: v is None, "-", "no moderation runs here"),
    "functions": Neutral(lambda v: v is None or v == [], "none offered",
                         "the deprecated functions: send them as tools"),
    "function_call": Neutral(lambda v: v is None, "-", "deprecated: use tool_choice"),
}  # fmt: skip


class NeutralFields(BaseModel):
    """The NEUTRAL fields both the chat and the Responses API take (any JSON: `refusal` checks the
    value)."""

    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    safety_identifier: Any = None
    moderation: Any = None

    def refusal(self) -> tuple[str, str] | None:
        """(field, message) of the first field set to a value that asks for something; None if none."""
        for name, rule in NEUTRAL.items():
            if name not in type(self).model_fields:
                continue
            if not rule.accepts(getattr(self, name)):
                return name, f"{name}: {rule.refused}"
        return None


class ChatOnlyFields(NeutralFields):
    """Every NEUTRAL field, as the chat endpoint takes them."""

    modalities: Any = None
    audio: Any = None
    verbosity: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
