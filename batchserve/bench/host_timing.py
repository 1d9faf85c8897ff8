"""The host side of a step, measured alone: the engine over `host.py`'s stand-in forward, which
costs nothing, so what is left of a step is schedule + prepare + verify + commit (`measure_host`);
and the same engine on an emulated asynchronous device (`host.EmulatedDevice`), where the forward
takes a GPU's time and the pipelined loop builds one step's outputs while the next one's forward
runs (`measure_emulated`). Read through the public API: the engine's step listeners (`StepPhases`
per step) and its outputs; `host.py` builds the engine and hands over the pipelined loop.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from batchserve import SamplingParams, Submission, heap
from batchserve.bench.host import device_seconds, pipeline, seated, stand_in_engine
from batchserve.bench.served_loop import HOST_PHASES
from batchserve.records import SchedulerOutput, StepPhases


class HostStats(NamedTuple):
    """Host milliseconds per step (medians over steps with every seat taken)."""

    requests: int  # requests in flight in the measured steps
    steps: int  # steps measured
    phase_ms: dict[str, float]  # median ms per step of each host phase
    host_ms: float  # median of schedule + prepare + verify + commit per step
    rows: float  # mean rows per step (roots, draft nodes)
    tokens_per_step: float  # mean tokens a request emitted per step


@dataclass(slots=True)
class _Steps:
    seats: int
    phases: list[StepPhases]
    rows: list[int]

    def add(self, out: SchedulerOutput, phases: StepPhases) -> None:
        # Full steps only, without a prompt chunk: the steady state a replayed step serves.
        if len(out.requests) == self.seats and all(len(r.token_ids) == 1 for r in out.requests):
            self.phases.append(phases)
            self.rows.append(out.num_tokens)


def measure_host(
    core: Any, prompts: Sequence[Sequence[int]], requests: int, max_new_tokens: int, decoding_length: int | None = None
) -> HostStats:
    """Run `prompts` through `core` (an EngineCore over a StandInModel) `requests` at a time, each
    to `max_new_tokens`, and report the host phases of the full steps."""
    seen = _Steps(requests, [], [])
    core.step_listeners.append(seen.add)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, decoding_length=decoding_length)
    queue = list(prompts)
    emitted = 0
    try:
        with heap.settled():  # as `batchserve serve` runs: no full collection over earlier runs' engines
            while queue or core.has_work():
                while queue and seated(core) < requests:
                    core.add_request(Submission(list(queue.pop(0)), params))
                emitted += sum(len(o.new_token_ids) for o in core.step())
    finally:
        core.step_listeners.remove(seen.add)
    if not seen.phases:
        raise ValueError(f"no step ran {requests} requests at once: give at least {requests} prompts")
    phase_ms = {n: statistics.median(getattr(p, n) for p in seen.phases) * 1e3 for n in HOST_PHASES}
    host = statistics.median(sum(getattr(p, n) for n in HOST_PHASES) for p in seen.phases) * 1e3
    tokens = sum(p.tokens for p in seen.phases) / (len(seen.phases) * requests)
    return HostStats(requests, len(seen.phases), phase_ms, host, statistics.fmean(seen.rows), tokens)


def time_host(
    prompts: Sequence[Sequence[int]], tokenizer: Any, vocab: int, points: Sequence[tuple[int, int]], max_new_tokens: int
) -> list[HostStats]:
    """HostStats at each (requests, decoding length) point, each on a fresh engine."""
    out = []
    for requests, length in points:
        core = stand_in_engine(prompts, tokenizer, vocab, requests, length)
        out.append(measure_host(core, prompts, requests, max_new_tokens))
    return out


class EmulatedStats(NamedTuple):
    """A run on the emulated device: what the host adds to its steps, and what comes out."""

    requests: int  # requests in flight at most
    pipelined: bool
    steps: int  # full steps measured (every seat taken, no prompt chunk)
    critical_ms: float  # median host ms a full step spends in series with the device
    outputs_ms: float  # median ms a full step spends building outputs (beside the forward when pipelined)
    device_ms: float  # mean emulated forward ms a step
    wall_ms: float  # mean wall ms a step, every step of the run
    tokens_per_s: float  # tokens emitted over the run's wall time
    tokens_per_step: float  # mean tokens a request emitted per full step
    draft_rows: float  # mean draft rows a full step


def measure_emulated(
    core: Any, prompts: Sequence[Sequence[int]], requests: int, max_new_tokens: int, pipelined: bool
) -> EmulatedStats:
    """Run `prompts` through `core` (its runner an EmulatedDevice) `requests` at a time, with the
    pipelined loop or the sequential one. A full step's critical path is schedule + prepare +
    verify + commit, and building its outputs too where the loop is sequential."""
    seen = _Steps(requests, [], [])
    core.step_listeners.append(seen.add)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    queue, pipe = list(prompts), pipeline(core)
    emitted = steps = 0
    try:
        # As `batchserve serve` runs: a full collection walking the earlier runs' engines, landing
        # in a drafted step, made the speed guard stop drafting for the rest of a run.
        with heap.settled():
            start = time.perf_counter()
            while queue or pipe.has_work():
                while queue and seated(core) < requests:
                    core.add_request(Submission(list(queue.pop(0)), params))
                outs = pipe.step() if pipelined else core.step()
                emitted += sum(len(o.new_token_ids) for o in outs)
                steps += 1
            wall = time.perf_counter() - start
    finally:
        core.step_listeners.remove(seen.add)
    if not seen.phases:
        raise ValueError(f"no step ran {requests} requests at once: give at least {requests} prompts")
    host = [*HOST_PHASES] if pipelined else [*HOST_PHASES, "outputs"]
    critical = statistics.median(sum(getattr(p, n) for n in host) for p in seen.phases) * 1e3
    outputs = statistics.median(p.outputs for p in seen.phases) * 1e3
    tokens = sum(p.tokens for p in seen.phases) / (len(seen.phases) * requests)
    drafts = statistics.fmean(seen.rows) - requests
    num_steps = core.num_steps or 1
    return EmulatedStats(
        requests, pipelined, len(seen.phases), critical, outputs, device_seconds(core) * 1e3 / num_steps,
        wall * 1e3 / max(1, steps), emitted / wall, tokens, drafts,
    )  # fmt: skip
