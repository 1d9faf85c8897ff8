"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions, /v1/models,
/health, over the same `Frontend` (admission, limits, shutdown) as gRPC.

FastAPI because it is what vLLM and SGLang serve the same API with: pydantic validates the
bodies and the OpenAPI schema comes for free (/openapi.json, /docs)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from batchserve.request import RequestOutput
from batchserve.server.frontend import EngineFailed, Frontend, Refusal, Refused
from batchserve.server.http import BodyLimit
from batchserve.server.keys import ApiKeys
from batchserve.server.openai.answers import Answer, AnswerView, EchoPrompt, Sample, best, constraint_failure
from batchserve.server.openai.auth import KeyCheck, http_tenant
from batchserve.server.openai.bodies import ChatRequest, CommonFields, CompletionRequest
from batchserve.server.openai.calls import check_utf8, install_error_handlers, unless_gone
from batchserve.server.openai.channels import harmony_markup
from batchserve.server.openai.door import CallLimit, HealthFirst
from batchserve.server.openai.errors import ApiError, param_of
from batchserve.server.openai.logprobs import TokenText
from batchserve.server.openai.responses import ResponseAnswer
from batchserve.server.openai.responses_bodies import ResponsesRequest
from batchserve.server.openai.tools import ChatTools, parse_tool_request
from batchserve.text import TextCodec

logger = logging.getLogger("batchserve")
STATUS = {Refusal.INVALID: 400, Refusal.QUEUE_FULL: 429, Refusal.DRAINING: 503, Refusal.ENGINE_DEAD: 503}


