"""The OpenAI API's door, as ASGI middleware outside the key check and the app: `/health` answered
ahead of everything, and the call limit (calls, not connections: `server.guard` holds those)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from batchserve.server.openai.errors import error_response


class HealthFirst:
    """ASGI middleware, outermost: `GET /health` answered from `healthy()` before any other
    middleware, no body read, no key asked and no call counted; 503 once the server stops serving."""

    def __init__(self, app: Any, healthy: Any) -> None:
        self.app, self.healthy = app, healthy

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/health":
            await self.app(scope, receive, send)
            return
        if scope["method"] not in ("GET", "HEAD"):
            response = error_response(405, "/health takes GET")
        elif not self.healthy():
            response = error_response(503, "server is shutting down")
        else:
            response = JSONResponse({"status": "ok"})
        await response(scope, receive, send)


class CallLimit:
    """ASGI middleware: a 503 for a call beyond `limit` at once. It runs after the key check, so
    only keyed calls (or every call, without keys) take a place."""

    def __init__(self, app: Any, limit: int, on_refuse: Any) -> None:
        self.app, self.limit, self.on_refuse, self.active = app, limit, on_refuse, 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            self.on_refuse()
            await error_response(503, f"server busy: {self.limit} calls at once")(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
