"""The small statistical fits behind the draft budget: ridge least squares, score calibration, isotonic.

Pure Python and numpy. `budget.py` gives them their meaning: `DecayedRidge` learns what a
whole step costs beyond the profile, `ScoreCalibration` turns a drafter's node scores into
acceptance probabilities, `non_increasing` keeps a request's gains sorted for the greedy.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence

import numpy as np

from batchserve.config import DraftConfig

_DEFAULTS = DraftConfig()  # ScoreCalibration's defaults are the settings'

# Bound on the sigmoid's argument so exp never overflows; sigmoid(30) is 1 - 1e-13, so
# no probability that matters changes. A numerical guard, not a tuning value.
_MAX_LOGIT = 30.0


def _sigmoids(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -_MAX_LOGIT, _MAX_LOGIT)))


# Queued nodes fitted at once at most: a caller that never reads the weights (a test feeding
# thousands of trees) still gets a Newton step every few trees, not one for all of them.
_FIT_EVERY = 64


def _nonnegative_ridge(
    xx: np.ndarray, xr: np.ndarray, rr: float, strength: float, nonneg: tuple[int, ...]
) -> np.ndarray:
    """argmin |r - X beta|^2 + strength |beta|^2 with beta[i] >= 0 for i in `nonneg`, given
    the sums X^T X, X^T r and r^T r: the best of the unconstrained fits on every subset of
    free coefficients that keeps the signs (exact for a few coefficients)."""
    n = len(xr)
    a = xx + strength * np.eye(n)  # the objective's Hessian: X^T X + strength I
    best, best_obj = np.zeros(n), rr
    for mask in range(1, 1 << n):
        free = [i for i in range(n) if mask >> i & 1]
        beta = np.zeros(n)
        beta[free] = np.linalg.solve(a[np.ix_(free, free)], xr[free])
        if (beta[list(nonneg)] < 0).any():
            continue
        obj = rr - 2.0 * (beta @ xr) + beta @ a @ beta  # |r - X beta|^2 + strength |beta|^2
        if obj < best_obj:
            best, best_obj = beta, obj
    return best


class DecayedRidge:
    """Ridge least squares over exponentially decayed observations, some coefficients >= 0.

    Keeps only the decayed sums X^T X, X^T r and r^T r, so an observation costs O(n^2) and
    a refit 2^n solves of at most n unknowns: meant for a handful of coefficients.
    """

    def __init__(self, size: int, decay: float, strength: float, nonneg: tuple[int, ...] = ()) -> None:
        self.decay = decay  # weight of the past per observation: about 1 / (1 - decay) remembered
        self.strength = strength  # ridge penalty: pulls the coefficients toward 0
        self.nonneg = nonneg
        self._xx = np.zeros((size, size))
        self._xr = np.zeros(size)
        self._rr = 0.0

    def observe(self, x: Sequence[float], r: float) -> list[float]:
        """Add one observation (features `x`, target `r`); the refitted coefficients."""
        xv = np.asarray(x, dtype=float)
        d = self.decay
        self._xx = d * self._xx + np.outer(xv, xv)
        self._xr = d * self._xr + xv * r
        self._rr = d * self._rr + r * r
        return _nonnegative_ridge(self._xx, self._xr, self._rr, self.strength, self.nonneg).tolist()


def match_features(match: int) -> tuple[float, float]:
    """The calibration's view of a tree's match length: (measured or not, log2(1 + match)). Each
    doubling of the match moves the logit by the same amount (1 to 2 tokens says as much as 16
    to 32); a drafter that does not measure it (0: a Jacobi pool's tree) gets neither term, so
    its trees are not priced as the shortest match."""
    return (1.0, math.log2(1 + match)) if match > 0 else (0.0, 0.0)


class ScoreCalibration:
    """P(node accepted) = sigmoid(a * logit(rank estimate) + b * logit(drafter score)
    + (d, e) . match_features(tree's match length) + c), fitted online to every verified node of
    every request.

    The drafter's score alone is far too confident (a trie continuation seen once has score
    1 and is accepted about a fifth of the time) and the rank estimate alone knows nothing
    about this step's match; the match length says whether the drafter is copying (a code
    edit, a repeated answer: most nodes accepted) or guessing from a token or two (measured on
    code edits: a first node accepted about 35% of the time after a match of 1 token, 75-90%
    after 3 or more). Together they predict better than any one. The fit is a recursive
    Newton step with a decaying Hessian (about the last `1 / (1 - decay)` nodes), started at
    (1, 0, 0, 0, 0): until evidence arrives, the rank estimate is used as it is.

    Verified trees are queued (`observe`) and fitted together, one Newton step for all that
    arrived since the weights were last read (an engine step's trees, every request's), or
    every `_FIT_EVERY` nodes: the step's arithmetic runs once in numpy instead of once per tree
    in Python (at 16 requests, about 12 trees a step). Every probability goes through one
    vectorized formula (`prob_array`), so equal inputs give equal bits wherever they are asked.
    """

    def __init__(
        self,
        decay: float = _DEFAULTS.calibration_decay,
        prior_strength: float = _DEFAULTS.calibration_prior_strength,
        clip: float = _DEFAULTS.calibration_clip,
    ) -> None:
        self.decay = decay
        self.prior_strength = prior_strength  # Hessian floor: how hard the first nodes move the fit
        self.clip = clip  # probabilities are clipped to [clip, 1 - clip] before their logit
        # rank estimate, score, match measured, log match, bias
        self._weights = np.array([1.0, 0.0, 0.0, 0.0, 0.0])
        self._hess = prior_strength * np.eye(len(self._weights))
        # Nodes verified since the last fit: rank estimate, score, match length, hit.
        self._queued: tuple[list[float], list[float], list[int], list[bool]] = ([], [], [], [])

    @property
    def weights(self) -> list[float]:
        """The fitted weights, every queued tree fitted first."""
        if self._queued[3]:
            self._fit()
        return self._weights.tolist()

    def prob(self, rank_estimate: float, score: float, match: int = 0) -> float:
        return self.probs((rank_estimate,), score, match)[0]

    def probs(self, rank_estimates: Sequence[float], score: float, match: int = 0) -> list[float]:
        """`prob` of each rank estimate at one score and match (the policy asks this for every
        rank of every request, every step)."""
        return self.probs_each(rank_estimates, [score] * len(rank_estimates), match)

    def probs_each(self, rank_estimates: Sequence[float], scores: Sequence[float], match: int = 0) -> list[float]:
        """`prob` of each (rank estimate, score) pair: the nodes of one tree of this match."""
        if not len(rank_estimates):
            return []
        return self.prob_array(np.array(rank_estimates, dtype=float), np.array(scores, dtype=float), match).tolist()

    def prob_array(self, rank_estimates: np.ndarray, scores: np.ndarray | float, match: int = 0) -> np.ndarray:
        """`prob` elementwise over arrays of any shape (a score array broadcasts against the
        estimates): the one formula every probability comes from."""
        w = self.weights
        scores = np.broadcast_to(np.asarray(scores, dtype=float), rank_estimates.shape)
        z = w[0] * self._logits(rank_estimates) + w[1] * self._logits(scores)
        return _sigmoids(z + self._offset(w, match))

    def probs_of_trees(
        self, rank_estimates: Sequence[Sequence[float]], scores: Sequence[Sequence[float]], matches: Sequence[int]
    ) -> list[list[float]]:
        """`probs_each` of several trees (each its rank estimates, node scores and match) in one
        set of array operations: the same formula node by node, so the same numbers."""
        sizes = [len(e) for e in rank_estimates]
        total = sum(sizes)
        if not total:
            return [[] for _ in sizes]
        w = self.weights
        ests = np.fromiter(itertools.chain.from_iterable(rank_estimates), float, total)  # [nodes]
        node_scores = np.fromiter(itertools.chain.from_iterable(scores), float, total)  # [nodes]
        offsets = np.repeat([self._offset(w, m) for m in matches], sizes)  # [nodes] each node's tree's
        z = w[0] * self._logits(ests) + w[1] * self._logits(node_scores)
        flat = _sigmoids(z + offsets).tolist()
        return [flat[a:b] for a, b in itertools.pairwise(itertools.accumulate(sizes, initial=0))]

    @staticmethod
    def _offset(w: Sequence[float], match: int) -> float:
        """The logit's terms that do not depend on the node: the tree's match, and the bias."""
        measured, log_match = match_features(match)
        return w[2] * measured + w[3] * log_match + w[4]

    def _logits(self, ps: Sequence[float] | np.ndarray) -> np.ndarray:
        """log(p / (1 - p)) of each, p clipped to [clip, 1 - clip] so scores of 0 and 1 stay finite."""
        p = np.clip(np.asarray(ps, dtype=float), self.clip, 1.0 - self.clip)
        return np.log(p / (1.0 - p))

    def observe(
        self, rank_estimates: Sequence[float], scores: Sequence[float], hits: Sequence[bool], match: int = 0
    ) -> None:
        """One verified tree: each node's rank estimate and score then, whether it hit, and the
        tree's match length. Queued: fitted with the others when the weights are next read."""
        n = min(len(rank_estimates), len(scores), len(hits))
        if n == 0:
            return
        ests, node_scores, matches, node_hits = self._queued
        ests += rank_estimates[:n]
        node_scores += scores[:n]
        matches += [match] * n
        node_hits += hits[:n]
        if len(node_hits) >= _FIT_EVERY:
            self._fit()

    def _fit(self) -> None:
        """One Newton step for every queued node, from the weights they were queued under."""
        ests, scores, matches, hits = self._queued
        n = len(hits)
        m = np.array(matches, dtype=float)
        x = np.empty((n, len(self._weights)))  # [n, 5] each node's features
        x[:, 0] = self._logits(ests)
        x[:, 1] = self._logits(scores)
        x[:, 2] = m > 0
        x[:, 3] = np.where(m > 0, np.log2(1.0 + m), 0.0)  # match_features, node by node
        x[:, 4] = 1.0
        p = _sigmoids((x * self._weights).sum(1))
        r, c = p - np.array(hits, dtype=float), p * (1.0 - p)
        grad = (x * r[:, None]).sum(0)  # [5]
        hess = np.einsum("ni,n,nj->ij", x, c, x)  # [5, 5] (einsum: no BLAS thread pool for a 5x5)
        d = self.decay**n
        # The floor keeps the step bounded once old evidence has decayed away.
        self._hess = d * self._hess + hess + (1.0 - d) * self.prior_strength * np.eye(len(grad))
        self._weights = self._weights - np.linalg.solve(self._hess, grad)
        for queue in self._queued:
            queue.clear()


def non_increasing(xs: Sequence[float]) -> list[float]:
    """The closest non-increasing sequence (pool adjacent violators): keeps the total gain of
    every prefix honest while letting the greedy take nodes in order. The same numbers as
    `non_increasing_rows` gives the row, to the bit."""
    if all(map(operator.ge, xs, xs[1:])):  # (map over a slice: a C loop, not a generator's)
        return list(xs)  # already in order: the common case, every step for every request
    return non_increasing_rows(np.array([xs], dtype=np.float64))[0].tolist()


def non_increasing_rows(x: np.ndarray) -> np.ndarray:
    """`non_increasing` of every row of x [R, n] at once. Adjacent violators pooled in any order
    reach the same fit, so each pass pools every run of them in every row, and a block's value
    is always its elements' sum over their count (one row's bits never depend on the others').
    A row may end in padding below every value (-1 for probabilities): it never pools."""
    rows, n = x.shape
    if rows == 0 or n == 0:
        return x.astype(np.float64, copy=True)
    flat = np.ascontiguousarray(x, dtype=np.float64).ravel()  # [R * n]
    starts = np.ones(rows * n, dtype=bool)  # where a block starts: every element alone at first
    row_start = np.zeros(rows * n, dtype=bool)
    row_start[::n] = True
    while True:
        idx = np.flatnonzero(starts)  # [blocks]
        counts = np.diff(np.append(idx, rows * n))
        means = np.add.reduceat(flat, idx) / counts  # [blocks]
        up = (means[1:] > means[:-1]) & ~row_start[idx[1:]]  # a block above the one before it, same row
        if not up.any():
            return np.repeat(means, counts).reshape(rows, n)
        starts[idx[1:][up]] = False
