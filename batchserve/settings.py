"""Settings: config fields that are also `LLM(...)` keywords and CLI flags, and their registry entries."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def setting(
    default: Any,
    help: str,
    *,
    name: str | None = None,
    flags: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A config field that is also a setting: `LLM(name=...)` and `--name` (plus `flags`, older
    spellings kept working). `name` defaults to the field's own."""
    return field(default=default, metadata={"help": help, "name": name, "flags": flags, "choices": choices})


@dataclass(frozen=True, slots=True)
class Setting:
    """One keyword of `LLM(...)` / one CLI flag, and the config field it sets."""

    name: str
    section: str  # the EngineConfig field holding the dataclass ("" for a flat dataclass)
    field: str
    help: str
    kind: type  # bool, int, float or str: what the CLI parses
    default: Any
    flags: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def settings_of(cls: type, section: str = "") -> list[Setting]:
    """The settings a config dataclass declares (fields made with `setting`), in field order."""
    out = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        kind = next((k for k in (bool, int, float) if k.__name__ in str(f.type).split(" | ")), str)
        choices = f.metadata["choices"]
        out.append(
            Setting(
                f.metadata["name"] or f.name,
                section,
                f.name,
                f.metadata["help"],
                kind,
                f.default,
                f.metadata["flags"],
                choices,
            )
        )
    return out


def check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{what} must be one of {choices}, got {value!r}")
