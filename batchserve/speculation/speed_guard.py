"""The speed guard: measured proof, per batch size, that drafting makes decoding faster.

The budget policy (`budget.py`) decides from a model of what drafts are worth and what rows
cost. A model can be wrong where it matters most: where drafting is roughly break-even (a busy
batch on a CPU, where every row costs real time), a small error in either estimate makes every
step slower than not drafting at all. The guard checks the outcome instead of the model:

- per batch size (requests in a step, in power-of-two buckets), milliseconds per emitted token
  over the recent steps *with* draft rows and over those *without* (exponential averages);
- the baseline is a step without speculation at all: a step without drafts is counted without
  the host time speculation's bookkeeping spent in it (`host_budget.py`), and that time is
  charged to the next step with drafts (at most doubling it): drafting pays for all it costs,
  and must beat what a server without drafts would run, not steps that paid for drafts they
  did not verify;
- steps that carry a prompt chunk are judged apart from decode-only ones: the chunk's rows
  dominate their time, so the two kinds are not comparable, but within each kind the chunks fall
  on steps with and without drafts alike. Under an overloaded server nearly every step carries
  one, and a guard of decode-only steps would never see a step;
- a step without drafts is due after `period` steps with them (four times as long while drafts
  win clearly), so the baseline stays fresh; the policy's shadow drafts still get judged in it;
- `hedge(num_seqs)` is a factor >= 1 that the policy divides every draft's expected gain by. It
  rises while steps with drafts are slower per token than steps without, and falls back to 1
  while they are faster; with drafts off (the hedge at its highest) it relaxes toward 1 on every
  step without them, so drafting is tried again when the traffic changes; more slowly after
  tries that failed in a row, so a cost model that is wrong does not pay for a probe every few
  steps for good.

Both averages come from the same run on the same machine, interleaved, so a busy or slow
machine moves both alike: the ratio is what counts. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from batchserve.config import DraftConfig

_DEFAULTS = DraftConfig()
# While steps with drafts emit tokens at most this fraction of the time of steps without, the
# baseline is refreshed four times less often: drafts win by far more than the noise.
_CLEAR_WIN = 0.8
_CLEAR_WIN_PERIODS = 4
# Drafts that keep failing where the cost model is wrong would cost a probe every few steps for
# good: each failed probe in a row (past the first) halves how fast the hedge relaxes, down to
# 1/2**_MAX_BACKOFF. One probe that wins resets it.
_MAX_BACKOFF = 3
# This many failed probes in a row make the batch size dormant (`host_budget.py`): drafting there
# keeps losing, so its bookkeeping is kept to an allowance until a probe wins.
_FAILING_PROBES = 2
_MIN_MS = 1e-3  # floor on a baseline step's time: a numerical guard against a clock that stalls


@dataclass(slots=True)
class _Speed:
    """Exponential averages of a step's milliseconds and of the tokens it emitted: their ratio is
    ms per token over the recent steps (a ratio of sums, so one slow one-token step does not
    outweigh ten fast ones). Empty before the first observation."""

    ms: float = 0.0
    tokens: float = 0.0

    def add(self, ms: float, tokens: int, keep: float) -> None:
        if self.tokens == 0.0:
            self.ms, self.tokens = ms, float(tokens)
        else:
            self.ms = keep * self.ms + (1.0 - keep) * ms
            self.tokens = keep * self.tokens + (1.0 - keep) * tokens

    @property
    def ms_per_token(self) -> float | None:
        return self.ms / self.tokens if self.tokens > 0 else None


@dataclass(slots=True)
class LoadState:
    """What the guard knows at one batch size."""

    drafted: _Speed = field(default_factory=_Speed)
    plain: _Speed = field(default_factory=_Speed)
    hedge: float = 1.0
    since_plain: int = 0  # steps with drafts since the last one without
    failed_probes: int = 0  # drafted steps after a plain one, slower per token than plain, in a row
    unpaid_ms: float = 0.0  # speculation's host time in plain steps since the last drafted one

    def ratio(self) -> float | None:
        """ms per token with drafts over without (< 1: drafts pay), once both are measured."""
        drafted, plain = self.drafted.ms_per_token, self.plain.ms_per_token
        if drafted is None or plain is None or plain <= 0:
            return None
        return drafted / plain


class SpeedGuard:
    """Per batch size, the measured speed of steps with and without drafts (module docstring)."""

    def __init__(
        self,
        period: int = _DEFAULTS.guard_period,
        keep: float = _DEFAULTS.guard_decay,
        rate: float = _DEFAULTS.guard_rate,
        max_hedge: float = _DEFAULTS.guard_max_hedge,
        relax: float = _DEFAULTS.explore,
    ) -> None:
        if period < 1 or not 0 <= keep < 1 or rate <= 0 or max_hedge < 1 or not 0 <= relax <= 1:
            raise ValueError("speed guard: need period >= 1, keep in [0, 1), rate > 0, max_hedge >= 1, relax in [0, 1]")
        self.period = period
        self.keep = keep  # weight an average keeps per observation
        self.rate = rate  # how far one step's ratio moves the hedge (in log space)
        self.max_hedge = max_hedge
        self.relax = relax  # per step without drafts, how far the hedge drifts back toward 1
        self.loads: dict[int, LoadState] = {}  # decode-only steps, by batch-size bucket
        self.chunked_loads: dict[int, LoadState] = {}  # steps with a prompt chunk

    @staticmethod
    def bucket(num_seqs: int) -> int:
        """Batch sizes that share a state: 1, 2, 3-4, 5-8, 9-16, ..."""
        return 1 << max(0, num_seqs - 1).bit_length()

    def _state(self, num_seqs: int, chunked: bool) -> LoadState:
        loads, key = self.chunked_loads if chunked else self.loads, self.bucket(num_seqs)
        state = loads.get(key)
        if state is None:
            state = loads[key] = LoadState()
        return state

    def _known(self, num_seqs: int, chunked: bool) -> LoadState | None:
        return (self.chunked_loads if chunked else self.loads).get(self.bucket(num_seqs))

    def hedge(self, num_seqs: int, chunked: bool = False) -> float:
        state = self._known(num_seqs, chunked)
        return state.hedge if state is not None else 1.0

    def failing(self, num_seqs: int, chunked: bool = False) -> bool:
        """Tries of drafting at this batch size keep losing: two or more in a row."""
        state = self._known(num_seqs, chunked)
        return state is not None and state.failed_probes >= _FAILING_PROBES

    def wants_plain(self, num_seqs: int, chunked: bool = False) -> bool:
        """Should this step (`chunked`: it carries a prompt chunk) run without drafts, to measure
        the baseline at this batch size?"""
        state = self._known(num_seqs, chunked)
        if state is None or state.drafted.ms_per_token is None:
            return False  # nothing to compare yet: drafting first gives the other side
        if state.plain.ms_per_token is None:
            return True
        ratio = state.ratio()
        periods = _CLEAR_WIN_PERIODS if ratio is not None and ratio <= _CLEAR_WIN else 1
        return state.since_plain >= self.period * periods

    def observe(
        self,
        num_seqs: int,
        tokens: int,
        elapsed_ms: float,
        drafted: bool,
        chunked: bool = False,
        speculation_ms: float = 0.0,
        after_ms: float = 0.0,
    ) -> None:
        """A step of `num_seqs` requests emitted `tokens` in `elapsed_ms`; `drafted`: it verified
        draft rows (a step without any is the baseline); `chunked`: it carried a prompt chunk;
        `speculation_ms`: of its time, what speculation's own bookkeeping took; `after_ms`: its
        bookkeeping outside `elapsed_ms` that delayed the step all the same. The baseline is a
        step as a server without speculation would run it: without either, which the next
        drafted step pays."""
        if num_seqs < 1 or tokens < 1 or elapsed_ms <= 0:
            return
        state = self._state(num_seqs, chunked)
        if not drafted:
            state.plain.add(max(elapsed_ms - speculation_ms, _MIN_MS), tokens, self.keep)
            state.unpaid_ms += speculation_ms + after_ms
            state.since_plain = 0
            # Back off: after each failed probe past the first, drafting is retried half as soon.
            relax = self.relax / 2 ** min(_MAX_BACKOFF, max(0, state.failed_probes - 1))
            state.hedge = 1.0 + (state.hedge - 1.0) * (1.0 - relax)
            return
        elapsed_ms += after_ms
        elapsed_ms += min(state.unpaid_ms, elapsed_ms)
        state.unpaid_ms = 0.0
        plain = state.plain.ms_per_token
        if state.since_plain == 0 and plain is not None:  # the first drafted step after a plain one
            state.failed_probes = state.failed_probes + 1 if elapsed_ms / tokens > plain else 0
        state.drafted.add(elapsed_ms, tokens, self.keep)
        state.since_plain += 1
        ratio = state.ratio()
        if ratio is not None:  # integral control toward ratio <= 1: slower with drafts, hedge more
            state.hedge = min(self.max_hedge, max(1.0, state.hedge * math.exp(self.rate * (ratio - 1.0))))
