"""The soak's memory gate: at most 5% RSS growth from minute 2 to the end."""

from __future__ import annotations

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
