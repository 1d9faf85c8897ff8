"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions, /v1/models,
/health, over the same `Frontend` (admission, limits, shutdown) as gRPC.

FastAPI because it is what vLLM and SGLang serve the same API with: pydantic validates the
bodies and the OpenAPI schema comes for free (/openapi.json, /docs)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchserve.request import FinishReason, RequestOutput, TokenLogprob
from batchserve.server.frontend import EngineFailed, Frontend, Refusal, Refused, choose_tenant
from batchserve.server.http import BodyLimit
from batchserve.server.openai_logprobs import TokenText, chat_logprobs, completion_logprobs
from batchserve.server.openai_models import ApiError, ChatRequest, CommonFields, CompletionRequest, error_response

T = TypeVar("T")
TENANT_HEADER = "x-batchserve-tenant"
STATUS = {Refusal.INVALID: 400, Refusal.QUEUE_FULL: 429, Refusal.DRAINING: 503, Refusal.ENGINE_DEAD: 503}
FINISH = {
    FinishReason.LENGTH: "length",
    FinishReason.EOS: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.CANCELLED: "abort",
    FinishReason.ERROR: "error",
}


# ---- responses -----------------------------------------------------------------------------


def _usage(out: RequestOutput) -> dict[str, Any]:
    s = out.stats
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_prompt_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": s.accepted_prediction_tokens,
            "rejected_prediction_tokens": s.rejected_prediction_tokens,
        },
        "speculation": {  # batchserve's extension
            "steps": s.steps,
            "draft_tokens_proposed": s.draft_tokens_proposed,
            "draft_tokens_accepted": s.draft_tokens_accepted,
            "tokens_per_step": out.tokens_per_step,
        },
    }


