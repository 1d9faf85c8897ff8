"""A call's life at the HTTP door: its body's strings checked as UTF-8 before any field is read,
its work cancelled the moment its client leaves, and every error an OpenAI error object."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchserve.server.openai.errors import ApiError, error_response

logger = logging.getLogger("batchserve")

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
        path = _first_bad(data, "")
    except ValueError:
        return  # not JSON: the route's own parsing refuses it
    except RecursionError:
        raise ApiError(400, "the body nests its JSON too deep") from None
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


def install_error_handlers(app: FastAPI, on_invalid: Callable[[], None]) -> None:
    """Every error as an OpenAI error object: ours (`ApiError`), routing's (404, 405), a body that
    fails its schema (a 400 naming the field; `on_invalid` counts it), and whatever escaped them."""

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        # Whatever escaped every other handler: an OpenAI error object, never a bare 500 page.
        logger.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(500, f"internal error ({type(e).__name__}); the server goes on")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # Routing's own errors (404 unknown path, 405 wrong method) as OpenAI error objects.
        response = error_response(e.status_code, str(e.detail))
        response.headers.update(e.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {err.get('msg', 'invalid')}" if param else str(err.get("msg", "invalid body"))
        on_invalid()
        return error_response(400, message, param)
