"""API keys at the OpenAI API's door: the key check as ASGI middleware (`keys` has the rules)."""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from batchserve.server.keys import (
    TENANT_HEADER,
    ApiKeys,
    BadTenantHeader,
    KeyedCall,
    Revoked,
    Unauthenticated,
    request_tenant,
)
from batchserve.server.openai.errors import ApiError


def user_tenant(user: str | None) -> str | None:
    """OpenAI's `user` as a tenant key (tenant_source request or both): hashed, so that any
    string is a valid key and the key shows nothing of the user id."""
    return "u-" + hashlib.sha256(user.encode()).hexdigest()[:32] if user else None


def http_tenant(request: Request, user: str | None, keys: ApiKeys | None, source: str) -> str:
    """A call's tenant: its key's (`KeyCheck` found it) where keys are on, else the one tenant
    header or the hashed `user` (`keys.request_tenant`); a header sent twice is a 400."""
    if keys is not None:
        return str(request.state.tenant)
    try:
        return request_tenant(None, [], request.headers.getlist(TENANT_HEADER), user_tenant(user), source)
    except BadTenantHeader as e:
        raise ApiError(400, str(e)) from None


class KeyCheck:
    """ASGI middleware: every call presents an API key (`Authorization: Bearer KEY`) or gets a 401
    OpenAI error object before its body is read; the key's tenant is left in the request's state
    (`request.state.tenant`). Pure ASGI, as `BodyLimit`. The API, its OpenAPI schema and /docs are
    all behind it; only /health, answered before it (`HealthFirst`), is open. A reload that removes
    the key ends the call: a 401 if its answer has not started, else the answer stops short."""

    def __init__(self, app: Any, keys: ApiKeys, on_refuse: Any) -> None:
        self.app, self.keys, self.on_refuse = app, keys, on_refuse

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        values = [v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"]
        call = KeyedCall()
        with contextlib.ExitStack() as stack:
            try:
                tenant = stack.enter_context(self.keys.live(values, call.end))
            except Unauthenticated as e:
                self.on_refuse()
                await _unauthorized(str(e))(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
            started = False

            async def tracked(message: Any) -> None:
                nonlocal started
                started = started or message["type"] == "http.response.start"
                await send(message)

            try:
                await call.run(self.app(scope, receive, tracked))
            except Revoked as e:  # mid-answer, the response stops short: the connection closes
                if not started:
                    await _unauthorized(str(e))(scope, receive, send)


def _unauthorized(message: str) -> JSONResponse:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
    return JSONResponse({"error": error}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