def user_tenant(user: str | None) -> str | None:
    """OpenAI's `user` as a tenant key (tenant_source request or both): hashed, so that any
    string is a valid key and the key shows nothing of the user id."""
    return "u-" + hashlib.sha256(user.encode()).hexdigest()[:32] if user else None


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away. The body has been read by then, so the next ASGI
    message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """(True, result of `work`), or (False, None) as soon as the client disconnects; `work` is
    then cancelled, which aborts its request (waiting, prefilling or decoding) at once."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
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


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class OpenAIServer:
    """Builds the FastAPI app over a `Frontend`; `max_body_bytes` bounds a request body."""

    def __init__(self, frontend: Frontend, model_name: str, max_body_bytes: int, tenant_source: str = "header") -> None:
        """`tenant_source`: where a request's tenant key comes from (ServerConfig.tenant_source)."""
        self.frontend = frontend
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.tenant_source = tenant_source
        self.created = int(time.time())
        self.token_text = TokenText(frontend.engine.core.tokenizer)
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI(title="batchserve", summary="OpenAI-compatible API of the batchserve engine")

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
            self.frontend.metrics.rejected.labels(Refusal.INVALID.value).inc()
            return error_response(400, message, param)

        app.add_middleware(BodyLimit, limit=self.max_body_bytes, on_refuse=self._count_too_large)

        @app.get("/health")
        async def health() -> JSONResponse:
            # 503 from the moment gRPC health says NOT_SERVING (shutdown or a dead engine).
            if not self.frontend.healthy:
                return error_response(503, "server is shutting down")
            return JSONResponse({"status": "ok"})

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str) -> dict[str, Any]:
            self._check_model(model_id)
            return self._model_card()

        @app.post("/v1/completions", response_model=None)
        async def completions(body: CompletionRequest, request: Request) -> Any:
            body.unsupported()
            self._check_model(body.model)
            prompt = body.the_prompt()
            return await self._respond(body, request, lambda text: text.tokenize(prompt), body.max_tokens, chat=False)

        @app.post("/v1/chat/completions", response_model=None)
        async def chat(body: ChatRequest, request: Request) -> Any:
            body.unsupported()
            self._check_model(body.model)
            messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(body.messages)]
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            return await self._respond(body, request, lambda text: text.render_chat(messages), max_tokens, chat=True)

        return app

    def _count_too_large(self) -> None:
        self.frontend.metrics.rejected.labels(Refusal.QUEUE_FULL.value).inc()  # gRPC says RESOURCE_EXHAUSTED

    def _model_card(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "batchserve"}
        # An extension: whether the start-up check found a request's logits the same in any batch.
        return card | {"batch_invariant": self.frontend.engine.core.batch_invariant}

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            served = self.model_name
            raise ApiError(404, f"model {model!r} is not served here; GET /v1/models lists {served!r}", "model")

    async def _respond(
        self, body: CommonFields, request: Request, prepare: Any, max_tokens: int | None, chat: bool
    ) -> Any:
        """Run one request: a JSON body, or (`stream`) server-sent events. A client that leaves
        before the answer (waiting, during its prefill, or decoding) aborts its request at once."""
        header = request.headers.get(TENANT_HEADER)
        tenant = choose_tenant(self.tenant_source, header, user_tenant(body.user))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        core = self.frontend.engine.core
        outputs = self.frontend.generate(
            prepare,
            lambda: body.sampling_params(max_tokens, core.max_model_len, core.config.limits),
            rid,
            tenant,
            fit_context=max_tokens is not None,
            references=lambda text: text.tokenize_references(body.predicted(), "prediction"),
        )
        here, first, whole = False, None, None
        try:
            if body.stream:
                # Refusals surface with the first output, before any byte is sent.
                here, first = await _unless_gone(request, anext(outputs))
            else:
                here, whole = await _unless_gone(request, self._collect(outputs))
        except Refused as e:
            raise ApiError(STATUS[e.kind], e.message) from None
        except EngineFailed as e:
            raise ApiError(500, str(e)) from None
        except StopAsyncIteration:  # pragma: no cover - the engine always sends a final output
            raise ApiError(500, "no output") from None
        finally:
            if not body.stream or not here:
                await outputs.aclose()
        if not here:
            return None  # nobody to answer; the request was aborted and its KV freed
        if body.stream and first is not None:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                self._stream(rid, first, outputs, chat, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        assert whole is not None
        return self._whole(rid, *whole, chat)

    @staticmethod
    async def _collect(outputs: AsyncIterator[RequestOutput]) -> tuple[str, RequestOutput, list[TokenLogprob] | None]:
        """The whole text, the last output and (where asked) the logprobs of a request."""
        text: list[str] = []
        last: RequestOutput | None = None
        logprobs: list[TokenLogprob] | None = None
        async for out in outputs:
            text.append(out.new_text)
            if out.new_logprobs is not None:
                logprobs = (logprobs or []) + out.new_logprobs
            last = out
        assert last is not None
        return "".join(text), last, logprobs

    def _logprobs(self, entries: list[TokenLogprob] | None, chat: bool, offset: int = 0) -> dict[str, Any] | None:
        if entries is None:
            return None
        text = self.token_text
        return chat_logprobs(entries, text) if chat else completion_logprobs(entries, text, offset)

    def _whole(
        self, rid: str, text: str, last: RequestOutput, logprobs: list[TokenLogprob] | None, chat: bool
    ) -> dict[str, Any]:
        finish = FINISH[last.finish_reason] if last.finish_reason else None
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": self._logprobs(logprobs, chat)}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": _usage(last),
        }

    async def _stream(
        self, rid: str, first: RequestOutput, outputs: AsyncIterator[RequestOutput], chat: bool, include_usage: bool
    ) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's chunk format, then `data: [DONE]`. A client that
        disconnects cancels this generator, and closing `outputs` aborts the request."""
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, role: bool = False, logprobs: Any = None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
            if chat:
                choice["delta"] = {"role": "assistant", "content": delta or ""} if role else {"content": delta or ""}
                if finish is not None and not delta:
                    choice["delta"] = {}
            else:
                choice["text"] = delta or ""
            data = {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [choice]}
            if include_usage:
                data["usage"] = None
            return data

        last = first
        try:
            if chat:
                yield _sse(chunk("", None, role=True))
            out: RequestOutput | None = first
            offset = 0  # the tokens' text so far (completions' text_offset, as a whole completion counts it)
            while out is not None:
                last = out
                finish = FINISH[out.finish_reason] if out.finished and out.finish_reason else None
                logprobs = self._logprobs(out.new_logprobs, chat, offset) if out.new_logprobs else None
                if out.new_text or finish is not None or logprobs is not None:
                    yield _sse(chunk(out.new_text, finish, logprobs=logprobs))
                offset += sum(len(self.token_text(e.token_id)) for e in out.new_logprobs or ())
                out = await anext(outputs, None)
            if include_usage:
                yield _sse(
                    {
                        "id": rid,
                        "object": kind,
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": _usage(last),
                    }
                )
        except EngineFailed as e:
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"
