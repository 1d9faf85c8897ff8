"""The small statistical fits behind the draft budget: ridge least squares, score calibration, isotonic.

Pure Python and numpy. `budget.py` gives them their meaning: `DecayedRidge` learns what a
whole step costs beyond the profile, `ScoreCalibration` turns a drafter's node scores into
acceptance probabilities, `non_increasing` keeps a request's gains sorted for the greedy.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np

from batchserve.config import DraftConfig

_DEFAULTS = DraftConfig()  # ScoreCalibration's defaults are the settings'

# Bound on the sigmoid's argument so math.exp never overflows; sigmoid(30) is 1 - 1e-13, so
# no probability that matters changes. A numerical guard, not a tuning value.
_MAX_LOGIT = 30.0


def _logit(p: float, clip: float) -> float:
    """log(p / (1 - p)), with p clipped to [clip, 1 - clip] so scores of 0 and 1 stay finite."""
    p = min(1.0 - clip, max(clip, p))
    return math.log(p / (1.0 - p))


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-max(-_MAX_LOGIT, min(_MAX_LOGIT, z))))


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
        self.weights = [1.0, 0.0, 0.0, 0.0, 0.0]  # rank estimate, score, match measured, log match, bias
        n = len(self.weights)
        self._hess = [[prior_strength if i == j else 0.0 for j in range(n)] for i in range(n)]

    def prob(self, rank_estimate: float, score: float, match: int = 0) -> float:
        return self.probs((rank_estimate,), score, match)[0]

    def probs(self, rank_estimates: Sequence[float], score: float, match: int = 0) -> list[float]:
        """`prob` of each rank estimate at one score and match (their terms computed once: the
        policy asks this for every rank of every request, every step)."""
        w0, w1 = self.weights[:2]
        clip = self.clip
        offset = w1 * _logit(score, clip) + self._tree_term(match_features(match))
        return [_sigmoid(w0 * _logit(est, clip) + offset) for est in rank_estimates]

    def _tree_term(self, features: tuple[float, float]) -> float:
        """The logit's part that every node of a tree shares: its match features and the bias."""
        w = self.weights
        return w[2] * features[0] + w[3] * features[1] + w[4]

    def observe(
        self, rank_estimates: Sequence[float], scores: Sequence[float], hits: Sequence[bool], match: int = 0
    ) -> None:
        """One verified tree: each node's rank estimate and score then, whether it hit, and the
        tree's match length."""
        if not hits:
            return
        # Plain Python, not numpy: a tree has a few nodes and the fit 5 weights, and this runs for
        # every request every step, where numpy's per-call cost is most of the work.
        clip, w, n = self.clip, self.weights, len(self.weights)
        grad = [0.0] * n
        hess = [[0.0] * n for _ in range(n)]
        measured, log_match = features = match_features(match)
        fixed = self._tree_term(features)
        for est, score, hit in zip(rank_estimates, scores, hits):
            x = (_logit(est, clip), _logit(score, clip), measured, log_match, 1.0)
            p = _sigmoid(w[0] * x[0] + w[1] * x[1] + fixed)
            r, c = p - float(hit), p * (1.0 - p)
            for i in range(n):
                grad[i] += x[i] * r
                cx, row = c * x[i], hess[i]
                for j in range(i, n):  # the upper triangle; mirrored below
                    row[j] += cx * x[j]
        d = self.decay ** len(hits)
        # The floor keeps the step bounded once old evidence has decayed away.
        floor = (1.0 - d) * self.prior_strength
        for i in range(n):
            for j in range(i, n):
                self._hess[i][j] = self._hess[j][i] = d * self._hess[i][j] + hess[i][j] + (floor if i == j else 0.0)
        step = _solve(self._hess, grad)
        self.weights = [wi - si for wi, si in zip(w, step)]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b for a small n x n system (Gaussian elimination with partial pivoting)."""
    n = len(b)
    m = [[*row, bi] for row, bi in zip(a, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def non_increasing(xs: Sequence[float]) -> list[float]:
    """The closest non-increasing sequence (pool adjacent violators): keeps the total gain of
    every prefix honest while letting the greedy take nodes in order."""
    if all(map(operator.ge, xs, xs[1:])):  # (map over a slice: a C loop, not a generator's)
        return list(xs)  # already in order: the common case, every step for every request
    means: list[float] = []  # the blocks so far: their means and sizes
    sizes: list[int] = []
    for x in xs:
        m, n = x, 1
        while means and means[-1] < m:  # pool with the block before while it is lower
            m1, n1 = means.pop(), sizes.pop()
            m, n = (m1 * n1 + m * n) / (n1 + n), n1 + n
        means.append(m)
        sizes.append(n)
    out: list[float] = []
    for m, n in zip(means, sizes):
        out += [m] * n
    return out
