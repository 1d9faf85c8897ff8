"""What drafts are worth, learned per request: acceptance by draft rank, and a Jacobi window's gain.

Pure Python and numpy. The budget policy (`budget.py`) turns these estimates into draft lengths.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from batchserve.config import DraftConfig
from batchserve.speculation.fits import ScoreCalibration, non_increasing, non_increasing_rows
from batchserve.trees import MATCH_CAP

_DEFAULTS = DraftConfig()  # the plain constructors' defaults are the settings'
# Draft scopes whose pooled prior is kept (least recently used out first; a scope let go starts
# again from the first guess). A prior is a few hundred bytes.
MAX_SCOPE_PRIORS = 4096


def _monotone_rows(rows: Sequence[Sequence[float]]) -> list[list[float]]:
    """`non_increasing` of each row (lengths may differ), in one call: the same bits."""
    width = max(map(len, rows), default=0)
    padded = np.full((len(rows), width), -1.0)  # below every probability: the padding never pools
    for k, row in enumerate(rows):
        padded[k, : len(row)] = row
    fitted = non_increasing_rows(padded).tolist()
    return [fit[: len(row)] for fit, row in zip(fitted, rows)]


def _isolated(request_id: str) -> str:
    """The prior key of a request that shares nothing (its scope is None): its own."""
    return "\0" + request_id


class AcceptanceTracker:
    """EMA per request and draft rank of "this node was on the accepted path".

    New requests start from a prior pooled over their draft scope (`begin`; the default scope ""
    for requests never begun): one tenant's requests never move where another's start, so its
    draft lengths tell nothing of another tenant's traffic, and a tenant whose drafts fail on
    purpose slows only its own. The score calibration stays pooled: it fits the model's
    confidence, not any tenant's text."""

    def __init__(
        self,
        max_rank: int,
        decay: float = _DEFAULTS.acceptance_decay,
        explore: float = _DEFAULTS.explore,
        *,
        initial: float = _DEFAULTS.initial_acceptance,
        falloff: float = _DEFAULTS.initial_acceptance_falloff,
        pool_rate: float = _DEFAULTS.acceptance_pool_rate,
        calibration: ScoreCalibration | None = None,
    ) -> None:
        if max_rank < 1:
            raise ValueError(f"max_rank must be >= 1, got {max_rank}")
        self.decay = decay  # weight of the newest observation
        self.explore = explore  # pull toward the prior per step without a draft
        self.pool_rate = pool_rate  # how fast the pool moves, relative to one request
        # Before any evidence: a geometric guess, optimistic enough that drafting starts.
        self.initial = [initial * falloff**j for j in range(max_rank)]
        # Pooled over each scope's requests: where its new requests start.
        self._priors: OrderedDict[str, list[float]] = OrderedDict({"": list(self.initial)})
        self._scopes: dict[str, str] = {}  # request id -> its prior's key
        self.calibration = calibration or ScoreCalibration()  # for drafts whose nodes carry scores
        self._est: dict[str, list[float]] = {}
        # Steps without a draft not yet applied (`skipped`): by request, and by prior key for the pool.
        self._skips: dict[str, int] = {}
        self._pool_skips: dict[str, int] = {}
        self._gains: dict[str, list[float]] = {}  # non_increasing(_est[rid]), until the next observe
        # upper_gains at every rank by request, until the next observation changes any estimate
        # (the pool's and the calibration's move with each): built beside the forward (`settle`).
        self._upper: dict[str, list[float]] = {}
        self.revision = 0  # counts the changes to any estimate: what reads them may cache until it moves

    @property
    def prior(self) -> list[float]:
        """The default scope's prior (requests never begun in a scope)."""
        return self._priors[""]

    def begin(self, request_id: str, scope: str | None) -> None:
        """`request_id` drafts in `scope` (None: alone): it starts from, and teaches, that scope's prior."""
        self._scopes[request_id] = _isolated(request_id) if scope is None else scope

    def _prior(self, request_id: str) -> list[float]:
        key = self._scopes.get(request_id, "")
        prior = self._priors.get(key)
        if prior is None:
            prior = self._priors[key] = list(self.initial)
            while len(self._priors) > MAX_SCOPE_PRIORS:
                oldest = next(k for k in self._priors if k)  # the default scope stays
                del self._priors[oldest]
                self._pool_skips.pop(oldest, None)
        else:
            self._priors.move_to_end(key)
        owed = self._pool_skips.pop(key, 0)
        if owed:  # the pool's drift toward the first guess, `owed` times over
            f = (1.0 - self.explore * self.pool_rate) ** owed
            prior[:] = [i + f * (q - i) for q, i in zip(prior, self.initial)]
        return prior

    def _estimates(self, request_id: str) -> list[float] | None:
        """The request's estimates with its skipped steps' drift toward its prior applied."""
        est = self._est.get(request_id)
        owed = self._skips.pop(request_id, 0)
        if est is not None and owed:
            f = (1.0 - self.explore) ** owed
            est[:] = [q + f * (e - q) for e, q in zip(est, self._prior(request_id))]
        return est

    def _monotone(self, request_id: str) -> list[float]:
        est = self._estimates(request_id)
        if est is None:
            return non_increasing(self._prior(request_id))  # the pool moves with every observation: not cached
        gains = self._gains.get(request_id)
        if gains is None:
            gains = self._gains[request_id] = non_increasing(est)
        return gains

    @property
    def max_rank(self) -> int:
        return len(self.initial)

    def gains(self, request_id: str, n: int, scores: Sequence[float] = (), match: int = 0) -> list[float]:
        """Expected extra tokens of the request's first `n` draft nodes, non-increasing.
        With the drafter's `scores` for those nodes, each is calibrated against its score and
        the tree's `match` length."""
        if not scores:
            return self._monotone(request_id)[:n]
        ests = (self._estimates(request_id) or self._prior(request_id))[: min(n, len(scores))]
        return non_increasing(self.calibration.probs_each(ests, scores[: len(ests)], match))

    def gains_many(self, candidates: Sequence[tuple[str, int, Sequence[float], int]]) -> list[list[float]]:
        """`gains` of each (request id, n, scores, match): a step's trees in one set of array
        operations (the same numbers as one call each)."""
        scored = [c for c in candidates if c[2]]  # the rest: their rank estimates alone (`gains`)
        ests = [(self._estimates(rid) or self._prior(rid))[: min(n, len(scores))] for rid, n, scores, _ in scored]
        probs = self.calibration.probs_of_trees(
            ests, [scores[: len(e)] for (_, _, scores, _), e in zip(scored, ests)], [m for *_, m in scored]
        )
        trees = iter(_monotone_rows(probs))
        return [next(trees) if scores else self._monotone(rid)[:n] for rid, n, scores, _ in candidates]

    def upper_gains(self, request_id: str, n: int) -> list[float]:
        """The most the first `n` nodes could be worth whatever the drafter's scores and match
        turn out to be: what is worth proposing before the tree exists. Optimistic on purpose:
        a request searched is a tree judged to its depth (evidence for its deep ranks), and a
        search costs far less than a forward row. Measured against using each request's match
        before the search: exact repeats at 16 running drafted 3.3-3.8 tokens a step in their
        second round that way, 4.15 this way."""
        return self.upper_gains_many([(request_id, n)])[0]

    def upper_gains_many(self, wanted: Sequence[tuple[str, int]]) -> list[list[float]]:
        """`upper_gains` of each (request id, n): the rows `settle` built, the missing ones in one
        set of array operations."""
        self.settle([rid for rid, _ in wanted])
        return [self._upper[rid][:n] for rid, n in wanted]

    def settle(self, request_ids: Iterable[str]) -> None:
        """Fit what the last observations taught and build these requests' upper gains now, so
        that the next step's `upper_gains_many` only reads them (the engine calls this after
        judging a step, beside the next forward)."""
        missing = [rid for rid in dict.fromkeys(request_ids) if rid not in self._upper]
        if not missing:
            return
        cal = self.calibration
        # The fit is monotone in the score and in log2(1 + match): the best case is at one end.
        best_score = 1.0 if cal.weights[1] >= 0 else 0.0
        match = MATCH_CAP if cal.weights[3] >= 0 else 1
        ests = self._estimate_rows(missing)  # [requests, max_rank]
        probs = cal.prob_array(ests, best_score, match)
        upper = np.maximum(non_increasing_rows(ests), probs).tolist()  # `_monotone` of each row, to the bit
        self._upper.update(zip(missing, upper))

    def _estimate_rows(self, request_ids: list[str]) -> np.ndarray:
        """[requests, max_rank]: what `_estimates` (or the prior) would give each, the skipped steps'
        drift computed for all rows at once and left owed (the same arithmetic: the same bits)."""
        priors = [self._prior(rid) for rid in request_ids]
        ests = np.array([self._est.get(rid) or prior for rid, prior in zip(request_ids, priors)])
        owed = [self._skips.get(rid, 0) if rid in self._est else 0 for rid in request_ids]
        due = [k for k, n in enumerate(owed) if n]
        if due:
            unique = {id(priors[k]): priors[k] for k in due}  # a scope's requests share its prior
            row_of = {key: j for j, key in enumerate(unique)}
            p = np.array(list(unique.values()))[[row_of[id(priors[k])] for k in due]]  # [due, max_rank]
            f = np.array([(1.0 - self.explore) ** owed[k] for k in due])[:, None]
            ests[due] = p + f * (ests[due] - p)
        return ests

    def observe(
        self,
        request_id: str,
        num_offered: int,
        accepted_ranks: Iterable[int],
        scores: Sequence[float] = (),
        match: int = 0,
    ) -> None:
        """Record one verification: ranks [0, num_offered) were drafted, `accepted_ranks` hit;
        `scores`: the drafter's score of each drafted node, if it gave them; `match`: the
        tree's match length."""
        est = self._record(request_id, 0, num_offered, accepted_ranks, scores, match)
        # Ranks not drafted drift back: the request's toward the pool's, and the pool's toward
        # the initial guess. Without the second, a streak of failures could silence every
        # request for good (no drafts, so no evidence that drafts would pay again). As slices:
        # the same arithmetic as a loop over the ranks, at a third of its cost.
        n, a, b = num_offered, self.explore, self.explore * self.pool_rate  # n past the ranks: no-ops
        prior = self._prior(request_id)
        est[n:] = [e + a * (p - e) for e, p in zip(est[n:], prior[n:])]
        prior[n:] = [p + b * (i - p) for p, i in zip(prior[n:], self.initial[n:])]

    def observe_late(
        self,
        request_id: str,
        start: int,
        stop: int,
        accepted_ranks: Iterable[int],
        scores: Sequence[float] = (),
        match: int = 0,
    ) -> None:
        """Record ranks [start, stop) of a tree proposed in an earlier step that later steps'
        tokens decided (`judging.py`); `scores` and `match`: theirs. The ranks' drift was that
        step's."""
        self._record(request_id, start, stop, accepted_ranks, scores, match)

    def _record(
        self,
        request_id: str,
        start: int,
        stop: int,
        accepted_ranks: Iterable[int],
        scores: Sequence[float],
        match: int = 0,
    ) -> list[float]:
        """The EMA step of ranks [start, stop) (the request's and, slower, the pool's) and the
        score calibration's; the request's estimates."""
        prior, est = self._prior(request_id), self._estimates(request_id)
        est = est if est is not None else self._est.setdefault(request_id, list(prior))
        self._gains.pop(request_id, None)
        self._upper.clear()  # every request's: the pool and the calibration move too
        self.revision += 1
        hits = set(accepted_ranks)
        stop = min(stop, self.max_rank)
        n = min(stop - start, len(scores))
        if n > 0:  # calibrate against the estimates as they are now (a late tree's were close)
            self.calibration.observe(
                est[start : start + n], scores[:n], [j in hits for j in range(start, start + n)], match
            )
        a = self.decay
        for j in range(start, stop):
            x = 1.0 if j in hits else 0.0
            est[j] += a * (x - est[j])
            prior[j] += a * self.pool_rate * (x - prior[j])  # slower than one request
        return est

    def skipped(self, request_id: str) -> None:
        """The request sampled without a draft this step: its estimates drift toward its prior, and
        the prior toward the first guess. Counted here and applied when next read, in closed form
        against the prior as it is then: a batch where drafts are dormant skips every request
        every step, and paid for it every step (a request that never drafted reads the prior)."""
        key = self._scopes.get(request_id, "")
        self._pool_skips[key] = self._pool_skips.get(key, 0) + 1
        if request_id in self._est:
            self._skips[request_id] = self._skips.get(request_id, 0) + 1
        self._gains.pop(request_id, None)
        self._upper.clear()  # every request's: the pool moved
        self.revision += 1

    def forget(self, request_id: str) -> None:
        self._est.pop(request_id, None)
        self._skips.pop(request_id, None)
        self._pool_skips.pop(_isolated(request_id), None)
        self._gains.pop(request_id, None)
        self._upper.pop(request_id, None)
        self._priors.pop(_isolated(request_id), None)
        self._scopes.pop(request_id, None)
        self.revision += 1


