"""Speculation's host time, priced: what drafting costs the steps where it verifies nothing.

The budget policy prices draft rows with the cost profile. Drafting also costs host time that
no row shows, paid in every step: each request's estimates, the choice of who is worth a tree,
the tree searches, the shadow drafts that keep the estimates honest. Measured on a 2-core CPU at
4 in flight (HumanEval, Q4_1), that was 1.4 ms of an 11 ms step in steps that verified no draft
at all: a server with drafts on ran 0.9x the same server without, on steps identical on the
device. This module keeps that time in proportion, from measurements of it:

- a tree search's measured time is a price: a request is worth one only where what its drafts
  could buy pays for its rows and its search (`search_ms`, handed to the policy);
- a batch size where no plan has drafted for `max_skip` steps, or where the speed guard's tries
  of drafting keep losing (`SpeedGuard.failing`), is dormant: there, shadow drafts
  (proposed, never verified) run on an allowance of `share` of the step's time, at the measured
  cost of one, and a plan (the policy's estimates of every request, and whom a tree is worth
  searching for) that finds nothing is paid back from the same allowance: planning pauses for
  as many steps as it takes to cover the plan's measured time (at most `max_skip`). Where
  drafts run, neither is limited: shadows and plans are what bring a request back to drafting
  after a streak of misses, and at batch 1 limiting them cost 10-12% more steps for the same
  tokens;
- the step's speculation time (`spent_ms`) goes to the speed guard, whose baseline is then a
  step without speculation at all, what a server without drafts would run; so does the time
  spent judging and settling after a step where nothing runs beside it (`after_s`: a CPU's loop,
  whose forward takes the host's cores), which delays the next step as much.

Pure Python.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from batchserve.config import DraftConfig
from batchserve.speculation.speed_guard import SpeedGuard

_DEFAULTS = DraftConfig()
_KEEP = 0.9  # weight an average keeps per measurement: about the last ten


@dataclass(slots=True)
class _Average:
    """Exponential average of a measurement; None before the first."""

    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else _KEEP * self.value + (1.0 - _KEEP) * x


class HostBudget:
    """Measures speculation's host time and keeps it in proportion (module docstring)."""

    def __init__(
        self,
        share: float = _DEFAULTS.shadow_share,
        max_skip: int = _DEFAULTS.plan_backoff,
        guard: SpeedGuard | None = None,
    ) -> None:
        if not 0.0 <= share <= 1.0 or max_skip < 0:
            raise ValueError("host budget: need share in [0, 1] and max_skip >= 0")
        self.share = share
        self.max_skip = max_skip
        self.guard = guard  # None: dormancy from idle plans alone
        self._search = _Average()  # ms of one tree search for a request the policy may draft for
        self._shadow = _Average()  # ms of one shadow search
        self._step = _Average()  # ms of a whole step
        self._after = _Average()  # ms a step's judging and settling took after it, in series
        self._credit = 0.0  # shadow searches the allowance has paid for and not yet spent
        self._pauses: dict[int, int] = {}  # by batch-size bucket: steps planning still pauses
        self._idle: dict[int, int] = {}  # by batch-size bucket: steps since a plan drafted
        self.spent_s = 0.0  # this step's speculation host time so far
        # Speculation's host time after a step's wall and before the next step (judging and settling
        # in a loop that builds outputs in series): the next observed step's to pay.
        self.after_s = 0.0

    @property
    def search_ms(self) -> float:
        """What one tree search is measured to cost (0 before any)."""
        return self._search.value or 0.0

    @property
    def spent_ms(self) -> float:
        return self.spent_s * 1e3

    def new_step(self) -> None:
        self.spent_s = 0.0

    def clock(self, since: float) -> None:
        """Add the time since `since` (a `time.perf_counter()`) to this step's."""
        self.spent_s += time.perf_counter() - since

    def clock_after(self, since: float, in_series: bool) -> None:
        """Speculation's time since `since`, spent after a step's wall: beside the next forward
        (free), or in series with the steps (`after_s`)."""
        if in_series:
            self.after_s += time.perf_counter() - since

    def take_after_ms(self) -> float:
        ms, self.after_s = self.after_s * 1e3, 0.0
        self._after.add(ms)
        return ms

    def searched(self, seconds: float, shadow: bool) -> None:
        """One tree search took `seconds`; `shadow`: a shadow draft's."""
        (self._shadow if shadow else self._search).add(seconds * 1e3)

    def observe_step(self, wall_ms: float) -> None:
        if wall_ms > 0:
            self._step.add(wall_ms)

    def shadows(self, wanted: int, num_seqs: int, chunked: bool = False) -> int:
        """How many of `wanted` shadow drafts to run this step at this batch size: all of them
        where drafts ran lately (or before a step and a shadow search are measured), else as
        many as the allowance pays for."""
        step, shadow = self._step.value, self._shadow.value
        if step is None or shadow is None or shadow <= 0:
            return wanted
        if not self.dormant(num_seqs, chunked):
            return wanted
        # Unspent credit is kept up to one step's worth: a quiet spell buys no later burst.
        self._credit = min(self._credit + self.share * step / shadow, float(max(1, wanted)))
        given = min(wanted, int(self._credit))
        self._credit -= given
        return given

    def dormant(self, num_seqs: int, chunked: bool = False) -> bool:
        """No plan has drafted at this batch size for `max_skip` steps, or the guard's tries of
        drafting there keep losing (`chunked`: for steps that carry a prompt chunk)."""
        if self.guard is not None and self.guard.failing(num_seqs, chunked):
            return True
        return self._idle.get(SpeedGuard.bucket(num_seqs), 0) >= self.max_skip

    def paused(self, num_seqs: int) -> bool:
        """Whether the next step at this batch size skips planning (`may_plan`, without counting)."""
        return self._pauses.get(SpeedGuard.bucket(num_seqs), 0) > 0

    def may_plan(self, num_seqs: int) -> bool:
        """Whether this step asks the policy for drafts at this batch size (counts a paused step)."""
        key = SpeedGuard.bucket(num_seqs)
        self._idle[key] = self._idle.get(key, 0) + 1
        left = self._pauses.get(key, 0)
        if left <= 0:
            return True
        self._pauses[key] = left - 1
        return False

    def planned(self, num_seqs: int, drafted: bool, seconds: float, chunked: bool = False) -> None:
        """A plan at this batch size took `seconds` and drafted something, or nothing: then,
        where drafts are dormant, planning pauses until the allowance has paid for it (and for
        the judging and settling after a step, where they delay the next one)."""
        key, step = SpeedGuard.bucket(num_seqs), self._step.value
        if drafted:
            self._idle[key] = 0
        elif step and self.share > 0 and self.dormant(num_seqs, chunked):
            # A plan's price includes the judging and settling that serve it where they run in series.
            cost_ms = seconds * 1e3 + (self._after.value or 0.0)
            self._pauses[key] = min(self.max_skip, int(cost_ms / (self.share * step)))
