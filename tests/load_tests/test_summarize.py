"""The soak's memory gate: at most 5% RSS growth from minute 2 to the end."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from load_tests import summarize
from load_tests.summarize import memory_gate


def _run(warm_kb: int, end_kb: int, start_kb: int = 100_000, seconds: int = 600) -> list[tuple[int, int]]:
    samples = [(t, start_kb + (warm_kb - start_kb) * t // 120) for t in range(0, 120, 10)]
    samples += [(t, warm_kb + (end_kb - warm_kb) * (t - 120) // (seconds - 120)) for t in range(120, seconds + 1, 10)]
    return samples


def test_growth_within_five_percent_passes_and_beyond_fails():
    ok, line = memory_gate(_run(1_000_000, 1_020_000))
    assert ok and "+2.0%" in line
    ok, line = memory_gate(_run(1_000_000, 1_060_000))
    assert not ok and "+6.0%" in line


def test_the_first_two_minutes_do_not_count():
    # Tripling while warming up (tries, pools, caches), flat afterwards: passes.
    assert memory_gate(_run(300_000, 303_000, start_kb=100_000))[0]


def test_too_few_samples_pass_and_say_why():
    ok, line = memory_gate(_run(1_000_000, 2_000_000, seconds=200))
    assert ok and "too short" in line
    assert memory_gate([]) == (True, "memory: no samples")


def test_a_stalled_sampler_is_too_few_samples_not_zero_growth():
    # One warm sample only (the sampler stalled until minute 5): no growth can be measured from it.
    ok, line = memory_gate([(0, 1_000_000), (10, 1_000_000), (300, 2_000_000)])
    assert ok and "too short" in line and "+0.0%" not in line
    # Warm samples spanning just under / exactly two minutes: the boundary of the check.
    assert "too short" in memory_gate([(120, 1_000_000), (230, 1_000_000), (239, 1_100_000)])[1]
    ok, line = memory_gate([(120, 1_000_000), (180, 1_000_000), (240, 1_100_000)])
    assert not ok and "+10.0%" in line


def _soak_out(tmp_path: Path, end_kb: int) -> list[str]:
    """A soak's output as run.sh leaves it: Locust's CSVs (no failures) and the RSS samples, one
    of them empty (`ps` raced the sampler)."""
    fields = ["Type", "Name", "Request Count", "Failure Count", "50%", "99%", "Average Content Size"]
    with open(tmp_path / "locust_stats.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        w.writerows([["grpc", "Generate", 500, 0, 900, 3000, 40.0], ["", "Aggregated", 500, 0, 900, 3000, 40.0]])
    (tmp_path / "locust_failures.csv").write_text("Method,Name,Error,Occurrences\n")
    rows = [f"{t},{kb}" for t, kb in _run(1_000_000, end_kb)]
    rows[30] = rows[30].split(",")[0] + ","
    (tmp_path / "rss.csv").write_text("\n".join(rows) + "\n")
    return [str(tmp_path / "locust"), str(tmp_path / "rss.csv"), "127.0.0.1:1"]


@pytest.mark.parametrize(("end_kb", "code", "growth"), [(1_020_000, 0, "+2.0%"), (1_060_000, 1, "+6.0%")])
def test_the_gate_decides_summarizes_exit_code(tmp_path, monkeypatch, capsys, end_kb, code, growth):
    """The gate as `make soak` runs it: read from run.sh's rss.csv, and its verdict is the exit code."""
    monkeypatch.setattr(summarize, "idle_report", lambda metrics: True)  # no server to ask
    assert summarize.main(_soak_out(tmp_path, end_kb)) == code
    assert growth in capsys.readouterr().out
