"""`batchserve tune`: the serving settings (seats, token budget, drafts) that give the most
throughput within latency goals, measured on this machine with the user's workload.

`measure.py` runs the points (each a `batchserve bench` run of the workload), `points.py` holds
the goals, the points and the choice among them, `report.py` writes tune.md, tune.json and
tune.png; the command's flags are in `batchserve/cli.py`."""

from __future__ import annotations

from batchserve.tune.measure import tune
from batchserve.tune.points import DRAFTS, SERVE_FLAGS, Goals, Point, TuneResult, closest, format_point, recommend
from batchserve.tune.report import answer_lines, write_tune_report

__all__ = [
    "DRAFTS",
    "SERVE_FLAGS",
    "Goals",
    "Point",
    "TuneResult",
    "answer_lines",
    "closest",
    "format_point",
    "recommend",
    "tune",
    "write_tune_report",
]
