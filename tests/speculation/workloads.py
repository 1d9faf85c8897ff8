"""Synthetic cost profiles and acceptance histories shared by the adaptive-length tests."""

from __future__ import annotations

from batchserve.cost_profile import CostProfile
from batchserve.speculation.budget import AcceptanceTracker
from batchserve.speculation.fits import ScoreCalibration

COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def gpu_like(cdl: int = 64, base: float = 10.0, slope: float = 0.2) -> CostProfile:
    """Flat up to `cdl` tokens, then linear: the shape the paper measures on a GPU."""
    row = tuple(base + slope * max(0, n - cdl) for n in COUNTS)
    return CostProfile("gpu-like", COUNTS, (0,), (row,))


def cpu_like(base: float = 80.0, slope: float = 2.5) -> CostProfile:
    """Linear from the first token: no free tokens at all."""
    row = tuple(base + slope * (n - 1) for n in COUNTS)
    return CostProfile("cpu-like", COUNTS, (0, 2048), (row, tuple(t * 1.5 for t in row)))


def trained(acceptance: dict[str, list[float]], steps: int = 60, max_rank: int = 64) -> AcceptanceTracker:
    """A tracker fed `steps` verifications where rank j of request r hits a fraction p[j] of
    the time, evenly spread (deterministic, so equal rates give equal estimates)."""
    t = AcceptanceTracker(max_rank)
    for s in range(steps):
        for rid, probs in acceptance.items():
            hits = [j for j, p in enumerate(probs) if int((s + 1) * p) > int(s * p)]
            t.observe(rid, len(probs), hits)
    return t


def feed(cal: ScoreCalibration, rate: dict[float, float], rounds: int, est: float = 0.3) -> None:
    """Verified trees of 8 nodes: a node scored s hits a fraction rate[s] of the time."""
    for r in range(rounds):
        scores = [s for s in rate for _ in range(8 // len(rate))]
        hits = [int((r + 1) * rate[s]) > int(r * rate[s]) for s in scores]
        cal.observe([est] * len(scores), scores, hits)
