"""A step's records between its phases, and its outputs (the one place that decodes their text and
answers the stop hook). The loop that runs the phases is `serving_loop.py`'s.

A step is schedule -> launch -> collect -> advance -> finish (`EngineCore`). `advance` applies
what the next schedule needs (accepted tokens, stops, finishes, block trims, the policy's
trackers); `finish` builds the outputs (detokenizing, logprobs, step listeners), which nothing
in the next schedule reads. So `finish` of step N may run while step N+1's forward does, and
the outputs are the same as the sequential loop's (`EngineCore.step`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchserve.detokenize import Detokenizer
from batchserve.records import RunnerOutput, ScheduledRequest, SchedulerOutput, StepPhases
from batchserve.request import Request, RequestOutput, TokenLogprob


@dataclass(slots=True)
class PendingStep:
    """One engine step on its way from schedule through launch and collect to advance."""

    start: float  # perf_counter() when scheduling began
    out: SchedulerOutput = field(default_factory=lambda: SchedulerOutput((), ()))
    launched: Any = None  # the runner's LaunchedStep between launch and collect
    launch_error: Exception | None = None  # launch raised: collect retries the step in halves
    result: RunnerOutput | None = None
    schedule_error: Exception | None = None  # fails every request
    failed: dict[str, Exception] = field(default_factory=dict)  # requests whose forward failed on their own
    device_ok: bool | None = None  # after a step whose every forward failed: did the probe run?
    phases: StepPhases = field(default_factory=StepPhases)

    def engine_failed(self, crashed: bool) -> bool:
        """Whether the step counts towards stopping the engine: only a failure not pinned to its
        requests does (scheduling or committing raised, or every forward failed and so did the
        probe). Requests that fail on their own while the device works never stop the server."""
        lost = bool(self.out.requests) and self.result is None and not self.device_ok
        return crashed or self.schedule_error is not None or lost

    def take_runner_phases(self, grammar_seconds: float) -> StepPhases:
        """The step's phases with the runner's share filled in, and `grammar_seconds` (the
        scheduler's time in grammar matchers) added to the grammar's."""
        phases = self.phases
        if self.result is not None:
            runner = self.result.phases
            phases.prepare, phases.forward, phases.verify = runner.prepare, runner.forward, runner.verify
            phases.attention, phases.grammar = runner.attention, runner.grammar
        phases.grammar += grammar_seconds
        return phases


@dataclass(slots=True)
class AdvancedStep:
    """A step applied to the scheduler, its outputs not built yet (`EngineCore.finish`)."""

    step: PendingStep
    ready: list[RequestOutput]  # outputs built at once: requests that failed
    # (request, tokens it appended, their logprobs, whether its text is still to detokenize)
    events: list[tuple[Request, list[int], list[TokenLogprob] | None, bool]]


def retry_in_halves(
    runner: Any, requests: list[ScheduledRequest], error: Exception, failed: dict[str, Exception]
) -> list[RunnerOutput]:
    """The results of a step whose forward raised, rerun in halves down to single requests, so
    that only the requests that fail on their own fail (lossless: a retried forward recomputes
    the same K/V into the same slots). `failed` gains those requests and their errors."""
    if len(requests) == 1:
        failed[requests[0].request_id] = error
        return []
    results = []
    mid = len(requests) // 2
    for half in (requests[:mid], requests[mid:]):
        try:
            results.append(runner.execute(SchedulerOutput(tuple(half), ())))
        except Exception as e:
            results += retry_in_halves(runner, half, e, failed)
    return results


def without(requests: tuple[ScheduledRequest, ...], ids: dict[str, Exception]) -> tuple[ScheduledRequest, ...]:
    return tuple(r for r in requests if r.request_id not in ids)


def stop_hook(detok: Detokenizer) -> Callable[[Request, int], bool]:
    """What the scheduler's commit asks after each token of a request with stop strings: the token
    decoded, and whether a stop string now completes (its text cut before it)."""

    def completes_a_stop(req: Request, token_id: int) -> bool:
        return detok.on_token(req.request_id, token_id)

    return completes_a_stop


def output_of(
    detok: Detokenizer, req: Request, new_tokens: list[int], logprobs: list[TokenLogprob] | None = None
) -> RequestOutput:
    """One request's output of a step: its new tokens, the text they free (all of it, and its text
    state dropped, once it finished), their logprobs."""
    return RequestOutput.of(req, new_tokens, detok.take(req.request_id, req.is_finished), logprobs)


def build_outputs(
    detok: Detokenizer, advanced: AdvancedStep, failed: Callable[[Request, Exception], RequestOutput]
) -> list[RequestOutput]:
    """An advanced step's outputs: the text of its tokens (decoded here for requests without
    stop strings, whose text no stop decision needs), logprobs. `failed` ends a request whose
    output raised (a bug met by one request's text ends only it)."""
    outputs = advanced.ready
    for req, toks, logprobs, decode in advanced.events:
        if not detok.is_active(req.request_id):
            continue  # aborted since `advance`: its final output is out
        try:
            for t in toks if decode else ():
                detok.on_token(req.request_id, t)
            outputs.append(output_of(detok, req, toks, logprobs))
        except Exception as e:
            outputs.append(failed(req, e))
    advanced.step.phases.tokens = sum(len(o.new_token_ids) for o in outputs)
    return outputs
