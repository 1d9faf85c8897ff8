"""The draft budget policy: how many draft tokens each request gets this step (adaptive decoding length).

Pure Python and numpy. Two inputs:
- a `CostProfile` (`cost_profile.py`): forward time against tokens in the step, measured once
  per device, dtype and model;
- an `AcceptanceTracker`: per request, an exponential moving average of how often the draft
  node at each rank (the drafter's k-th best node) ends up on the accepted path, pooled
  across requests as the prior for new ones. Where the drafter also scores its nodes (the
  trie's path frequency) and measures its match (`DraftTree.match`), a `ScoreCalibration`
  (`fits.py`) shared by all requests combines the three into one probability, so a step whose
  drafts copy a long match the trie is sure of gets more tokens than one where it is guessing,
  beyond what the request's recent history says.

A node's estimate is exactly the expected number of extra tokens it buys, so the policy can
trade tokens against milliseconds:
1. Decode-only optimum: over all requests' draft nodes sorted by expected gain, the count k*
   maximising (roots + gain(k)) / time(roots + k). This is where extra tokens stop being
   nearly free, and it gives tau = time per token at that optimum.
2. With prefill chunks in the step (whose time is spent anyway) the same nodes are valued at
   tau each: the count maximising gain(k) * tau - time(tokens + k). Without prefill this is
   the same k* as step 1.
Nodes expected to be accepted less often than `min_gain` are never drafted, so a request whose
drafts keep failing gets none; while it gets none its estimates drift back toward the pooled
prior (`explore`), so it is retried once the batch has room again.

The time of a step is the profile's, refined online from measured steps (`observe_step`), plus,
when choosing whom to search a tree for (`hopeful`), the measured host time of each search
(`StepShape.search_ms`, from `host_budget.py`).
A `SpeedGuard` (`speed_guard.py`) checks the outcome: where steps with drafts measure slower per
token than steps without at this batch size (steps with a prompt chunk judged apart), every
expected gain is divided by its hedge.
Every tuning value is a `DraftConfig` setting; `DraftBudgetPolicy.from_config` applies them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from batchserve.config import DraftConfig
from batchserve.cost_profile import CostProfile
from batchserve.speculation.acceptance import AcceptanceTracker, WindowTracker
from batchserve.speculation.fits import DecayedRidge, ScoreCalibration
from batchserve.speculation.speed_guard import SpeedGuard

_DEFAULTS = DraftConfig()  # the plain constructors' defaults are the settings'
# Floor on the tokens a step emits when dividing by them: a numerical guard, not a tuning value.
_MIN_TOKENS = 1e-9


@dataclass(frozen=True, slots=True)
class DraftCandidate:
    """A request that samples this step and could carry up to `max_tokens` draft tokens."""

    request_id: str
    max_tokens: int
    scores: tuple[float, ...] = ()  # the drafter's score of each proposed node, if any
    match: int = 0  # the tree's match length (`DraftTree.match`; 0: not measured)


@dataclass(frozen=True, slots=True)
class StepShape:
    """What the policy needs to know of a step beside its candidates."""

    num_roots: int  # requests emitting a token this step (with or without a draft)
    num_other_tokens: int = 0  # the step's other rows (prefill chunks, fixed-length drafts)
    context: float = 0.0  # mean KV length of the step's rows
    num_seqs: int | None = None  # requests in the step (None: num_roots)
    token_budget: int | None = None  # most draft tokens (None: all offered)
    chunked: bool = False  # the step carries a prompt chunk (the speed guard judges those apart)
    search_ms: float = 0.0  # host time of a request's tree search, where it is still to be paid

    @property
    def seqs(self) -> int:
        return self.num_seqs if self.num_seqs is not None else max(1, self.num_roots)


class DraftBudgetPolicy:
    """Chooses every sampling request's decoding length for one step (module docstring)."""

    def __init__(
        self,
        profile: CostProfile,
        tracker: AcceptanceTracker,
        min_gain: float = _DEFAULTS.min_gain,
        *,
        min_speedup: float = _DEFAULTS.min_speedup,
        windows: WindowTracker | None = None,
        step_cost_decay: float = _DEFAULTS.step_cost_decay,
        step_cost_ridge: float = _DEFAULTS.step_cost_ridge,
        max_scale: float = _DEFAULTS.step_cost_max_scale,
        guard: SpeedGuard | None = None,
    ) -> None:
        self.profile = profile
        self.guard = guard  # None: the model's decisions stand unchecked
        self.tracker = tracker
        self.windows = windows or WindowTracker()
        self.min_gain = min_gain
        self.min_speedup = min_speedup  # drafts must win by this much, as predicted, or none are sent
        self.planned_gain = 0.0  # expected accepted draft tokens of the last `allocate`
        # Measured decode steps against the profile, fitted online as
        #   elapsed = scale * profile + per_seq * requests + per_draft * draft rows
        # (draft rows: a decode step's rows beyond one per request). Drafts get their own
        # feature, not all rows: with drafting off every step has rows == requests, and a
        # per-row term would take half of any per-request cost, price drafts out and never
        # see a draft again to correct itself.
        # `scale` absorbs the machine running uniformly faster or slower than when it was
        # calibrated (other load, clocks); it leaves every decision unchanged, because the
        # policy compares ratios. The two overheads are engine work the forward-only profile
        # does not see (scheduling, drafting, detokenizing); they do move decisions.
        self.scale = 1.0
        self.overhead_per_seq_ms = 0.0
        self.overhead_per_draft_ms = 0.0
        self.max_scale = max_scale  # `scale` stays in [1 / max_scale, max_scale]
        # Ridge least squares toward (scale 1, no overhead), overheads never negative. Where
        # the data cannot tell a slower machine from per-request cost (every step the same
        # size), the smallest coefficients win: a scale explains a uniform slowdown with the
        # smallest one. Coefficients: (scale - 1, per_seq, per_draft).
        self._step_fit = DecayedRidge(3, step_cost_decay, step_cost_ridge, nonneg=(1, 2))
        # `upper_gains_many`'s answers by (request id, limit), while the tracker's revision stands.
        self._uppers: dict[tuple[str, int], list[float]] = {}
        self._uppers_revision = -1

    @classmethod
    def from_config(cls, profile: CostProfile, config: DraftConfig) -> DraftBudgetPolicy:
        """The policy and its acceptance tracker as the engine's draft settings ask."""
        calibration = ScoreCalibration(
            config.calibration_decay, config.calibration_prior_strength, config.calibration_clip
        )
        tracker = AcceptanceTracker(
            max(1, config.decoding_length or 0),
            config.acceptance_decay,
            config.explore,
            initial=config.initial_acceptance,
            falloff=config.initial_acceptance_falloff,
            pool_rate=config.acceptance_pool_rate,
            calibration=calibration,
        )
        windows = WindowTracker(
            config.window_initial_gain, config.acceptance_decay, config.explore, config.acceptance_pool_rate
        )
        return cls(
            profile,
            tracker,
            config.min_gain,
            min_speedup=config.min_speedup,
            windows=windows,
            step_cost_decay=config.step_cost_decay,
            step_cost_ridge=config.step_cost_ridge,
            max_scale=config.step_cost_max_scale,
            guard=SpeedGuard(
                config.guard_period, config.guard_decay, config.guard_rate, config.guard_max_hedge, config.explore
            )
            if config.speed_guard
            else None,
        )

    def upper_gains(self, request_id: str, limit: int) -> list[float]:
        """The most each of the request's first `limit` draft ranks could be worth, whatever the
        drafter's scores and match turn out to be: those clearing `min_gain`, best first. Their
        count is the most the request could be given, so there is no point in proposing more."""
        return self.upper_gains_many([(request_id, limit)])[0]

    def upper_gains_many(self, wanted: Sequence[tuple[str, int]]) -> list[list[float]]:
        """`upper_gains` of each (request id, limit), all at once (a step's requests); kept until
        the tracker's estimates next move (`settle` builds them beside the forward)."""
        if self._uppers_revision != self.tracker.revision:
            self._uppers, self._uppers_revision = {}, self.tracker.revision
        missing = [w for w in dict.fromkeys(wanted) if w not in self._uppers]
        if missing:
            floor = self.min_gain
            for w, gains in zip(missing, self.tracker.upper_gains_many(missing)):
                self._uppers[w] = sorted((g for g in gains if g >= floor), reverse=True)
        return [self._uppers[w] for w in wanted]

    def settle(self, wanted: Sequence[tuple[str, int]]) -> None:
        """Fit what the last judged steps taught and build these (request id, limit)s' upper
        gains now, off the next step's critical path."""
        self.upper_gains_many(wanted)

    def observe_step(self, num_tokens: int, context: float, num_seqs: int, elapsed_ms: float) -> None:
        """Record a measured decode step (schedule + forward + update; no prompt chunks)."""
        if num_tokens < 1 or num_seqs < 1:
            return
        drafts = float(max(0, num_tokens - num_seqs))
        predicted = self.profile.time_ms(num_tokens, context, num_seqs, draft_rows=drafts)
        beta = self._step_fit.observe((predicted, float(num_seqs), drafts), elapsed_ms - predicted)
        self.scale = min(self.max_scale, max(1.0 / self.max_scale, 1.0 + beta[0]))
        self.overhead_per_seq_ms, self.overhead_per_draft_ms = beta[1], beta[2]

    def allocate(
        self,
        candidates: Sequence[DraftCandidate],
        *,
        num_roots: int,
        num_other_tokens: int = 0,
        context: float = 0.0,
        num_seqs: int | None = None,
        token_budget: int | None = None,
        chunked: bool = False,
    ) -> dict[str, int]:
        """Draft lengths by request for a step of this shape (`StepShape`'s fields)."""
        step = StepShape(num_roots, num_other_tokens, context, num_seqs, token_budget, chunked)
        return self.allocate_step(candidates, step)

    def allocate_step(self, candidates: Sequence[DraftCandidate], step: StepShape) -> dict[str, int]:
        """Draft lengths by request: each candidate's nodes valued by its acceptance estimates
        and the drafter's scores."""
        gains = self.tracker.gains_many([(c.request_id, c.max_tokens, c.scores, c.match) for c in candidates])
        lengths, self.planned_gain = self._choose([c.request_id for c in candidates], gains, step)
        return lengths

    def hopeful(self, upper: Sequence[tuple[str, Sequence[float]]], step: StepShape) -> dict[str, int]:
        """The requests that would get a draft this step if every node were worth the most it
        could be (`upper`: each request's `upper_gains`), with the nodes each would get: the only
        ones whose trees are worth building before `allocate`. On a busy step where no draft
        pays, that is none, and the drafter is spared a tree search per request."""
        lengths, _ = self._choose([rid for rid, _ in upper], [list(g) for _, g in upper], step)
        return {rid: k for rid, k in lengths.items() if k > 0}

    def _choose(
        self, request_ids: Sequence[str], gains: Sequence[list[float]], step: StepShape
    ) -> tuple[dict[str, int], float]:
        """Draft lengths by request and the accepted tokens they are expected to buy, from each
        request's node gains (non-increasing): the module docstring's two rules."""
        num_roots, num_other_tokens, context, num_seqs = step.num_roots, step.num_other_tokens, step.context, step.seqs
        cap = step.token_budget if step.token_budget is not None else sum(map(len, gains))
        hedge = self.hedge(num_seqs, step.chunked)
        # Each request's gains are non-increasing, so sorting them all in descending order takes
        # every request's nodes as a prefix (a stable sort: ties in request order, as a merge).
        sizes = [len(gs) for gs in gains]
        total = sum(sizes)
        values = np.fromiter(itertools.chain.from_iterable(gains), float, total)  # [nodes]
        owners = np.repeat(np.arange(len(sizes)), sizes)  # [nodes] each node's request
        ranks = np.arange(total) - np.repeat(np.cumsum(sizes) - sizes, sizes)  # [nodes] rank in its request
        worth = values >= self.min_gain
        values, owners, ranks = values[worth], owners[worth], ranks[worth]
        order = np.argsort(-values, kind="stable")[: max(0, cap)]
        # gain[k]: what the first k nodes are worth, as the guard lets the policy count them
        gain = np.concatenate(([0.0], np.cumsum(values[order]) / hedge))
        ks = np.arange(len(gain))
        curve = self.profile.curve(context)
        searches = np.zeros(len(ks))  # [k] host ms of the tree searches the first k nodes need
        if step.search_ms > 0 and len(order):
            # Each request's best node starts its search: its rank 0 (gains are non-increasing and
            # the sort stable, so it comes first of the request's nodes, and a node worth less
            # than `min_gain` has none worth more after it).
            searches[1:] = step.search_ms * np.cumsum(ranks[order] == 0)

        def cost(others: int) -> np.ndarray:  # [k] predicted ms of the step with k nodes
            # Draft rows: the k nodes (fixed-length drafts among `others` would add the same
            # constant to every k, which moves no decision).
            return self._steps_ms(num_roots + others + ks, ks, context, num_seqs, curve) + searches

        # 1. Decode-only optimum and the value of a token there (argmax: the fewest nodes of a tie).
        decode = cost(0)
        rate = (num_roots + gain) / decode  # [k] tokens per ms
        best_k = int(np.argmax(rate))
        tau = decode[best_k] / max(_MIN_TOKENS, num_roots + gain[best_k])
        margin = self.min_speedup
        if rate[best_k] < (1.0 + margin) * rate[0]:
            best_k = 0  # not a clear win
        # 2. The rest of the step's rows are paid for anyway: value nodes at tau each. The win
        # asked for is the same: the time of `margin` times the roots' tokens.
        if num_other_tokens > 0:
            value = gain * tau - cost(num_other_tokens)
            best_k = int(np.argmax(value))
            if value[best_k] - value[0] < margin * num_roots * tau:
                best_k = 0
        counts = np.bincount(owners[order[:best_k]], minlength=len(sizes)).tolist()
        return dict(zip(request_ids, counts)), float(gain[best_k]) * hedge  # what they are expected to buy

    def hedge(self, num_seqs: int, chunked: bool = False) -> float:
        """What the speed guard divides expected gains by at this batch size (1: no doubt)."""
        return self.guard.hedge(num_seqs, chunked) if self.guard is not None else 1.0

    def _step_ms(self, rows: int, drafts: int, context: float, num_seqs: int, curve: np.ndarray | None = None) -> float:
        """Predicted ms of a step of `rows` rows, `drafts` of them draft (or window) rows."""
        curve = curve if curve is not None else self.profile.curve(context)
        return float(self._steps_ms(np.array([rows]), np.array([drafts]), context, num_seqs, curve)[0])

    def _steps_ms(
        self, rows: np.ndarray, drafts: np.ndarray, context: float, num_seqs: int, curve: np.ndarray
    ) -> np.ndarray:
        """`_step_ms` at every (row count, draft rows) of `rows` and `drafts` at once."""
        forward = self.scale * self.profile.times_ms(rows, context, num_seqs, curve, drafts)
        return forward + self.overhead_per_seq_ms * num_seqs + self.overhead_per_draft_ms * drafts

    def admit_windows(
        self,
        candidates: Sequence[tuple[str, int]],
        *,
        num_tokens: int,
        num_decode_tokens: int,
        num_roots: int,
        expected_tokens: float,
        context: float = 0.0,
        num_seqs: int | None = None,
        token_budget: int | None = None,
        chunked: bool = False,
    ) -> list[str]:
        """Which (request id, window rows) run this step. A window's rows buy nothing now; its
        expected later gain (`windows`) is valued at the time per token of decoding (the
        step's `num_decode_tokens` roots and draft rows, expected to emit `expected_tokens`;
        prompt chunks excluded, as in `allocate`), and it runs only where that pays for the
        time its rows add to the whole step of `num_tokens` rows. Best value per row first."""
        num_seqs = num_seqs if num_seqs is not None else max(1, num_roots)
        cap = token_budget if token_budget is not None else sum(n for _, n in candidates)
        curve = self.profile.curve(context)
        drafts = num_decode_tokens - num_roots  # the windows' rows join these
        tau = self._step_ms(num_decode_tokens, drafts, context, num_seqs, curve) / max(_MIN_TOKENS, expected_tokens)
        total = num_tokens
        now = self._step_ms(total, drafts, context, num_seqs, curve)
        ranked = sorted(candidates, key=lambda c: -self.windows.gain(c[0]) / max(1, c[1]))
        hedge = self.hedge(num_seqs, chunked)
        admitted: list[str] = []
        for rid, rows in ranked:
            gain = self.windows.gain(rid) / hedge
            if rows > cap or gain < self.min_gain:
                continue
            after = self._step_ms(total + rows, drafts + rows, context, num_seqs, curve)
            if gain * tau >= after - now:
                admitted.append(rid)
                total, drafts, now, cap = total + rows, drafts + rows, after, cap - rows
        return admitted
