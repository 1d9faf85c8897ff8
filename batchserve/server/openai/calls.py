"""A call's life at the HTTP door: its body's strings checked as UTF-8 before any field is read,
and its work cancelled the moment its client leaves."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request

from batchserve.server.openai.errors import ApiError

T = TypeVar("T")
# A JSON escape of a UTF-16 surrogate: valid JSON, but a lone one is no Unicode character.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def check_utf8(request: Request) -> None:
    """A 400 naming the first field whose string holds a lone surrogate (JSON lets `\\ud800`
    through; no tokenizer takes it). Bodies without a surrogate escape cost one scan."""
    body = await request.body()  # cached: the route reads the same bytes
    if not body or not _SURROGATE_ESCAPE.search(body):
        return
    try:
        data = json.loads(body)
    except ValueError:
        return  # not JSON: the route's own parsing refuses it
    path = _first_bad(data, "")
    if path is not None:
        raise ApiError(400, f"{path or 'body'}: not valid UTF-8 (a lone surrogate)", path or None)


def _first_bad(value: Any, path: str) -> str | None:
    """The path (`messages[0].content`) of the first string that cannot be UTF-8, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        name = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))
        if isinstance(key, str) and _first_bad(key, "") is not None:
            return name
        found = _first_bad(item, name)
        if found is not None:
            return found
    return None


async def disconnected(request: Request) -> None:
    """Returns when the client goes away. The body has been read by then, so the next ASGI
    message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """(True, result of `work`), or (False, None) as soon as the client disconnects; `work` is
    then cancelled, which aborts its request (waiting, prefilling or decoding) at once."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    return False, None
