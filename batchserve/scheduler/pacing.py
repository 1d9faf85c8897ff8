"""Prompt chunks beside decodes: a step that carries both takes at most (1 + `prompt_stall`) times
as long as the same decodes alone, or `UNNOTICED_MS`, whichever is more, so that streams stay
smooth while prompts are computed.

On a big model a prompt chunk costs seconds (a 30B mixture of experts on 2 cores: a 512-token
step about 7 s), and every request decoding in that step waits for it: a whole token budget of
prompt made the decodes' time per token (TPOT) p99 nearly twice their median. `PromptPacing`
sizes the prompt tokens of such a step from two measured figures, as `PromptSlack` (fairness.py)
sizes a background tenant's from measured steps, not a device model: the time of a step of
decodes alone (the baseline) and what a prompt token adds to a step (from every step with prompt
tokens). A step within `UNNOTICED_MS` is never bounded: a small model's whole budget of prompt
costs less than a stream would notice, and it keeps prefilling at full speed. Once a step with
prompt tokens has run past that, the next step with decodes carries no prompt where no baseline
is measured yet, and while the bound binds one step in `REFRESH_EVERY` does the same, so the
baseline follows the batch and the contexts as they grow. Steps without decodes take the whole
budget: nobody waits on them. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchserve.records import SchedulerOutput

# Exponential average weight of the newest measurement in the baseline and in a token's cost.
_WEIGHT = 0.25
# Steps with decodes between two that carry no prompt (the baseline's refresh), while it binds.
REFRESH_EVERY = 8
# A pause a stream does not notice: steps up to this long are never bounded.
UNNOTICED_MS = 500.0


@dataclass(slots=True)
class PromptPacing:
    """How many prompt tokens a step that carries decodes may take (see the module doc)."""

    stall: float  # SchedulerConfig.prompt_stall; inf: no bound
    budget: int  # tokens a step: the most it allows
    floor: int = 16  # the least it allows: prompts always progress
    baseline_ms: float | None = None  # a step of decodes alone
    token_ms: float | None = None  # what a prompt token adds to a step
    _steps: int = 0  # steps with prompt tokens beside decodes since the last decode-only one
    _slow: bool = False  # a step with prompt tokens ran past UNNOTICED_MS
    _last: tuple[SchedulerOutput, int, int] | None = None  # the step scheduled last, its decodes and prompt

    def __post_init__(self) -> None:
        self.floor = max(1, min(self.floor, self.budget))

    @property
    def tokens(self) -> int:
        """The prompt tokens a step beside decodes may take now (the budget until measured)."""
        if self.baseline_ms is None or self.token_ms is None:
            return self.budget
        target = max((1 + self.stall) * self.baseline_ms, UNNOTICED_MS)
        fits = (target - self.baseline_ms) / max(self.token_ms, 1e-6)
        return int(max(self.floor, min(self.budget, fits)))

    def room(self, decodes: int) -> int | None:
        """Prompt tokens allowed in the step being scheduled, which carries `decodes` decode rows
        (None: no bound). 0 where the step measures the baseline."""
        if decodes == 0 or math.isinf(self.stall) or not self._slow:
            return None
        if self.baseline_ms is None or (self.tokens < self.budget and self._steps >= REFRESH_EVERY):
            return 0
        return self.tokens

    def scheduled(self, out: SchedulerOutput, decodes: int, prompt_tokens: int) -> None:
        """The step just scheduled: its decode rows and prompt tokens."""
        if math.isinf(self.stall) or (decodes == 0 and prompt_tokens == 0):
            self._last = None
            return
        self._last = (out, decodes, prompt_tokens)
        if decodes:
            self._steps = 0 if prompt_tokens == 0 else self._steps + 1

    def rebind(self, scheduled: SchedulerOutput, runs: SchedulerOutput) -> None:
        """The step scheduled last runs as `runs` (its drafts hung off it): measured as that."""
        if self._last is not None and self._last[0] is scheduled:
            self._last = (runs, *self._last[1:])

    def observe(self, out: SchedulerOutput, seconds: float) -> None:
        """The measured wall time of a step this scheduled (others are ignored)."""
        last, self._last = self._last, None
        if last is None or last[0] is not out:
            return
        ms, decodes, prompt = seconds * 1000.0, last[1], last[2]
        if prompt == 0:
            self.baseline_ms = _average(self.baseline_ms, ms)
            return
        self._slow = self._slow or ms > UNNOTICED_MS
        # Beside decodes, what the prompt added over their baseline; alone, the whole step (its
        # one-row cost is small next to a chunk's).
        added = ms - self.baseline_ms if decodes and self.baseline_ms is not None else ms
        self.token_ms = _average(self.token_ms, max(0.0, added) / prompt)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + _WEIGHT * (new - old)
