"""Open-loop load (Poisson arrivals) and the report's load-point checks."""

from __future__ import annotations

import itertools
import statistics
from typing import Any

import pytest

from batchserve.bench.load import open_loop_latencies, poisson_arrivals
from batchserve.bench.methods import Row
from batchserve.bench.report import _open_loop_table, never_slower


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate() -> None:
    times = poisson_arrivals(2000, rate=4.0, seed=3)
    assert times == poisson_arrivals(2000, rate=4.0, seed=3) != poisson_arrivals(2000, rate=4.0, seed=4)
    assert times[0] == 0.0 and times == sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.15)  # exponential: sd = mean
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0.0)


def test_open_loop_is_lossless_and_times_requests_from_their_scheduled_arrival(tiny_tokenizer: Any) -> None:
    from batchserve.bench.methods import batchserve_method
    from batchserve.bench.runs import run_batchserve
    from tests.conftest import make_tiny_model

    prompts = [[5 + (i * 7 + j) % 60 for j in range(12 + i)] for i in range(6)]
    model = make_tiny_model()
    m = batchserve_method("lookahead")
    assert m is not None
    closed = run_batchserve(model, tiny_tokenizer, prompts, 8, 2, m, [], 8)
    arrivals = [0.0, 0.0, 0.05, 0.3, 0.31, 0.6]  # a burst, then a gap the engine sleeps through
    opened = run_batchserve(model, tiny_tokenizer, prompts, 8, 2, m, [], 8, arrivals=arrivals)
    assert opened.outputs == closed.outputs
    assert len(opened.ttfts) == len(prompts) and all(t > 0 for t in opened.ttfts)
    assert opened.seconds >= arrivals[-1]  # the last request could not start before it arrived


def test_open_loop_latencies_count_from_the_schedule() -> None:
    from types import SimpleNamespace

    results = [
        SimpleNamespace(first_token_time=11.0, finish_time=12.0, token_ids=[1, 2, 3]),
        SimpleNamespace(first_token_time=13.5, finish_time=13.5, token_ids=[4]),
    ]
    ttfts, tpots = open_loop_latencies(results, [10.0, 12.0])  # type: ignore[arg-type]
    assert ttfts == [1.0, 1.5] and tpots == [0.5]


def _row(method: str, b: int, tps: float, rate: float | None = None) -> Row:
    r = Row(method, "code-edit", b, 4, 40, 1.0, tps, 2.0, 0.1, 0.2, 0.01, 0.02, True)
    r.request_rate = rate
    return r


def test_never_slower_names_the_lowest_point_and_every_point_below_the_floor() -> None:
    rows = [
        _row("none", 1, 10.0),
        _row("lookahead-adaptive", 1, 30.0),
        _row("none", 16, 50.0),
        _row("lookahead-adaptive", 16, 47.0),
        _row("none", 16, 20.0, rate=2.0),
        _row("lookahead-adaptive", 16, 21.0, rate=2.0),
    ]
    line = "".join(never_slower(rows))
    assert "3 load points" in line and "lowest 0.94x (b=16)" in line and "below 0.97 at b=16" in line
    rows[3] = _row("lookahead-adaptive", 16, 49.0)
    assert "at least 0.97 everywhere" in "".join(never_slower(rows))
    assert never_slower([_row("none", 1, 10.0)]) == []  # nothing to compare
    # With every seat taken (closed-loop points only): the tails a finish order leaves aside.
    rows[3].seated_tokens_per_s, rows[2].seated_tokens_per_s = 45.0, 50.0
    rows[1].seated_tokens_per_s, rows[0].seated_tokens_per_s = 30.0, 10.0
    rows[5].seated_tokens_per_s = rows[4].seated_tokens_per_s = 1.0
    seated = "".join(never_slower(rows, seated=True))
    assert "with every seat taken at 2 load points: lowest 0.90x (b=16)" in seated


def test_open_loop_table_compares_with_none_at_the_same_rate() -> None:
    rows = [_row("none", 16, 20.0, 2.0), _row("lookahead-adaptive", 16, 30.0, 2.0), _row("none", 16, 25.0, 4.0)]
    table = "\n".join(_open_loop_table(rows))
    assert "at most 16 running" in table
    assert "| lookahead-adaptive | 2 | 30.0 |" in table and "| 1.50x |" in table
    assert _open_loop_table([]) == []


def test_each_method_is_compared_with_none_on_its_own_weights() -> None:
    from batchserve.bench.report import _method_table, none_of

    assert none_of("lookahead-adaptive-gguf+prediction") == "none-gguf" and none_of("lookahead") == "none"
    rows = [_row("none", 1, 10.0), _row("none-gguf", 1, 20.0), _row("lookahead-adaptive-gguf", 1, 50.0)]
    table = "\n".join(_method_table(rows))
    assert "| 2.50x |" in table  # 50 over none-gguf's 20, not none's 10
    assert "lowest 2.50x (b=1)" in "".join(never_slower(rows, "lookahead-adaptive-gguf", "none-gguf"))
