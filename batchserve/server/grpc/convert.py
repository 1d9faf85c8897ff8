"""Proto <-> engine conversion. Every invalid field raises ValueError naming the field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from batchserve.admission import client_id
from batchserve.config import LimitsConfig
from batchserve.request import (
    MAX_LOGIT_BIAS,
    Constraint,
    FinishReason,
    RequestOutput,
    RequestStats,
    SamplingParams,
    TokenLogprob,
    tokens_per_step,
)
from batchserve.server.mapping import check_stop_token_count, lookahead_fields
from batchserve.server.samples import MAX_OUTPUT_LOGPROBS
from batchserve.text import TextCodec
from batchserve.v1 import generation_pb2 as pb

FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
    FinishReason.CONSTRAINT_FAILED: pb.FINISH_REASON_ERROR,
}
# SamplingOptions' `optional` scalars, passed to SamplingParams under the same names when set.
SCALAR_OPTIONS = (
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "ignore_eos",
    "logprobs",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)


Ids = TypeVar("Ids", bound=Sequence[int])


def prompt_of(request: Any, text: TextCodec) -> list[int]:
    """Token ids of a GenerateRequest's or TokenizeRequest's `input` oneof."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise ValueError("input: one of text, token_ids or chat is required")
    if kind == "text":
        if not request.text:
            raise ValueError("input.text: prompt is empty")
        text.check_text_size(len(request.text), "input.text")
        return _within_context(text.tokenize(request.text, "input.text"), "input.text", text)
    if kind == "token_ids":
        if not request.token_ids.ids:
            raise ValueError("input.token_ids: prompt is empty")
        _within_context(request.token_ids.ids, "input.token_ids", text)  # before copying or checking any id
        try:
            return text.tokenize(list(request.token_ids.ids))
        except ValueError as e:
            raise ValueError(f"input.token_ids: {e}") from None
    limit = text.limits.max_chat_messages
    if len(request.chat.messages) > limit:
        raise ValueError(f"input.chat: {len(request.chat.messages)} messages, at most {limit}")
    messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
    return _within_context(text.render_chat(messages), "input.chat", text)


def _within_context(ids: Ids, field: str, text: TextCodec) -> Ids:
    """`ids`, unless they leave the context no room for a new token (an error naming `field`)."""
    if len(ids) >= text.max_model_len:
        raise ValueError(
            f"{field}: {len(ids)} tokens; the context is {text.max_model_len}, "
            "which must also hold at least one new token"
        )
    return ids


def references_of(request: pb.GenerateRequest, text: TextCodec) -> list[list[int]]:
    """Token ids of a GenerateRequest's `reference` texts (its predicted output)."""
    return text.tokenize_references(list(request.reference), "reference")


LOOKAHEAD_FIELDS = ("enable", "decoding_length", "layout", "jacobi_window", "jacobi_ngram", "jacobi_guesses")


def sampling_params(
    request: pb.GenerateRequest,
    limits: LimitsConfig | None = None,
    max_model_len: int | None = None,
    answer_bytes: int | None = None,
) -> SamplingParams:
    """The request's sampling parameters. `max_model_len`: the model's context, which bounds
    `resume_token_ids` before they are copied (they and a new token must fit in it); `answer_bytes`:
    the message limit of a unary answer (`check_logprobs`)."""
    s, la = request.sampling, request.lookahead
    limits = limits or LimitsConfig()
    # Counts first: the lists are copied and checked item by item below.
    num_resumed = len(request.resume_token_ids)
    if max_model_len is not None and num_resumed > max_model_len - 2:
        raise ValueError(
            f"resume_token_ids: {num_resumed} tokens, at most {max_model_len - 2}: they, the prompt and a new "
            f"token must fit the model's context of {max_model_len}"
        )
    check_stop_token_count(len(s.stop_token_ids), limits, "sampling.stop_token_ids")
    if len(s.stop) > limits.max_stop_sequences:
        raise ValueError(f"sampling.stop: {len(s.stop)} stop strings, at most {limits.max_stop_sequences}")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"sampling.logit_bias: {len(s.logit_bias)} entries, at most {MAX_LOGIT_BIAS}")
    kwargs: dict[str, Any] = {}
    for name in SCALAR_OPTIONS:
        if s.HasField(name):
            kwargs[name] = getattr(s, name)
    if s.logit_bias:  # SamplingParams checks the values; the engine checks the ids against the vocabulary
        kwargs["logit_bias"] = dict(s.logit_bias)
    stops = []
    for i, raw in enumerate(s.stop):
        try:
            stops.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"sampling.stop[{i}]: not valid UTF-8") from None
    kwargs["stop"] = stops
    kwargs["stop_token_ids"] = list(s.stop_token_ids)
    given = [getattr(la, f) if la.HasField(f) else None for f in LOOKAHEAD_FIELDS]
    kwargs |= lookahead_fields(given[0], given[1], given[2], (given[3], given[4], given[5]))
    if num_resumed:  # copied once, by SamplingParams (which checks the count against max_new_tokens first)
        kwargs["resume_token_ids"] = request.resume_token_ids
    kind = request.WhichOneof("constraint")
    if kind == "json_object":
        kwargs["constraint"] = Constraint("json_object") if request.json_object else None
    elif kind is not None:
        kwargs["constraint"] = _constraint(kind, getattr(request, kind))
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        raise ValueError(f"sampling: {e}") from None
    check_logprobs(params, answer_bytes)
    return params


