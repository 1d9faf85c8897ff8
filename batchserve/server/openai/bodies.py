"""The OpenAI API's request bodies (pydantic): what each endpoint takes, what it refuses, and
how a body becomes `SamplingParams`."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from batchserve.config import LimitsConfig
from batchserve.request import (
    MAX_INT32,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    PENALTY_RANGE,
    SEED_RANGE,
    Constraint,
    SamplingParams,
)
from batchserve.server.mapping import check_stop_token_count, lookahead_fields
from batchserve.server.openai.errors import ApiError
from batchserve.server.openai.fields import ChatOnlyFields
from batchserve.server.openai.options import (
    OBFUSCATION_REFUSED,
    LookaheadOptions,
    Prediction,
    ResponseFormat,
    StreamOptions,
    count_field,
)
from batchserve.server.samples import MAX_OUTPUT_LOGPROBS, MAX_PROMPT_SCORES

_TOKEN_ID = re.compile(r"[0-9]{1,10}")


class CommonFields(BaseModel):
    """Fields both endpoints take. Unknown fields are refused (400 naming them), never ignored;
    OpenAI fields batchserve does not implement are accepted only at their neutral value."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = count_field()  # omitted: the rest of the context
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)  # OpenAI's default is 1; 0 is greedy
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])  # negative s: s + 2**64
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # An end-user id (OpenAI's): never a tenant key unless the server says so (tenant_source).
    user: str | None = Field(default=None, max_length=256)
    # Extras, as vLLM accepts them.
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT32)  # 0 or -1 (vLLM's spelling): no cut
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    lookahead: LookaheadOptions | None = None
    prediction: Prediction | None = None  # OpenAI's on chat; completions take it too
    response_format: ResponseFormat | None = None  # OpenAI's on chat; completions take it too
    # Penalties (formulas: batchserve/runner/penalties.py): OpenAI's two, vLLM's repetition_penalty.
    frequency_penalty: float | None = Field(default=None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    presence_penalty: float | None = Field(default=None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    repetition_penalty: float | None = Field(default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    n: int | None = count_field()  # completions of the prompt, at most the server's --max-samples
    # An extra: resume a generation from the tokens already delivered (`batchserve/resume.py`).
    resume_token_ids: list[int] | None = None

    def unsupported(self) -> None:
        """400 for an OpenAI parameter set to something batchserve cannot honour."""
        # Their 400s before anything is queued.
        self.num_logprobs()
        self.bias()
        self.predicted()
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise ApiError(400, f"stream_options.include_obfuscation: {OBFUSCATION_REFUSED}", "stream_options")

    def num_logprobs(self) -> int | None:
        """Top alternatives each output token's logprobs list; None: no logprobs (per endpoint)."""
        return None

    def constraint(self) -> Constraint | None:
        """What the output must match (`response_format`); None: anything."""
        return self.response_format.constraint() if self.response_format is not None else None

    def logprob_params(self) -> dict[str, int | None]:
        """SamplingParams' logprobs fields this body asks for."""
        return {"logprobs": self.num_logprobs()}

    def samples(self, limits: LimitsConfig) -> tuple[int, int]:
        """(n, how many to generate): `n` answers, picked from as many samples (completions'
        `best_of` generates more); each at most --max-samples, else a 400 naming the field."""
        n = self.n or 1
        if n > limits.max_samples:
            raise ApiError(400, f"n: {n} completions, at most {limits.max_samples} (--max-samples)", "n")
        if self.resume_token_ids and n > 1:
            raise ApiError(400, "resume_token_ids: one sample's generation resumes, not n", "resume_token_ids")
        return n, n

    def bias(self) -> dict[int, float]:
        """`logit_bias` by token id; 400 naming it for a key that is not one or a value out of range."""
        out: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            # ASCII digits only: str.isdigit() takes "²" and int() then raises (a 500, not a 400).
            if not _TOKEN_ID.fullmatch(key) or not 0 <= int(key) <= MAX_INT32:
                raise ApiError(400, f"logit_bias: {key!r} is not a token id", "logit_bias")
            if not -100 <= value <= 100:
                raise ApiError(400, f"logit_bias: {value} for {key} is outside [-100, 100]", "logit_bias")
            out[int(key)] = value
        return out

    def _check_output_logprobs(self, max_tokens: int, limits: LimitsConfig) -> None:
        """400 where the call could render more than MAX_OUTPUT_LOGPROBS output logprobs."""
        k = self.logprob_params()["logprobs"]
        if k is None:
            return
        total = self.samples(limits)[1]
        entries = total * max_tokens * (k + 1)
        if entries > MAX_OUTPUT_LOGPROBS:
            raise ApiError(
                400,
                f"max_tokens: {total} samples x {max_tokens} tokens x ({k} top logprobs + 1) = {entries} logprobs,"
                f" at most {MAX_OUTPUT_LOGPROBS} a call; set a smaller max_tokens, n or top logprobs",
                "max_tokens",
            )

    def predicted(self) -> list[str]:
        """The request's references: its prediction's text, if it sent one."""
        return [self.prediction.text()] if self.prediction is not None else []

    def sampling_params(self, max_tokens: int | None, max_model_len: int, limits: LimitsConfig) -> SamplingParams:
        """`max_tokens` omitted: up to the end of the context (as OpenAI and vLLM)."""
        check_stop_token_count(len(self.stop_token_ids or ()), limits)
        self._check_output_logprobs(max_model_len if max_tokens is None else max_tokens, limits)
        kwargs: dict[str, Any] = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "max_new_tokens": max_model_len if max_tokens is None else max_tokens,
        }
        penalties = ("frequency_penalty", "presence_penalty", "repetition_penalty")
        for name in ("top_p", "seed", "top_k", "ignore_eos", *penalties):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if kwargs.get("top_k") == -1:
            kwargs["top_k"] = 0
        if self.stop is not None:
            kwargs["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.stop_token_ids is not None:
            kwargs["stop_token_ids"] = self.stop_token_ids
        if self.resume_token_ids:
            kwargs["resume_token_ids"] = self.resume_token_ids
        kwargs["constraint"] = self.constraint()
        kwargs |= self.logprob_params()
        kwargs["logit_bias"] = self.bias()
        la = self.lookahead
        if la is not None:
            jacobi = (la.jacobi_window, la.jacobi_ngram, la.jacobi_guesses)
            kwargs |= lookahead_fields(la.enable, la.decoding_length, la.layout, jacobi)
        return SamplingParams(**kwargs)


class CompletionRequest(CommonFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_INT32)  # 0 with echo: score the prompt only
    echo: bool | None = None  # the prompt before the completion (and, with logprobs, its tokens' logprobs)
    suffix: str | None = None
    best_of: int | None = count_field()  # samples to pick the n most likely (cumulative logprob) from
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # the top alternatives per token

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def samples(self, limits: LimitsConfig) -> tuple[int, int]:
        n, _ = super().samples(limits)
        best_of = self.best_of or n
        if not n <= best_of <= limits.max_samples:
            raise ApiError(400, f"best_of: {best_of}, must be in [n, {limits.max_samples}] (n is {n})", "best_of")
        if best_of > 1 and self.resume_token_ids:
            raise ApiError(400, "resume_token_ids: one sample's generation resumes, not best_of", "resume_token_ids")
        if best_of > n and self.stream:
            raise ApiError(400, "best_of > n cannot be streamed: only the end tells which are best", "best_of")
        return n, best_of

    def unsupported(self) -> None:
        super().unsupported()
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens: 0 only with echo (scoring the prompt)", "max_tokens")

    def logprob_params(self) -> dict[str, int | None]:
        # The prompt's logprobs where echo shows them (and where max_tokens 0 has nothing else to do);
        # samples ranked by best_of need their tokens' logprobs whether the answer shows them or not.
        scoring = self.logprobs if self.logprobs is not None else (0 if self.max_tokens == 0 else None)
        ranked = self.logprobs if self.logprobs is not None else (0 if (self.best_of or 1) > (self.n or 1) else None)
        return {"prompt_logprobs": scoring if self.echo else None, "logprobs": ranked}

    @property
    def shared_samples(self) -> bool:
        """Whether a prompt's samples are all one answer (max_tokens 0: echo scores the prompt and
        samples nothing), so that one request per prompt runs and its answer is shown n times."""
        return self.max_tokens == 0

    def check_scoring(self, num_prompt_tokens: int, limits: LimitsConfig) -> None:
        """400 naming `prompt` and MAX_PROMPT_SCORES where echo's prompt logprobs would score more
        than that: prompt tokens x (logprobs + 1) x the samples that each hold them."""
        k = self.logprob_params()["prompt_logprobs"]
        if k is None:
            return
        n, total = self.samples(limits)
        copies = n if self.shared_samples else total
        scores = num_prompt_tokens * (k + 1) * copies
        if scores > MAX_PROMPT_SCORES:
            raise ApiError(
                400,
                f"prompt: echo with logprobs {k} scores {num_prompt_tokens} prompt tokens x {k + 1} x {copies}"
                f" samples = {scores}, at most {MAX_PROMPT_SCORES} a call (MAX_PROMPT_SCORES: prompt tokens x"
                " (logprobs + 1) x samples); send fewer or shorter prompts, a smaller logprobs or fewer samples",
                "prompt",
            )

    def prompts(self, limits: LimitsConfig) -> list[str | list[int]]:
        """Every prompt of the call (a text, token ids, or a list of either), each answered with
        its own choices; the call's requests (prompts times best_of) at most --max-samples."""
        p = self.prompt
        if not isinstance(p, list) or not p or isinstance(p[0], int):
            return [p]  # type: ignore[list-item]  # one prompt
        _, total = self.samples(limits)
        if self.resume_token_ids:
            raise ApiError(400, "resume_token_ids: one prompt's generation resumes, not a list's", "resume_token_ids")
        if len(p) * total > limits.max_samples:
            raise ApiError(
                400,
                f"prompt: {len(p)} prompts x {total} samples each, at most {limits.max_samples} requests a call"
                " (--max-samples)",
                "prompt",
            )
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id...: ignored, content is what counts
    role: str
    content: str | list[dict[str, Any]] | None = None

    def rendered(self, i: int) -> dict[str, Any]:
        """The message as the chat template gets it: its text, and an assistant's tool calls or a
        tool result's call id (checked by `TextCodec.render_chat`)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text(i)}
        extra = self.model_extra or {}
        return out | {k: extra[k] for k in ("tool_calls", "tool_call_id", "name") if extra.get(k) is not None}

    def text(self, i: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(CommonFields, ChatOnlyFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = count_field()
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def unsupported(self) -> None:
        super().unsupported()
        refused = self.refusal()
        if refused is not None:
            raise ApiError(400, refused[1], refused[0])

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    # The checked tool settings (`tools.ChatTools`, which imports this module), once set.
    _tools: Any = PrivateAttr(default=None)

    def use_tools(self, tools: Any) -> None:
        self._tools = tools

    def constraint(self) -> Constraint | None:
        """`response_format`'s, the calls a `tool_choice` of required or a function forces, or (auto) either."""
        fmt = super().constraint()
        return self._tools.constraint(fmt) if self._tools is not None else fmt
