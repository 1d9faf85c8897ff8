"""JSON Lines files, read line by line, every error naming its line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def json_lines(path: str | Path, error: type[ValueError] = ValueError) -> Iterator[tuple[int, Any]]:
    """(line number, value) for each non-blank line of `path`; `error` naming the line for one
    that is not JSON."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}: line {n}: not JSON ({e.msg})") from None
            yield n, value