LOGPROB_BYTES = 13  # a TokenLogprob's or TopLogprob's id and float as protobuf writes them, at most
TOKEN_BYTES = 16  # a token's own entry in a logprob list, its tag and length


def check_logprobs(params: SamplingParams, answer_bytes: int | None = None) -> None:
    """ValueError, before the call is queued, where its output logprobs could pass HTTP's bound
    (MAX_OUTPUT_LOGPROBS), or, for a unary answer of at most `answer_bytes` (the message limit),
    could not fit in it: found only after the whole generation otherwise."""
    k = params.logprobs
    if k is None:
        return
    entries = params.max_new_tokens * (k + 1)
    if entries > MAX_OUTPUT_LOGPROBS:
        raise ValueError(
            f"sampling.logprobs: {params.max_new_tokens} tokens x ({k} top logprobs + 1) = {entries} logprobs, at"
            f" most {MAX_OUTPUT_LOGPROBS} a call; ask for fewer tokens or top logprobs"
        )
    need = params.max_new_tokens * (TOKEN_BYTES + (k + 1) * LOGPROB_BYTES)
    if answer_bytes is not None and need > answer_bytes:
        raise ValueError(
            f"sampling.logprobs: {params.max_new_tokens} tokens with {k} top logprobs each could need {need} bytes,"
            f" over the {answer_bytes}-byte message limit of one answer; use StreamGenerate, or fewer tokens or"
            " top logprobs"
        )


def _constraint(kind: str, spec: str) -> Constraint:
    try:
        return Constraint(kind, spec)
    except ValueError as e:
        raise ValueError(f"{kind}: {e}") from None


def usage_pb(out: RequestOutput) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=out.num_output_tokens,
        cached_prompt_tokens=out.stats.cached_prompt_tokens,
        accepted_prediction_tokens=out.stats.accepted_prediction_tokens,
        rejected_prediction_tokens=out.stats.rejected_prediction_tokens,
        resumed_tokens=out.stats.resumed_tokens,
    )


def stats_pb(stats: RequestStats, num_output_tokens: int) -> pb.SpeculationStats:
    return pb.SpeculationStats(
        steps=stats.steps,
        draft_tokens_proposed=stats.draft_tokens_proposed,
        draft_tokens_accepted=stats.draft_tokens_accepted,
        tokens_per_step=tokens_per_step(num_output_tokens, stats.steps),
    )


def logprobs_pb(entries: Sequence[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    """The engine's per-token logprobs as protos (none where the request asked for none)."""
    return [
        pb.TokenLogprob(
            token_id=e.token_id,
            logprob=e.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top],
        )
        for e in entries or ()
    ]


def stream_chunk(out: RequestOutput) -> pb.GenerateStreamResponse:
    return pb.GenerateStreamResponse(
        request_id=client_id(out.request_id),
        text=out.new_text,
        token_ids=out.new_token_ids,
        finish_reason=FINISH_REASONS[out.finish_reason] if out.finish_reason else pb.FINISH_REASON_UNSPECIFIED,
        usage=usage_pb(out),
        stats=stats_pb(out.stats, out.num_output_tokens),
        logprobs=logprobs_pb(out.new_logprobs),
    )
