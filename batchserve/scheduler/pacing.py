"""Prompt chunks beside decodes: a step that carries both takes at most (1 + `prompt_stall`) times
as long as the same decodes alone, or `UNNOTICED_MS`, whichever is more, so that streams stay
smooth while prompts are computed.

On a big model a prompt chunk costs seconds (a 30B mixture of experts on 2 cores computes a few
hundred prompt tokens a second), and every request decoding in that step waits for it: a whole
token budget of prompt made the decodes' time per token (TPOT) p99 nearly twice their median.
`PromptPacing` bounds the prompt tokens of such a step by feedback on measured wall time, as
`PromptSlack` (fairness.py) bounds a background tenant's: steps of decodes alone keep a baseline;
after a step with prompt tokens their allowance is scaled by how far the step overran its bound
(at most halved or doubled a step).

A step within `UNNOTICED_MS` is never bounded: a small model's whole budget of prompt costs less
than a stream would notice, and it keeps prefilling at full speed. Only once a step with prompt
tokens has run past that does the baseline matter: then, where no step of decodes alone has
measured it yet, or while the allowance binds, one step in `REFRESH_EVERY` with decodes carries no
prompt, so the baseline follows the batch and the contexts as they grow. Steps without decodes
take the whole budget: nobody waits on them. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchserve.records import SchedulerOutput

# Exponential average weight of the newest decode-only step in the baseline.
_BASELINE_WEIGHT = 0.25
# The allowance grows or shrinks by at most this factor from one measured step to the next.
_MAX_STEP_CHANGE = 2.0
# Steps with decodes between two that carry no prompt (the baseline's refresh), while it matters.
REFRESH_EVERY = 8
# A pause a stream does not notice: steps up to this long are never bounded.
UNNOTICED_MS = 500.0


@dataclass(slots=True)
class PromptPacing:
    """How many prompt tokens a step that carries decodes may take (see the module doc)."""

    stall: float  # SchedulerConfig.prompt_stall; inf: no bound
    budget: int  # tokens a step: the most the allowance grows to, and where it starts
    floor: int = 16  # the least it shrinks to: prompts always progress
    tokens: int = 0  # the allowance (0: the budget)
    baseline_ms: float | None = None
    _steps: int = 0  # steps with prompt tokens beside decodes since the last decode-only one
    _slow: bool = False  # a step with prompt tokens beside decodes ran past UNNOTICED_MS
    _last: tuple[SchedulerOutput, int] | None = None  # the step scheduled last, its prompt tokens

    def __post_init__(self) -> None:
        self.floor = max(1, min(self.floor, self.budget))
        self.tokens = self.tokens or self.budget

    def room(self, decodes: int) -> int | None:
        """Prompt tokens allowed in the step being scheduled, which carries `decodes` decode rows
        (None: no bound). 0 where the step measures the baseline."""
        if decodes == 0 or math.isinf(self.stall) or not self._slow:
            return None
        binding = self.baseline_ms is None or self.tokens < self.budget
        if binding and self._steps >= REFRESH_EVERY:
            return 0
        return None if self.baseline_ms is None else self.tokens

    def scheduled(self, out: SchedulerOutput, decodes: int, prompt_tokens: int) -> None:
        """The step just scheduled: its decode rows and prompt tokens (steps with decodes are measured)."""
        if decodes == 0 or math.isinf(self.stall):
            self._last = None
            return
        self._last = (out, prompt_tokens)
        self._steps = 0 if prompt_tokens == 0 else self._steps + 1

    def rebind(self, scheduled: SchedulerOutput, runs: SchedulerOutput) -> None:
        """The step scheduled last runs as `runs` (its drafts hung off it): measured as that."""
        if self._last is not None and self._last[0] is scheduled:
            self._last = (runs, self._last[1])

    def observe(self, out: SchedulerOutput, seconds: float) -> None:
        """The measured wall time of a step this scheduled (others are ignored)."""
        last, self._last = self._last, None
        if last is None or last[0] is not out:
            return
        ms, prompt = seconds * 1000.0, last[1]
        if prompt == 0:
            base = self.baseline_ms
            self.baseline_ms = ms if base is None else base + _BASELINE_WEIGHT * (ms - base)
            return
        self._slow = self._slow or ms > UNNOTICED_MS
        if self.baseline_ms is None:
            return  # unbounded until a step of decodes alone is measured
        base = self.baseline_ms
        excess, room = ms - base, max(self.stall * base, UNNOTICED_MS - base)
        scale = _MAX_STEP_CHANGE if excess <= room / _MAX_STEP_CHANGE else max(1 / _MAX_STEP_CHANGE, room / excess)
        sized = round(prompt * scale)
        if excess <= room:  # room left: never below what was allowed (the chunk may have been short)
            sized = max(sized, self.tokens)
        self.tokens = max(self.floor, min(self.budget, sized))
