"""`batchserve tune`: goals, the recommendation, its report, the CLI, and one real tune (slow)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchserve.cli import main
from batchserve.tune import Goals, Point, TuneResult, answer_lines, closest, recommend, write_tune_report


def _point(draft: str, seqs: int, tps: float, ttft: float, tpot: float, goals: Goals, budget: int = 512) -> Point:
    p = Point(draft, seqs, budget, tps, ttft, tpot, 1.5 if draft != "none" else 1.0)
    p.missed = goals.missed(ttft, tpot)
    return p


def test_goals_name_what_a_point_misses() -> None:
    g = Goals(ttft_ms=500, tpot_ms=50, percentile=90)
    assert g.missed(400, 49.9) == ""
    assert g.missed(600, 60) == "TTFT p90 600 > 500 ms; TPOT p90 60.0 > 50 ms"
    assert Goals().missed(1e9, 1e9) == ""  # no goals: everything meets them
    for bad in (dict(percentile=0), dict(percentile=101), dict(ttft_ms=0), dict(tpot_ms=-1)):
        with pytest.raises(ValueError):
            Goals(**bad)


def test_the_recommendation_is_the_fastest_point_within_the_goals() -> None:
    g = Goals(tpot_ms=100)
    points = [
        _point("none", 1, 20, 100, 50, g),
        _point("lookahead-adaptive", 1, 45, 100, 22, g),
        _point("none", 8, 60, 300, 130, g),  # fastest, but misses TPOT
        _point("lookahead-adaptive", 4, 55, 200, 70, g),
        _point("none", 4, 55, 200, 72, g),
    ]
    best = recommend(points)
    assert best is points[3]  # ties on tokens/s go to the point with fewer seats? equal seats: first
    assert best.serve_flags() == "--max-num-seqs 4 --max-num-batched-tokens 512 --draft lookahead --adaptive"
    best.weights = "bfloat16"  # what it ran is what the server is told to run
    assert best.serve_flags().endswith("--adaptive --cpu-weights bfloat16")
    assert recommend([_point("none", 2, 50, 1, 1, g), _point("none", 1, 50, 1, 1, g)]).max_num_seqs == 1
    result = TuneResult(g, points, best, confirmed_tokens_per_s=52.0)
    text = "\n".join(answer_lines(result))
    assert "batchserve serve --max-num-seqs 4" in text and "0.95x the prediction" in text


def test_when_nothing_meets_the_goals_it_says_so_and_names_the_closest(tmp_path: Path) -> None:
    g = Goals(ttft_ms=10, tpot_ms=5)
    points = [_point("none", 1, 20, 100, 50, g), _point("lookahead-adaptive", 1, 40, 30, 25, g)]
    assert recommend(points) is None and closest(points, g) is points[1]
    result = TuneResult(g, points, None)
    text = "\n".join(answer_lines(result))
    assert "No setting measured meets the goals" in text and "Closest: lookahead-adaptive, 1 seqs" in text
    write_tune_report(result, tmp_path, "code-edit", 64)
    data = json.loads((tmp_path / "tune.json").read_text())
    assert data["best"] is None and len(data["points"]) == 2 and data["goals"]["ttft_ms"] == 10
    md = (tmp_path / "tune.md").read_text()
    assert "TTFT p99 <= 10 ms, TPOT p99 <= 5 ms" in md and "No setting measured" in md
    assert (tmp_path / "tune.png").read_bytes()[:4] == b"\x89PNG"


def test_a_point_of_repeated_runs_is_their_median() -> None:
    from batchserve.tune.measure import _Runner

    speeds = iter([30.0, 90.0, 50.0])

    class Timed(_Runner):  # each run measures the next speed
        def _once(self, draft: str, c: int, budget: int) -> tuple[Point, list[list[int]]]:
            tps = next(speeds)
            return _point(draft, c, tps, 1.0, tps, Goals()), [[int(tps)]]

    r = Timed(None, None, None, Goals(), 1, 1, 4, "gguf", None, None, repeats=3)
    point, outputs = r.run("none", 2, 512)
    assert point.tokens_per_s == 50.0 and outputs == [[50]]  # not the lucky 90 nor the slow 30


@pytest.mark.parametrize(
    "argv",
    [
        ["tune", "--dataset", "imagenet"],
        ["tune", "--concurrency", "0,2"],
        ["tune", "--token-budgets", "0"],
        ["tune", "--percentile", "0"],
        ["tune", "--slo-tpot-ms", "-5"],
        ["tune", "--dataset", "missing.jsonl"],
        ["tune", "--repeats", "0"],
    ],
)
def test_tune_cli_refuses_what_it_cannot_do(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "batchserve tune:" in capsys.readouterr().err


@pytest.mark.slow
def test_tune_on_smollm2_recommends_flags_it_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.bench.test_datasets_and_simulate import _quick_calibration

    _quick_calibration(monkeypatch, tmp_path / "cache")
    out = tmp_path / "tune"
    argv = ["tune", "--dataset", "humaneval", "--concurrency", "1,2", "--token-budgets", "256", "--num-prompts", "2"]
    argv += ["--waves", "1", "--max-new-tokens", "4", "--slo-tpot-ms", "100000", "--confirm", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    data: dict[str, Any] = json.loads((out / "tune.json").read_text())
    points = data["points"]
    # Both draft modes at both concurrencies, then the other token budget at the best point.
    assert {(p["draft"], p["max_num_seqs"], p["max_num_batched_tokens"]) for p in points[:4]} == {
        (d, c, 512) for d in ("none", "lookahead-adaptive") for c in (1, 2)
    }
    assert len(points) == 5 and points[4]["max_num_batched_tokens"] == 256
    assert all(p["tokens_per_s"] > 0 and p["missed"] == "" for p in points)
    assert all(p["lossless"] is True for p in points if p["draft"] != "none" and p["max_num_batched_tokens"] == 512)
    # Each point ran the weights a server takes (the file read from its blocks where our kernels run).
    from batchserve.model import choose_cpu_weights

    assert all(p["weights"] == choose_cpu_weights(True, None) for p in points)
    best = data["best"]
    assert best["tokens_per_s"] == max(p["tokens_per_s"] for p in points)
    assert data["confirmed_tokens_per_s"] > 0
    assert f"batchserve serve --max-num-seqs {best['max_num_seqs']}" in printed
    assert f"--cpu-weights {best['weights']}" in printed
    assert "Recommended" in (out / "tune.md").read_text()