class WindowTracker:
    """Per request, an EMA of what its Jacobi window buys: the tokens per step that pooled draft
    nodes (ones only the window's n-grams proposed) added to the accepted path while the window
    ran. Window rows are pure cost in their own step; this is their expected later gain. Like
    `AcceptanceTracker`, a pooled prior starts new requests, and a request whose window is off
    drifts back toward it, so a window switched off for a streak of bad luck is tried again."""

    def __init__(
        self,
        initial: float = _DEFAULTS.window_initial_gain,
        decay: float = _DEFAULTS.acceptance_decay,
        explore: float = _DEFAULTS.explore,
        pool_rate: float = _DEFAULTS.acceptance_pool_rate,
    ) -> None:
        self.initial = initial
        self.decay = decay
        self.explore = explore
        self.pool_rate = pool_rate
        self._est: dict[str, float] = {}
        self._priors: OrderedDict[str, float] = OrderedDict({"": initial})  # per scope, as the acceptance's
        self._scopes: dict[str, str] = {}

    @property
    def prior(self) -> float:
        return self._priors[""]

    def begin(self, request_id: str, scope: str | None) -> None:
        self._scopes[request_id] = _isolated(request_id) if scope is None else scope

    def _key(self, request_id: str) -> str:
        key = self._scopes.get(request_id, "")
        if key in self._priors:
            self._priors.move_to_end(key)
        else:
            self._priors[key] = self.initial
            while len(self._priors) > MAX_SCOPE_PRIORS:
                del self._priors[next(k for k in self._priors if k)]
        return key

    def gain(self, request_id: str) -> float:
        return self._est.get(request_id, self._priors[self._key(request_id)])

    def observe(self, request_id: str, pooled_tokens: int) -> None:
        """A step with the window on: `pooled_tokens` accepted tokens came from the pool alone."""
        key = self._key(request_id)
        est = self._est.get(request_id, self._priors[key])
        self._est[request_id] = est + self.decay * (pooled_tokens - est)
        self._priors[key] += self.decay * self.pool_rate * (pooled_tokens - self._priors[key])

    def idle(self, request_id: str) -> None:
        """A step with the window off: drift toward the pool's estimate, and it toward the first guess."""
        key = self._key(request_id)
        est = self._est.get(request_id)
        if est is not None:
            self._est[request_id] = est + self.explore * (self._priors[key] - est)
        self._priors[key] += self.explore * self.pool_rate * (self.initial - self._priors[key])

    def forget(self, request_id: str) -> None:
        self._est.pop(request_id, None)
        self._priors.pop(_isolated(request_id), None)
        self._scopes.pop(request_id, None)
