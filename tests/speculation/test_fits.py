"""The budget's small fits: isotonic gains, the online score calibration, decayed ridge."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from batchserve.speculation.fits import (
    DecayedRidge,
    ScoreCalibration,
    _nonnegative_ridge,
    match_features,
    non_increasing,
    non_increasing_rows,
)
from tests.speculation.workloads import feed


def test_non_increasing_keeps_prefix_totals_honest():
    xs = [0.6, 0.5, 0.1, 0.4, 0.3, 0.0]
    ys = non_increasing(xs)
    assert all(a >= b for a, b in itertools.pairwise(ys))
    assert sum(ys) == pytest.approx(sum(xs))
    assert ys[:2] == xs[:2] and ys[2] == pytest.approx(0.8 / 3)
    assert non_increasing([]) == []


def test_calibration_starts_at_the_rank_estimate_and_learns_what_scores_mean():
    cal = ScoreCalibration()
    assert cal.prob(0.3, 0.01) == pytest.approx(0.3, abs=1e-6) == cal.prob(0.3, 1.0)
    # The drafter is overconfident: its score-1 nodes hit 40%, its score-0.1 nodes 5%.
    feed(cal, {1.0: 0.4, 0.1: 0.05}, rounds=400)
    assert cal.prob(0.3, 1.0) == pytest.approx(0.4, abs=0.05)
    assert cal.prob(0.3, 0.1) == pytest.approx(0.05, abs=0.03)
    # When what scores mean changes (another workload), the fit follows.
    feed(cal, {1.0: 0.8, 0.1: 0.3}, rounds=1000)
    assert cal.prob(0.3, 1.0) == pytest.approx(0.8, abs=0.05)
    assert cal.prob(0.3, 0.1) == pytest.approx(0.3, abs=0.05)


def test_calibration_keeps_the_request_history_in_the_estimate():
    cal = ScoreCalibration()
    for r in range(600):  # same scores; the request whose ranks hit more often hits more
        for est, rate in ((0.6, 0.6), (0.1, 0.1)):
            cal.observe([est] * 8, [0.5] * 8, [int((r + 1) * rate) > int(r * rate)] * 8)
    assert cal.prob(0.6, 0.5) == pytest.approx(0.6, abs=0.07)
    assert cal.prob(0.1, 0.5) == pytest.approx(0.1, abs=0.05)


def test_calibration_probs_at_one_score_are_each_ranks_prob():
    cal = ScoreCalibration()
    feed(cal, {1.0: 0.4, 0.1: 0.05}, rounds=100)
    ests = [0.0, 0.05, 0.3, 0.9, 1.0]
    assert cal.probs(ests, 0.7) == pytest.approx([cal.prob(e, 0.7) for e in ests], rel=1e-12)


def test_calibration_learns_what_a_long_match_means():
    """Same rank estimates and scores; trees found after a long match (a copy in progress) hit
    far more often than after a one-token match: the fit tells them apart. Trees whose drafter
    does not measure a match (0) are priced by what they do, not as the shortest match."""
    cal = ScoreCalibration()
    assert cal.prob(0.3, 0.5, match=16) == pytest.approx(cal.prob(0.3, 0.5, match=1), abs=1e-9)  # no evidence yet
    for r in range(800):
        for match, rate in ((1, 0.3), (16, 0.9), (0, 0.6)):
            cal.observe([0.5] * 8, [0.7] * 8, [int((r + 1) * rate) > int(r * rate)] * 8, match)
    assert cal.prob(0.5, 0.7, match=16) == pytest.approx(0.9, abs=0.05)
    assert cal.prob(0.5, 0.7, match=1) == pytest.approx(0.3, abs=0.05)
    assert cal.prob(0.5, 0.7, match=0) == pytest.approx(0.6, abs=0.05)
    assert cal.prob(0.5, 0.7, match=1) < cal.prob(0.5, 0.7, match=4) < cal.prob(0.5, 0.7, match=16)
    assert cal.probs([0.5, 0.2], 0.7, 16) == pytest.approx([cal.prob(0.5, 0.7, 16), cal.prob(0.2, 0.7, 16)])
    assert match_features(0) == (0.0, 0.0) and match_features(1) == (1.0, 1.0) and match_features(3) == (1.0, 2.0)


def _brute_force_ridge(x: np.ndarray, r: np.ndarray, strength: float, nonneg: tuple[int, ...]) -> np.ndarray:
    """The constrained ridge fit by projected gradient descent on the raw data."""
    a = x.T @ x + strength * np.eye(x.shape[1])
    beta, lr = np.zeros(x.shape[1]), 1.0 / np.linalg.eigvalsh(a).max()
    for _ in range(5_000):
        beta -= lr * (a @ beta - x.T @ r)
        beta[list(nonneg)] = np.maximum(beta[list(nonneg)], 0.0)
    return beta


@pytest.mark.parametrize("seed", range(6))
def test_nonnegative_ridge_is_the_constrained_optimum(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(40, 3)) * (5.0, 2.0, 1.0)
    r = x @ rng.normal(size=3) + rng.normal(size=40)  # true coefficients of either sign
    beta = _nonnegative_ridge(x.T @ x, x.T @ r, float(r @ r), 1.0, (1, 2))
    assert (beta[1:] >= 0).all()
    assert beta == pytest.approx(_brute_force_ridge(x, r, 1.0, (1, 2)), abs=1e-6)


def test_nonnegative_ridge_without_signal_is_zero():
    assert _nonnegative_ridge(np.zeros((3, 3)), np.zeros(3), 0.0, 1.0, (0, 1, 2)).tolist() == [0.0] * 3


def test_decayed_ridge_forgets_old_observations():
    fit = DecayedRidge(2, decay=0.9, strength=1e-6, nonneg=(1,))
    for i in range(300):  # first r = 2 x0 + 1 x1, then r = 5 x0: the old slope is forgotten
        x = (1.0 + i % 7, 1.0)
        beta = fit.observe(x, 2 * x[0] + 1 if i < 150 else 5 * x[0])
    assert beta == pytest.approx([5.0, 0.0], abs=1e-4)


def test_rows_pool_as_one_row_at_a_time_to_the_bit_and_as_the_classic_algorithm():
    def classic(xs: list[float]) -> list[float]:  # pool adjacent violators, one element at a time
        means: list[float] = []
        sizes: list[int] = []
        for x in xs:
            m, n = x, 1
            while means and means[-1] < m:
                m1, n1 = means.pop(), sizes.pop()
                m, n = (m1 * n1 + m * n) / (n1 + n), n1 + n
            means.append(m)
            sizes.append(n)
        return [m for m, n in zip(means, sizes) for _ in range(n)]

    rng = np.random.default_rng(0)
    x = rng.random((50, 24)) ** rng.integers(1, 4, (50, 1))  # [50, 24]: some rows near monotone
    x[3] = np.sort(x[3])[::-1]  # already in order: kept as it is
    rows = non_increasing_rows(x)
    for row, xs in zip(rows.tolist(), x.tolist()):
        assert row == non_increasing(xs)  # one row alone: the same bits
        assert row == pytest.approx(classic(xs), abs=1e-12)
    assert rows[3].tolist() == x[3].tolist()
    padded = np.concatenate([x[:2], np.full((2, 5), -1.0)], axis=1)  # padding below every value
    assert non_increasing_rows(padded)[:, :24].tolist() == rows[:2].tolist()
    assert non_increasing_rows(np.zeros((0, 4))).shape == (0, 4)
