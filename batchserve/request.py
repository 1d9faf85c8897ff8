"""Requests, sampling parameters and outputs: plain Python, shared by every layer."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from batchserve.config import DRAFT_LAYOUTS


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens or the model's context reached
    EOS = "eos"  # the model's end-of-sequence token
    STOP_SEQUENCE = "stop_sequence"  # a stop string or a stop token id
    CANCELLED = "cancelled"  # aborted by the caller
    ERROR = "error"  # the step that ran this request failed


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


GREEDY_BELOW = 1e-5  # a temperature under this samples greedily


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

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples so the params stay hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {t!r}")
        if self.decoding_length is not None and self.decoding_length < 0:
            raise ValueError(f"decoding_length must be >= 0, got {self.decoding_length}")
        if self.draft_layout is not None and self.draft_layout not in DRAFT_LAYOUTS:
            raise ValueError(f"draft_layout must be one of {DRAFT_LAYOUTS}, got {self.draft_layout!r}")
        if self.jacobi is not None:
            object.__setattr__(self, "jacobi", tuple(self.jacobi))
            ok = len(self.jacobi) == 3 and all(
                v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= low)
                for v, low in zip(self.jacobi, (1, 2, 0))
            )
            if not ok:
                raise ValueError(f"jacobi must be (w >= 1, n >= 2, g >= 0), each an int or None, got {self.jacobi!r}")

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

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


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
    error: str | None = None  # set when finish_reason is ERROR

    @property
    def tokens_per_step(self) -> float:
        return tokens_per_step(self.num_output_tokens, self.stats.steps)


def tokens_per_step(num_output_tokens: int, steps: int) -> float:
    """Output tokens per step that produced any: what speculation bought (1.0: none; 0 before any step)."""
    return num_output_tokens / steps if steps else 0.0
