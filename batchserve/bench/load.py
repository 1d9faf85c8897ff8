"""Open-loop load: requests arrive on a Poisson schedule whatever the engine's speed, as users
of a public endpoint do (a closed loop, `--batch-sizes`, waits for a seat to free instead).
A request's TTFT counts from its scheduled arrival, so queueing behind a busy step counts."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchserve import Submission
from batchserve.request import Request, RequestOutput, RequestStats, SamplingParams

if TYPE_CHECKING:
    from batchserve import LLM


@dataclass(slots=True)
class Arrived:
    """One open-loop request's result, as `LLM.generate` reports one: its tokens, its stats, and
    when (on `time.monotonic`'s clock) its first token, each step's tokens and its end arrived."""

    request: Request
    token_times: list[float] = field(default_factory=list)  # when each step with new tokens arrived
    token_ids: list[int] = field(default_factory=list)  # its output, once finished
    first_token_time: float = 0.0
    finish_time: float = 0.0

    @property
    def stats(self) -> RequestStats:
        return self.request.stats

    def add(self, out: RequestOutput, now: float) -> None:
        if out.new_token_ids:
            self.token_times.append(now)
        if out.finished:
            self.token_ids = list(self.request.output_token_ids)
            self.first_token_time = self.token_times[0] if self.token_times else now
            self.finish_time = now


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """`n` arrival times in seconds from 0 (the first at 0), exponential gaps of mean 1/`rate`;
    the same for a given seed, so every method sees the same schedule."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(n):
        times.append(t)
        t += rng.expovariate(rate) if i + 1 < n else 0.0
    return times


def open_loop(
    llm: LLM,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    arrivals: list[float],
    references: list[str | None] | None = None,
) -> tuple[list[Arrived], list[float], float]:
    """(results in prompt order, each request's scheduled arrival on the results' clock, wall
    seconds from the first arrival to the last finish). Between steps, every request whose time
    has come is added; an idle engine sleeps until the next arrival."""
    if len(arrivals) != len(prompts):
        raise ValueError(f"{len(arrivals)} arrival times for {len(prompts)} prompts")
    core, loop = llm.engine, llm.loop  # the loop that serves
    start = time.monotonic()
    due = [start + a for a in arrivals]
    pending: dict[str, Arrived] = {}
    results: dict[str, Arrived] = {}
    ids: list[str] = []
    nxt = 0
    try:
        while nxt < len(prompts) or pending:
            now = time.monotonic()
            while nxt < len(prompts) and due[nxt] <= now:
                refs = references[nxt] if references is not None else None
                p = params[nxt] if isinstance(params, list) else params
                req = core.add_request(Submission(prompts[nxt], p, references=[refs] if refs else ()))
                pending[req.request_id] = Arrived(req)
                ids.append(req.request_id)
                nxt += 1
            if not loop.has_work():
                time.sleep(max(0.0, due[nxt] - time.monotonic()))
                continue
            for out in loop.step():
                pending[out.request_id].add(out, time.monotonic())
                if out.finished:
                    results[out.request_id] = pending.pop(out.request_id)
    finally:
        loop.flush()  # interrupted: outputs still owed go nowhere, and what is left is freed
        for rid in pending:
            core.abort(rid)
    ordered = [results[i] for i in ids]
    return ordered, due, max(r.finish_time for r in ordered) - start


def open_loop_latencies(results: list[Any], due: list[float]) -> tuple[list[float], list[float]]:
    """(TTFTs from each scheduled arrival, TPOTs of the requests with 2+ tokens)."""
    ttfts = [r.first_token_time - d for r, d in zip(results, due)]
    tpots = [(r.finish_time - r.first_token_time) / (len(r.token_ids) - 1) for r in results if len(r.token_ids) > 1]
    return ttfts, tpots
