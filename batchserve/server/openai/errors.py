"""The OpenAI API's errors: an exception answered as OpenAI's error object, and the object itself."""

from __future__ import annotations

import re
from collections.abc import Container

from fastapi import HTTPException
from fastapi.responses import JSONResponse


class ApiError(HTTPException):
    """An error answered as an OpenAI error object (an HTTPException, so that FastAPI passes it
    through body parsing unchanged)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(status, message)
        self.status, self.message, self.param = status, message, param


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An OpenAI error object."""
    kind = ERROR_TYPES.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


# The engine's names of the few request fields the OpenAI API calls something else.
_API_NAMES = {
    "max_new_tokens": "max_tokens",
    "prompt_token_ids": "prompt",
    "prompt_logprobs": "logprobs",
    "constraint": "response_format",
    "references": "prediction",
    "decoding_length": "lookahead",
    "draft_layout": "lookahead",
    "jacobi": "lookahead",
}


def param_of(message: str, fields: Container[str]) -> str | None:
    """The body field a refusal's message names first (`top_p must be ...`, `prompt: ...`), if
    it is one of `fields`: the error object's `param`."""
    word = re.match(r"[A-Za-z_][A-Za-z0-9_]*", message)
    if word is None:
        return None
    name = _API_NAMES.get(word.group(), word.group())
    return name if name in fields else None
