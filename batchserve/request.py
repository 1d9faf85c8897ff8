"""Requests, sampling parameters and outputs: plain Python, shared by every layer."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from batchserve.config import DRAFT_LAYOUTS


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens or the model's context reached
    EOS = "eos"  # the model's end-of-sequence token
    STOP_SEQUENCE = "stop_sequence"  # a stop string or a stop token id
    CANCELLED = "cancelled"  # aborted by the caller
    ERROR = "error"  # the step that ran this request failed
    CONSTRAINT_FAILED = "constraint_failed"  # its structured output's grammar admits no continuation


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


GREEDY_BELOW = 1e-5  # a temperature under this samples greedily
# Documented bounds of every numeric field (README "Limits"); each front end checks the same ones
# before a request is queued, so no value can reach a kernel that would overflow on it.
MAX_INT32 = 2**31 - 1  # counts and lengths (max_new_tokens, top_k, decoding_length, jacobi)
MAX_TEMPERATURE = 100.0  # far past uniform for any model's logits; inf would make NaN probabilities
SEED_RANGE = (-(2**63), 2**64)  # [low, high): torch's generator range; a negative s means s + 2**64
MAX_LOGPROBS = 20  # top alternatives a token's logprobs may list (OpenAI's bound)
PENALTY_RANGE = (-2.0, 2.0)  # frequency and presence penalties (OpenAI's bounds)
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty in [1 / this, this]; 1 is none
# A factor of at most 10 either way: a logit divided by much less than 1/10 overflows float16's
# and, far enough, float32's range (inf, then NaN probabilities).
MIN_REPETITION_PENALTY = 1 / MAX_REPETITION_PENALTY
MAX_LOGIT_BIAS = 300  # entries (OpenAI's bound), each a value in [-100, 100]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, high: int = MAX_INT32) -> None:
    if not _is_int(value) or not low <= value <= high:  # type: ignore[operator]
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")


CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "grammar")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match (structured output): any JSON object, a JSON Schema (`spec`: the
    schema as JSON text), a regular expression, or a Lark grammar (llguidance's dialect)."""

    kind: str
    spec: str = ""  # empty for json_object

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {CONSTRAINT_KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"a {self.kind} constraint's spec must be a string")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"a {self.kind} constraint needs a non-empty spec")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. `temperature` 0 (or below 1e-5) means greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    decoding_length: int | None = None  # per-request draft budget; None = the engine's, 0 = off
    draft_layout: str | None = None  # lookahead layout: hierarchical, parallel or single; None = the engine's
    # jacobi/hybrid (w, n, g), each at most the engine's; None (or a None in it) = the engine's.
    jacobi: tuple[int | None, int | None, int | None] | None = None
    constraint: Constraint | None = None  # structured output: the text must match it
    # Each output token's log-probability under the model's raw distribution and this many top
    # alternatives (0..MAX_LOGPROBS); None: none reported.
    logprobs: int | None = None
    # The prompt's tokens' log-probabilities (each but the first, which nothing predicts) with this
    # many top alternatives; None: none. With it, max_new_tokens may be 0: score the prompt only.
    prompt_logprobs: int | None = None
    # Penalties on the logits before any choice (`runner.penalties` states the formulas): OpenAI's
    # frequency and presence penalties over the output so far, vLLM's repetition penalty over the
    # prompt and the output, and a bias per token id ((id, bias) pairs).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # A resumed generation: the tokens already generated for this request (elsewhere, before a
    # failure). The engine continues as if it had produced them (`batchserve/resume.py`).
    resume_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True  # False: the text keeps them (gpt-oss's channels, split by the chat API)
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False, default=frozenset())

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples so the params stay hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        # 0 only scores a prompt: without prompt_logprobs such a request would compute nothing of use.
        _check_int("max_new_tokens", self.max_new_tokens, 0 if self.prompt_logprobs is not None else 1)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # also rejects NaN
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        _check_int("top_k", self.top_k, 0)  # 0, or at least the vocabulary: no cut
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            low, high = SEED_RANGE
            if not _is_int(self.seed) or not low <= self.seed < high:
                raise ValueError(f"seed must be an int in [-2**63, 2**64), got {self.seed!r}")
            object.__setattr__(self, "seed", self.seed % 2**64)  # as torch maps it: one seed, one stream
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t <= MAX_INT32:
                raise ValueError(f"stop_token_ids must be ints in [0, {MAX_INT32}], got {t!r}")
        # Looked up for every emitted token: a set, whatever the count (the engine caps the count).
        object.__setattr__(self, "stop_token_set", frozenset(self.stop_token_ids))
        if len(self.resume_token_ids) >= max(1, self.max_new_tokens):  # the count before any copy or scan
            raise ValueError(
                f"resume_token_ids: {len(self.resume_token_ids)} tokens leave nothing of max_new_tokens "
                f"{self.max_new_tokens} to generate"
            )
        object.__setattr__(self, "resume_token_ids", tuple(self.resume_token_ids))
        if any(not _is_int(t) or not 0 <= t <= MAX_INT32 for t in self.resume_token_ids):
            raise ValueError("resume_token_ids must be token ids (ints in [0, 2**31))")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.decoding_length is not None:
            _check_int("decoding_length", self.decoding_length, 0)
        if self.draft_layout is not None and self.draft_layout not in DRAFT_LAYOUTS:
            raise ValueError(f"draft_layout must be one of {DRAFT_LAYOUTS}, got {self.draft_layout!r}")
        if self.jacobi is not None:
            object.__setattr__(self, "jacobi", tuple(self.jacobi))
            ok = len(self.jacobi) == 3 and all(
                v is None or (_is_int(v) and low <= v <= MAX_INT32) for v, low in zip(self.jacobi, (1, 2, 0))
            )
            if not ok:
                raise ValueError(f"jacobi must be (w >= 1, n >= 2, g >= 0), each an int or None, got {self.jacobi!r}")
        self._check_penalties()
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError(f"constraint must be a Constraint, got {type(self.constraint).__name__}")

    def _check_penalties(self) -> None:
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        rep = self.repetition_penalty
        if (
            isinstance(rep, bool)
            or not isinstance(rep, int | float)
            or not MIN_REPETITION_PENALTY <= rep <= MAX_REPETITION_PENALTY
        ):
            low, high = MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY
            raise ValueError(f"repetition_penalty must be in [{low:g}, {high:g}], got {rep!r}")
        bias = tuple(
            (k, v) for k, v in (self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias)
        )
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: {len(bias)} entries, at most {MAX_LOGIT_BIAS}")
        for token, value in bias:
            _check_int("logit_bias token id", token, 0)
            if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for {token}")
        if len({t for t, _ in bias}) != len(bias):
            raise ValueError("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(v)) for t, v in bias)))

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes this request's logits."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1 or self.logit_bias)

    @property
    def greedy(self) -> bool:
        # Below this, dividing the logits by the temperature overflows; it is argmax anyway (as vLLM).
        return self.temperature < GREEDY_BELOW


@dataclass(slots=True)
class RequestStats:
    """Per-request speculation and cache counters."""

    steps: int = 0  # engine steps that produced tokens for this request
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    num_preemptions: int = 0
    queue_seconds: float | None = None  # arrival to first scheduled step
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    prediction_tokens: int = 0  # tokens in the request's references (a client's predicted output)
    reference_drafts_accepted: int = 0  # accepted draft tokens that were copied from them
    resumed_tokens: int = 0  # output tokens the request came with (resume_token_ids): input, not generated here

    @property
    def accepted_prediction_tokens(self) -> int:
        """OpenAI's usage field: prediction tokens verification accepted as drafts. A stretch
        of the prediction the output repeats twice counts once per copy, so it is capped at
        the prediction's length."""
        return min(self.reference_drafts_accepted, self.prediction_tokens)

    @property
    def rejected_prediction_tokens(self) -> int:
        """The prediction's other tokens: all of them where nothing drafted (`draft=none`)."""
        return self.prediction_tokens - self.accepted_prediction_tokens


@dataclass(slots=True)
class Request:
    """Scheduler-side state of one request. Only the engine's loop thread mutates it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_total_len: int  # prompt + output may not exceed this (model context)
    arrival_time: float = 0.0
    arrival_seq: int = 0  # the scheduler's arrival order (preemption takes the youngest)
    tenant: str = ""  # isolation key: with trie_scope=tenant, drafts share n-grams only within it
    # Token ids of texts the output is expected to repeat (OpenAI's `prediction`): drafted from
    # by this request alone, never shared with another.
    reference_token_ids: list[list[int]] = field(default_factory=list)
    # Siblings of one call (OpenAI's `n`): they share the prompt's cached KV blocks whatever the
    # prefix cache's scope. "" for a request on its own.
    group: str = ""
    # The matcher of `params.constraint` (a `grammar.RequestGrammar`), advanced by every token it
    # emits; None without a constraint. Typed loosely: this module imports nothing of llguidance.
    grammar: Any = None
    output_token_ids: list[int] = field(default_factory=list)
    # NOTE: all_token_ids[:num_computed_tokens] have K/V in the pool; the rest wait to be computed.
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of all_token_ids' first full blocks
    num_cached_blocks: int = 0  # block_ids[:num_cached_blocks] are registered in (or came from) the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None  # why it ended with ERROR
    stats: RequestStats = field(default_factory=RequestStats)
    # With `params.prompt_logprobs`: the entries of prompt tokens 1.. gathered so far, chunk by
    # chunk; handed out once, with the request's first output.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        self.stats.prediction_tokens = sum(map(len, self.reference_token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def scoring(self) -> bool:
        """Whether prompt logprobs are asked for and not all gathered yet: its prompt must be
        computed here, not taken from the prefix cache."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token's log-probability under the model's raw distribution (before penalties,
    bias, grammar masks and temperature), and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request (a stream chunk, or the final result)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    stats: RequestStats
    error: str | None = None  # set when finish_reason is ERROR or CONSTRAINT_FAILED
    # With `params.logprobs`: one entry per new token, in order.
    new_logprobs: list[TokenLogprob] | None = None
    # With `params.prompt_logprobs`, on the first output only: prompt tokens 1.. in order.
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def tokens_per_step(self) -> float:
        return tokens_per_step(self.num_output_tokens - self.stats.resumed_tokens, self.stats.steps)  # generated here

    @classmethod
    def of(
        cls, req: Request, new_tokens: list[int], new_text: str, logprobs: list[TokenLogprob] | None = None
    ) -> RequestOutput:
        """`req`'s output for a step that appended `new_tokens` (`new_text`), with their logprobs
        where it asks for them, and its prompt's logprobs once, in the first output after they are
        all gathered."""
        if req.params.logprobs is not None:  # the emitted tokens' entries, as far as the request took them
            logprobs = (logprobs or [])[: len(new_tokens)]
        prompt_logprobs = None
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            if not req.scoring or req.is_finished:
                prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        return cls(
            request_id=req.request_id,
            new_token_ids=new_tokens,
            new_text=new_text,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            stats=req.stats,
            error=req.error,
            new_logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


def tokens_per_step(num_output_tokens: int, steps: int) -> float:
    """Output tokens per step that produced any: what speculation bought (1.0: none; 0 before any step)."""
    return num_output_tokens / steps if steps else 0.0
