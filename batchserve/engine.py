"""The engine core: one synchronous step (schedule, execute, commit) over scheduler, speculation and runner."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from batchserve.admission import Admission, Submission
from batchserve.config import EngineConfig
from batchserve.cost_profile import CostProfile
from batchserve.detokenize import Detokenizer
from batchserve.grammar import GrammarCompiler
from batchserve.grammar.steps import GrammarSteps
from batchserve.pipeline import AdvancedStep, PendingStep, build_outputs, output_of, retry_in_halves, stop_hook, without
from batchserve.records import RunnerOutput, SchedulerOutput, StepPhases
from batchserve.request import FinishReason, Request, RequestOutput
from batchserve.scheduler import BlockAllocator, Scheduler
from batchserve.speculation import DraftBudgetPolicy, Drafter, Speculation, build_drafter, corpus_slices, defer
from batchserve.text import TextCodec
from batchserve.threads import set_threads

__all__ = ["CORPUS_SLICE_TOKENS", "Drafter", "EngineCore"]  # Drafter: the type of a drafter handed in

logger = logging.getLogger("batchserve")

CORPUS_SLICE_TOKENS = 128  # run starts inserted between two yields of the loop (a few ms of trie work)


class EngineCore:
    """Scheduler + speculation + runner + text codec; `step()` runs one model step."""

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
        from batchserve.model.engine_model import load_engine_model
        from batchserve.runner.build import build_checked_runner, kv_pool_bytes
        from batchserve.runner.forward import choose_forward

        self.config = config = config or EngineConfig()
        loaded_here = model is None  # cpu_weights=auto reads the file only where the model came from it
        set_threads(config.model.num_threads)  # before the invariance checks: they hold at this count
        if model is None:
            model, tokenizer = load_engine_model(config.model, functools.partial(kv_pool_bytes, config.cache))
        elif tokenizer is None:
            raise ValueError("pass the tokenizer together with the model")
        model, forward = choose_forward(source := model, config, loaded_here)  # source: the check's memo key
        self.runner, facts = build_checked_runner(model, tokenizer, config, forward, loaded_here, source)
        # What the loaded model is and how it runs: its vocabulary and context, the forward (and why,
        # after any fallback), cuda_graphs as resolved, the start-up invariance check's verdict.
        self.facts, self.tokenizer = facts, tokenizer
        logger.info("forward: %s", facts.forward.line())
        self.text = TextCodec(tokenizer, facts.vocab_size, facts.max_model_len, config.limits)
        self.detok = Detokenizer(tokenizer)  # the output's text: begun at admission, decoded in the outputs
        # Structured output: constraints compiled once per text (front ends compile off the loop first).
        self.grammars = GrammarCompiler(tokenizer, facts.vocab_size, config.limits.max_constraint_chars)
        # Insertion beside the next forward (`learn`) on a device; on a CPU at once (benchmarks/README.md).
        deferred = self.runner.device.type != "cpu"
        if drafter is None:
            drafter = build_drafter(config.draft, self.text.tokenize, deferred)
        else:
            defer(drafter, deferred)
        self.cost_profile: CostProfile | None = None
        budget_policy = None
        if config.draft.adaptive and config.draft.method != "none":
            self.cost_profile = cost_profile or self._load_profile()
            budget_policy = DraftBudgetPolicy.from_config(self.cost_profile, config.draft)
        grammar = GrammarSteps()  # structured output's share of each step: drafts pruned, rows masked, advanced
        self.scheduler = Scheduler(
            config.scheduler,
            BlockAllocator(facts.num_blocks, config.cache.block_size),
            config.draft.trie_scope,
            on_token=stop_hook(self.detok),
            prefix_caching=config.cache.prefix_caching,
            grammar=grammar,
        )
        # Speculation: each step's drafts as data, and what the committed step teaches them.
        # `budget_policy` None: every request drafts `decoding_length` tokens.
        self.speculation = Speculation(drafter, config.draft, budget_policy, grammar)
        self.speculation.judge_later = True  # in `finish`: beside the next forward when pipelined
        self.admission = Admission(config, self.text, self.grammars)
        self.num_steps = 0
        self.consecutive_failed_steps = 0  # steps in a row in which every request failed
        # Called after every step with its schedule and phase times (metrics, benchmarks).
        self.step_listeners: list[Callable[[SchedulerOutput, StepPhases], None]] = []

    def add_corpus(self, sequences: list[list[int]], tenant: str = "") -> Iterator[None]:
        """Load earlier outputs into the draft trie of `tenant`'s scope (the scope requests with
        that key draft from), a slice at a time: the returned iterator does the work, and the
        caller may serve others between its steps. Call from the loop thread. Raises ValueError
        at once where no trie is shared (another drafter, or `trie_scope=request`)."""
        self.check_tenant(tenant)
        return corpus_slices(self.speculation.drafter, self.config.draft, sequences, tenant, CORPUS_SLICE_TOKENS)

    def _load_profile(self) -> CostProfile:
        from batchserve.runner.calibrate import load_or_calibrate

        path, max_tokens = self.config.draft.profile_path, self.config.scheduler.max_num_batched_tokens
        return load_or_calibrate(self.runner, path, max_tokens, self.facts.max_model_len)

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, sub: Submission) -> Request:
        """Validate and enqueue one submitted request (`admission.py`); raises ValueError (naming
        the field) before touching the scheduler."""
        req = self.admission.request(self.facts, sub)
        self.scheduler.add_request(req)  # may still refuse (duplicate id, never fits the pool)
        try:
            self.detok.begin(req)  # a resumed request's text decoded: a stop string in it refuses it
        except ValueError:
            self.scheduler.abort(req.request_id)
            raise
        return req

    def engine_id(self, sub: Submission) -> str | None:
        """The id `sub` gets here: its request id within its namespace (None: one is made)."""
        return sub.engine_id

    def check_tenant(self, tenant: str) -> None:
        """Raise ValueError unless `tenant` is "" (none) or a valid key."""
        self.admission.check_tenant(tenant)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel; the request's KV blocks are free when this returns."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.abort(request_id)
        self.speculation.finish(request_id)
        return self._out(req, [])

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def outputs_where(self, beside_forward: bool) -> None:
        """Where the loop running this core builds its outputs: beside the next forward, or in
        series with the steps, where judging drafts there delays the next step (drafting pays it)."""
        self.speculation.judged_in_series = not beside_forward

    @property
    def outputs_beside_forward(self) -> bool:
        """Where the loop that serves builds a step's outputs (`serving_loop.StepPipeline`): beside
        the next forward on a device, which leaves the host free; on a CPU after the forward,
        which takes the host's cores."""
        return self.runner.device.type != "cpu"

    # ---- one step: schedule -> launch -> collect -> advance -> finish ----------------------
    # `step()` runs them in a row. The loop that serves is StepPipeline's (serving_loop.py), which
    # builds one step's outputs (`finish`) while the next one's forward runs on a device;
    # AsyncEngine runs it with launch and collect in its step thread, LLM and the benchmarks as
    # it is. The PendingStep is handed from one phase to the next, never shared while two run.

    def step(self) -> list[RequestOutput]:
        step = self.schedule()
        self.learn()
        self.execute(step)
        return self.commit(step)

    def learn(self) -> None:
        """What the drafter learns from the last commit, after this step's proposals (AsyncEngine:
        while the forward runs). A failure costs drafts, never outputs."""
        self.speculation.learn()

    def schedule(self) -> PendingStep:
        step = PendingStep(start=time.perf_counter())
        try:
            out = self.scheduler.schedule()  # committed tokens first; drafts, as data, in what is left
            step.out = self.scheduler.reserve(out, self.speculation.propose(out, self.scheduler.requests))
        except Exception as e:  # commit fails every request: no stream may wait forever
            step.schedule_error = e
        step.phases.schedule = time.perf_counter() - step.start
        return step

    def execute(self, step: PendingStep) -> None:
        """The forward, start to end (`launch`, then `collect`). Never raises."""
        self.launch(step)
        self.collect(step)

    def launch(self, step: PendingStep) -> None:
        """Start the step's forward; safe off the event loop (touches only runner state). Never
        raises: an error is kept for `collect`."""
        out = step.out
        if step.schedule_error is not None:
            return
        if not out.requests:
            self.runner.release(out.finished_request_ids)
            return
        try:
            step.launched = self.runner.launch(out)
        except Exception as e:
            step.launch_error = e

    def collect(self, step: PendingStep) -> None:
        """Wait for the launched forward's results. Never raises: a forward that raised is retried
        in halves, down to single requests, so that only the requests that fail on their own are
        failed; the others' results stand."""
        if step.launched is None and step.launch_error is None:
            return
        try:
            if step.launch_error is not None:
                raise step.launch_error
            step.result = self.runner.collect(step.launched)
        except Exception as e:
            results = retry_in_halves(self.runner, list(step.out.requests), e, step.failed)
            step.result = RunnerOutput.merge(results) if results else None
            if step.result is None:  # every request failed: theirs, or the device's fault?
                step.device_ok = self.device_works()
        step.launched = None

    def device_works(self) -> bool:
        """After a step whose every request failed: does a plain forward still run (the
        request's fault), or not (the device's: the step counts towards stopping the engine)?"""
        return self.runner.device_works(self.facts.probe_block)

    def commit(self, step: PendingStep) -> list[RequestOutput]:
        """Apply a step's result and build its outputs (`advance`, then `finish`)."""
        return self.finish(self.advance(step))

    def advance(self, step: PendingStep) -> AdvancedStep:
        """Apply a step's result on the loop thread: what the next schedule needs (tokens, stops,
        finishes, block trims, the policy's trackers). Its outputs wait for `finish`."""
        self.speculation.judge()  # what an earlier step left unjudged (its outputs were never built)
        t0 = time.perf_counter()
        out = step.out
        advanced = AdvancedStep(step, [], [])
        crashed = False
        try:
            if step.schedule_error is not None:
                advanced.ready = self.fail_all(step.schedule_error)
            else:
                for rid, error in step.failed.items():
                    advanced.ready += self.fail([rid], error)
                if step.result is not None:
                    done = out if not step.failed else replace(out, requests=without(out.requests, step.failed))
                    logprobs = step.result.logprobs
                    committed = self.scheduler.update(done, step.result)
                    advanced.events = [
                        (req, toks, logprobs.get(req.request_id), not req.params.stop) for req, toks in committed.events
                    ]
                    self.speculation.commit(committed.drafts)
            advanced.ready += [self._out(r, []) for r in self.scheduler.take_failed()]
        except Exception as e:  # never leave a stream waiting forever
            crashed = True
            advanced.ready += self.fail_all(e)
        self.speculation.forget_ended(self.scheduler.requests)
        if step.engine_failed(crashed):
            self.consecutive_failed_steps += 1
        elif out.requests:
            self.consecutive_failed_steps = 0
        phases = step.take_runner_phases(self.scheduler.grammar.seconds)
        end = time.perf_counter()
        phases.commit, phases.wall = end - t0, end - step.start
        if step.result is not None and not step.failed:
            try:  # the policy's cost model: a bug there costs its estimate, never the step's outputs
                self.scheduler.observe_step(out, phases.wall)
                self.speculation.observe_step(out, phases.wall)
            except Exception:
                logger.exception("the draft policy failed to learn from a step")
        self.num_steps += 1
        return advanced

    def finish(self, advanced: AdvancedStep) -> list[RequestOutput]:
        """The policy judges the advanced step's drafts; its outputs (`pipeline.build_outputs`),
        then the step listeners."""
        t0 = time.perf_counter()
        self.speculation.judge()
        self.speculation.settle(self.scheduler.requests)
        outputs = build_outputs(self.detok, advanced, self._failed_output)
        advanced.step.phases.outputs = time.perf_counter() - t0
        for listener in self.step_listeners:
            try:
                listener(advanced.step.out, advanced.step.phases)
            except Exception:  # metrics must never stop serving
                logger.exception("step listener %r failed", listener)
        return outputs

    def fail(self, request_ids: list[str], error: BaseException) -> list[RequestOutput]:
        """End these requests with ERROR (the step that ran them raised)."""
        logger.error("engine step failed for %s", ", ".join(request_ids), exc_info=error)
        message = f"{type(error).__name__}: {error}"
        return [self._out(req, []) for req in self.scheduler.fail(request_ids, message)]

    def _failed_output(self, req: Request, error: Exception) -> RequestOutput:
        """The final output of a request whose output could not be built (it may have finished)."""
        logger.exception("building the output of request %s failed", req.request_id)
        message = f"{type(error).__name__}: {error}"
        if not self.scheduler.fail([req.request_id], message):  # finished already: its end is ERROR now
            req.error, req.finish_reason = message, FinishReason.ERROR
        return RequestOutput.of(req, [], self.detok.take(req.request_id, True))

    def fail_all(self, error: BaseException) -> list[RequestOutput]:
        """Last resort after an unexpected engine error: end every request with ERROR."""
        logger.error("engine loop failed; failing all %d requests", len(self.scheduler.requests), exc_info=error)
        message = f"{type(error).__name__}: {error}"
        return [self._out(req, []) for req in self.scheduler.fail(list(self.scheduler.requests), message)]

    def _out(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        return output_of(self.detok, req, new_tokens)
