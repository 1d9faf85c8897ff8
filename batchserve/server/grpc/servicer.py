"""The TextGeneration servicer: gRPC in, engine requests out (through the shared `Frontend`)."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator

import grpc

from batchserve.admission import client_id
from batchserve.request import RequestOutput, TokenLogprob
from batchserve.server.frontend import EngineFailed, Frontend, Refusal, Refused
from batchserve.server.grpc import convert
from batchserve.server.keys import TENANT_HEADER, ApiKeys, BadTenantHeader, Unauthenticated, request_tenant
from batchserve.v1 import generation_pb2 as pb
from batchserve.v1 import generation_pb2_grpc as pb_grpc

TENANT_METADATA = TENANT_HEADER
AUTHORIZATION = "authorization"
ADMIN_METADATA = "x-batchserve-admin-token"
MAX_CORPUS_SEQUENCES = 10_000  # per AddCorpus call (the message size bounds their length)
STATUS = {
    Refusal.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Refusal.DRAINING: grpc.StatusCode.UNAVAILABLE,
    Refusal.ENGINE_DEAD: grpc.StatusCode.UNAVAILABLE,
}


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    values = _all_metadata(context, key)
    return values[0] if values else None


def _all_metadata(context: grpc.aio.ServicerContext, key: str) -> list[str]:
    return [
        value if isinstance(value, str) else value.decode("utf-8", "replace")
        for k, value in context.invocation_metadata() or ()
        if k == key
    ]


class TextGenerationServicer(pb_grpc.TextGenerationServicer):
    def __init__(self, frontend: Frontend, tenant_source: str = "header", keys: ApiKeys | None = None) -> None:
        """`tenant_source`: where a request's tenant key comes from (ServerConfig.tenant_source)
        without API keys; `keys`: the key file's keys, which every call but AddCorpus (the
        admin token's) must then present as `authorization: Bearer KEY`."""
        self.frontend = frontend
        self.engine = frontend.engine
        self.tenant_source = tenant_source
        self.keys = keys
        self.max_message_bytes: int | None = None  # the largest message, once the server knows it

    async def _tenant(self, context: grpc.aio.ServicerContext, field: str = "") -> str:
        """The call's tenant (`keys.request_tenant`); the call aborted where it has none."""
        try:
            return request_tenant(
                self.keys, _all_metadata(context, AUTHORIZATION), _all_metadata(context, TENANT_METADATA), field,
                self.tenant_source,
            )  # fmt: skip
        except Unauthenticated as e:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
        except BadTenantHeader as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        raise AssertionError("unreachable: abort raises")

    # ---- RPCs ----------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        text: list[str] = []
        token_ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        last: RequestOutput | None = None
        async for out in self._run(request, context, self.max_message_bytes):
            text.append(out.new_text)
            token_ids.extend(out.new_token_ids)
            logprobs.extend(out.new_logprobs or ())
            last = out
        assert last is not None and last.finish_reason is not None
        return pb.GenerateResponse(
            request_id=client_id(last.request_id),
            text="".join(text),
            token_ids=token_ids,
            finish_reason=convert.FINISH_REASONS[last.finish_reason],
            usage=convert.usage_pb(last),
            stats=convert.stats_pb(last.stats, last.num_output_tokens),
            logprobs=convert.logprobs_pb(logprobs),
        )

    async def StreamGenerate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        async for out in self._run(request, context):
            # Steps that only held back text (a possible stop string, half a character) and
            # emitted no token send nothing; the last message is always sent.
            if out.new_token_ids or out.new_text or out.finished:
                yield convert.stream_chunk(out)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        tenant = await self._tenant(context)
        try:  # admitted like a generation: tokenizing is the same work
            ids = await self.frontend.prepare(convert.prompt_of, request, self.engine.core.text, tenant=tenant)
        except Refused as e:
            await context.abort(STATUS[e.kind], e.message)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._tenant(context)
        core = self.engine.core
        cfg = core.config
        return pb.ModelInfo(
            model=self.frontend.info.model,
            vocab_size=core.facts.vocab_size,
            max_model_len=core.facts.max_model_len,
            eos_token_ids=sorted(core.facts.eos_token_ids),
            dtype=self.frontend.info.dtype,
            draft_method=cfg.draft.method,
            decoding_length=cfg.draft.decoding_length,
            max_batch_size=cfg.scheduler.max_num_seqs,
            max_waiting_requests=self.frontend.info.max_waiting_requests,
            prefix_caching=cfg.cache.prefix_caching,
            batch_invariant=core.facts.batch_invariant,
            batch_invariant_why=core.facts.invariance_why,
            forward=core.facts.forward.name,
            weights_reason=core.facts.forward.weights.why,
            forward_parts=[
                pb.ForwardPart(part=name, choice=p.choice, why=p.why) for name, p in core.facts.forward.parts().items()
            ],
        )

    async def AddCorpus(self, request: pb.AddCorpusRequest, context: grpc.aio.ServicerContext) -> pb.AddCorpusResponse:
        denied = grpc.StatusCode.PERMISSION_DENIED
        token = self.frontend.admin_token
        given = _metadata(context, ADMIN_METADATA) or ""
        if token is None:
            await context.abort(denied, "AddCorpus is off: start the server with --admin-token-file")
        if not hmac.compare_digest(given.encode(), token.encode()):
            await context.abort(denied, f"AddCorpus needs the admin token in {ADMIN_METADATA}")
        if len(request.texts) + len(request.token_ids) > MAX_CORPUS_SEQUENCES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_CORPUS_SEQUENCES} sequences per call")
        core = self.engine.core

        def tokenize() -> list[list[int]]:
            seqs = [core.text.tokenize(t) for t in request.texts]
            for i, seq in enumerate(seqs):  # token ids are checked against the context by tokenize
                if len(seq) >= core.facts.max_model_len:
                    raise ValueError(f"texts[{i}]: {len(seq)} tokens, at most {core.facts.max_model_len - 1}")
            return seqs + [core.text.tokenize(list(s.ids)) for s in request.token_ids]

        try:
            core.check_tenant(request.tenant)
            seqs = await self.frontend.off_loop(tokenize)
            n = await self.engine.add_corpus(seqs, request.tenant)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.AddCorpusResponse(sequences=n)

    # ---- one request ---------------------------------------------------------------------

    async def _run(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, answer_bytes: int | None = None
    ) -> AsyncIterator[RequestOutput]:
        """One request through the shared front end; its refusals and failures as gRPC statuses.
        `answer_bytes`: a unary answer's message limit, which its logprobs must fit."""
        limits, max_model_len = self.engine.core.config.limits, self.engine.core.facts.max_model_len
        tenant = await self._tenant(context, request.tenant)
        outputs = self.frontend.generate(
            lambda text: convert.prompt_of(request, text),
            lambda: convert.sampling_params(request, limits, max_model_len, answer_bytes),
            request.request_id,
            tenant,
            references=lambda text: convert.references_of(request, text),
        )
        try:
            async for out in outputs:
                yield out
        except Refused as e:
            await context.abort(STATUS[e.kind], e.message)
        except EngineFailed as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        finally:
            await outputs.aclose()  # a cancelled call: abort the request now, not at garbage collection