class OpenAIServer:
    """Builds the FastAPI app over a `Frontend`; `max_body_bytes` bounds a request body."""

    def __init__(
        self,
        frontend: Frontend,
        model_name: str,
        max_body_bytes: int,
        tenant_source: str = "header",
        keys: ApiKeys | None = None,
        max_calls: int = 1 << 20,
    ) -> None:
        """`tenant_source`: where a request's tenant key comes from (ServerConfig.tenant_source)
        without API keys; `keys`: the key file's keys, which every call but /health must then
        present (`KeyCheck`); `max_calls`: calls at once, beyond which a 503 (`CallLimit`)."""
        self.max_calls = max_calls
        self.frontend = frontend
        self.keys = keys
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.tenant_source = tenant_source
        self.created = int(time.time())
        self.token_text = TokenText(frontend.engine.core.tokenizer)
        # gpt-oss: chat answers keep the harmony markup's text, split into reasoning and content.
        self.channels = harmony_markup(frontend.engine.core.tokenizer)
        self.app = self._build()

    def _build(self) -> FastAPI:
        # Every body's strings are UTF-8 before any field is read (a lone surrogate is a 400 naming it).
        summary = "OpenAI-compatible API of the batchserve engine"
        app = FastAPI(title="batchserve", summary=summary, dependencies=[Depends(check_utf8)])

        install_error_handlers(
            app, on_invalid=lambda: self.frontend.metrics.rejected.labels(Refusal.INVALID.value).inc()
        )

        # The last added runs first: /health (no key, no body, no place taken), then the key (an
        # unknown one refused unread, before it takes a place), the call limit, the body's size.
        app.add_middleware(BodyLimit, limit=self.max_body_bytes, on_refuse=self._count_too_large)
        app.add_middleware(CallLimit, limit=self.max_calls, on_refuse=self._count_busy)
        if self.keys is not None:
            app.add_middleware(KeyCheck, keys=self.keys, on_refuse=self._count_unauthenticated)
        app.add_middleware(HealthFirst, healthy=lambda: self.frontend.healthy)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str) -> dict[str, Any]:
            self._check_model(model_id)
            return self._model_card()

        @app.post("/v1/completions", response_model=None)
        async def completions(body: CompletionRequest, request: Request) -> Any:
            return await self._completions(body, request)

        @app.post("/v1/chat/completions", response_model=None)
        async def chat(body: ChatRequest, request: Request) -> Any:
            return await self._chat(body, request)

        @app.post("/v1/responses", response_model=None)
        async def responses(body: ResponsesRequest, request: Request) -> Any:
            return await self._responses(body, request)

        return app

    async def _completions(self, body: CompletionRequest, request: Request) -> Any:
        body.unsupported()
        self._check_model(body.model)
        limits = self.frontend.engine.core.config.limits
        prompts = body.prompts(limits)
        echoes = tuple(EchoPrompt(p) for p in prompts) if body.echo else None
        n, per_prompt = body.samples(limits)
        shown = n if body.shared_samples else per_prompt  # the samples of each prompt the answer holds
        view = AnswerView(chat=False, logprobs=body.logprobs is not None, echoes=echoes, per_prompt=shown)

        def prepare(text: TextCodec) -> list[list[int]]:
            ids = [e.tokenize(text) for e in echoes] if echoes is not None else [text.tokenize(p) for p in prompts]
            body.check_scoring(sum(map(len, ids)), limits)  # once the tokens are known, before any is scored
            return ids

        return await self._respond(body, request, prepare, body.max_tokens, view, len(prompts), body.shared_samples)

    async def _chat(self, body: ChatRequest, request: Request) -> Any:
        body.unsupported()
        self._check_model(body.model)
        limit = self.frontend.engine.core.config.limits.max_constraint_chars
        tools = self._harmony(parse_tool_request(body.tools, body.tool_choice, body.parallel_tool_calls, limit))
        body.use_tools(tools)
        body.constraint()  # its 400 (a grammar response_format beside tools under auto) before anything is queued
        messages = [m.rendered(i) for i, m in enumerate(body.messages)]
        offered = tools.prompt_tools if tools is not None else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        _, per_prompt = body.samples(self.frontend.engine.core.config.limits)  # usage: the prompt once for n
        view = AnswerView(
            chat=True, logprobs=bool(body.logprobs), tools=tools, per_prompt=per_prompt, channels=self.channels
        )
        return await self._respond(body, request, lambda text: [text.render_chat(messages, offered)], max_tokens, view)

    async def _responses(self, body: ResponsesRequest, request: Request) -> Any:
        """The Responses API: the call as the chat request it asks for, answered as a response."""
        body.unsupported()
        self._check_model(body.model)
        chat = body.chat()
        chat.unsupported()
        limit = self.frontend.engine.core.config.limits.max_constraint_chars
        tools = self._harmony(parse_tool_request(chat.tools, chat.tool_choice, chat.parallel_tool_calls, limit))
        chat.use_tools(tools)
        chat.constraint()
        messages = [m.rendered(i) for i, m in enumerate(chat.messages)]
        offered = tools.prompt_tools if tools is not None else None
        ids = body.token_ids
        prepare = (lambda text: [text.tokenize(ids)]) if ids is not None else (
            lambda text: [text.render_chat(messages, offered)]
        )  # fmt: skip
        chat.stream = body.stream
        answer = ResponseAnswer(body, self.model_name, tools, self.channels)
        run = await self._run(chat, request, prepare, chat.max_completion_tokens, answer.id, 1, markup=self.channels)
        if run is None:
            return None
        first, outputs, samples = run
        if outputs is not None and first is not None:
            return _sse_response(answer.stream(first[1], outputs))
        assert samples is not None and samples[0].last is not None
        return await self.frontend.render(lambda: JSONResponse(answer.whole(samples[0].text, samples[0].last)))

    def _harmony(self, tools: ChatTools | None) -> ChatTools | None:
        """The request's tools, a forced call written in harmony markup where the model speaks it."""
        return replace(tools, harmony=True) if tools is not None and self.channels else tools

    def _tenant(self, request: Request, user: str | None) -> str:
        try:
            return http_tenant(request, user, self.keys, self.tenant_source)
        except ApiError:
            self.frontend.metrics.rejected.labels(Refusal.INVALID.value).inc()
            raise

    def _count_invalid(self) -> None:
        self.frontend.metrics.rejected.labels(Refusal.INVALID.value).inc()

    def _count_busy(self) -> None:
        self.frontend.metrics.rejected.labels(Refusal.QUEUE_FULL.value).inc()

    def _count_unauthenticated(self) -> None:
        self.frontend.metrics.rejected.labels("UNAUTHENTICATED").inc()

    def _count_too_large(self) -> None:
        self.frontend.metrics.rejected.labels(Refusal.QUEUE_FULL.value).inc()  # gRPC says RESOURCE_EXHAUSTED

    def _model_card(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "batchserve"}
        # An extension: whether the start-up check found a request's logits the same in any batch.
        core = self.frontend.engine.core
        return card | {
            "batch_invariant": core.facts.batch_invariant,
            "batch_invariant_why": core.facts.invariance_why,
            "forward": core.facts.forward.name,
            "weights_reason": core.facts.forward.weights.why,
            "forward_parts": {
                name: {"choice": p.choice, "why": p.why} for name, p in core.facts.forward.parts().items()
            },
        }

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            served = self.model_name
            raise ApiError(404, f"model {model!r} is not served here; GET /v1/models lists {served!r}", "model")

    async def _respond(
        self,
        body: CommonFields,
        request: Request,
        prepare: Any,
        max_tokens: int | None,
        view: AnswerView,
        num_prompts: int = 1,
        shared: bool = False,
    ) -> Any:
        """Run one call: a JSON body, or (`stream`) server-sent events. `prepare(text)` gives the ids
        of each of its `num_prompts` prompts, whose choices come in order (`n` of each). `shared`:
        a prompt's samples would all be one answer, so one request runs and its answer is each choice."""
        rid = ("chatcmpl-" if view.chat else "cmpl-") + uuid.uuid4().hex
        n, total = body.samples(self.frontend.engine.core.config.limits)
        each = 1 if shared else total
        run = await self._run(body, request, prepare, max_tokens, rid, each, num_prompts, markup=view.channels)
        if run is None:
            return None  # nobody to answer; the requests were aborted and their KV freed
        first, outputs, samples = run
        answer = Answer(rid, self.model_name, view, self.token_text)
        if outputs is not None and first is not None:
            if shared:
                outputs = _copies(first, outputs, n)
                first = await anext(outputs)
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse_response(answer.stream(first, outputs, include_usage, self.frontend.render))
        assert samples is not None
        if shared:  # the copies share their sample's lists: its prompt's scores are held once
            samples = [replace(s, index=p * n + c) for p, s in enumerate(samples) for c in range(n)]
            total = n
        chosen = [s for p in range(num_prompts) for s in best(samples[p * total : (p + 1) * total], n)]
        return await self.frontend.render(lambda: JSONResponse(answer.whole(chosen, samples)))

    async def _run(
        self,
        body: Any,
        request: Request,
        prepare: Any,
        max_tokens: int | None,
        rid: str,
        total: int,
        num_prompts: int = 1,
        markup: bool = False,
    ) -> Run | None:
        """Submit a call's requests (`total` samples of each prompt): its first output and the rest
        to stream (`body.stream`), or every sample collected; None where the client left, which
        aborts its requests at once (waiting, during its prefill, or decoding). Refusals and engine
        failures before the first output are ApiErrors. `markup`: the text keeps the special
        tokens' (gpt-oss's channels, split by the answer)."""
        tenant = self._tenant(request, body.user)
        core = self.frontend.engine.core
        outputs = self.frontend.generate_n(
            prepare,
            lambda: replace(
                body.sampling_params(max_tokens, core.facts.max_model_len, core.config.limits),
                skip_special_tokens=not markup,
            ),
            rid,
            tenant,
            fit_context=max_tokens is not None,
            references=lambda text: text.tokenize_references(body.predicted(), "prediction"),
            n=total,
            num_prompts=num_prompts,
        )
        here, first, samples = False, None, None
        try:
            if body.stream:
                # Refusals surface with the first output, before any byte is sent.
                here, first = await unless_gone(request, anext(outputs))
            else:
                here, samples = await unless_gone(request, _collect(outputs, total * num_prompts))
        except Refused as e:
            raise ApiError(STATUS[e.kind], e.message, param_of(e.message, type(body).model_fields)) from None
        except ApiError:  # a preparation's own refusal (the scoring bound), counted like the others
            self.frontend.metrics.rejected.labels(Refusal.INVALID.value).inc()
            raise
        except EngineFailed as e:
            raise ApiError(500, str(e)) from None
        except StopAsyncIteration:  # pragma: no cover - the engine always sends a final output
            raise ApiError(500, "no output") from None
        finally:
            if not body.stream or not here:
                await outputs.aclose()
        if not here:
            return None
        return first, (outputs if body.stream else None), samples


# A call under way: its first output and the rest to stream, or (not streamed) every sample.
Run = tuple[tuple[int, RequestOutput] | None, AsyncIterator[tuple[int, RequestOutput]] | None, list[Sample] | None]


def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _copies(
    first: tuple[int, RequestOutput], outputs: AsyncIterator[tuple[int, RequestOutput]], n: int
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Each output of prompt p's one request as that of its `n` choices (p * n to p * n + n - 1);
    closing this closes `outputs`, which aborts the requests."""
    try:
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            for c in range(n):
                yield item[0] * n + c, item[1]
            item = await anext(outputs, None)
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]


async def _collect(outputs: AsyncIterator[tuple[int, RequestOutput]], total: int) -> list[Sample]:
    """Every sample's outputs, in index order."""
    samples = [Sample(i) for i in range(total)]
    async for i, out in outputs:
        if (failure := constraint_failure(out)) is not None:
            raise ApiError(400, failure, "response_format")
        samples[i].add(out)
    return samples
