"""Reading an OpenAI server-sent-events stream the way a client must judge it: a stream that
carries an `{"error": ...}` event, or ends without `data: [DONE]`, failed (whatever its HTTP
status said when it began). Pure Python, so the rule is tested without locust or a server."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable


def read_events(
    lines: Iterable[bytes], stop_after: int | None = None, on_first: Callable[[], None] | None = None
) -> tuple[int, str | None]:
    """(content chunks read, why the stream failed or None). `stop_after`: walk away after that
    many chunks (a deliberate cancel: no [DONE] is owed); `on_first` runs at the first chunk."""
    chunks = 0
    for line in lines:
        if not line.startswith(b"data: "):
            continue  # blank separators, comments
        data = line[len(b"data: ") :]
        if data == b"[DONE]":
            return chunks, None
        try:
            event = json.loads(data)
        except ValueError:
            return chunks, f"not JSON after {chunks} chunks: {data[:80]!r}"
        if isinstance(event, dict) and "error" in event:
            return chunks, f"error event after {chunks} chunks: {str(event['error'])[:200]}"
        if chunks == 0 and on_first is not None:
            on_first()
        chunks += 1
        if stop_after is not None and chunks > stop_after:
            return chunks, None
    return chunks, f"stream ended without data: [DONE] after {chunks} chunks"
