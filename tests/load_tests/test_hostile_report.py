"""The hostile soak's report (load_tests/soak_hostile.py): percentiles, ratios and the targets
computed from the call log, without a server."""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import pytest

from load_tests.soak_hostile import (
    FIELDS,
    UNFINISHED,
    Call,
    Phase,
    latency,
    outcomes,
    overlaps,
    percentile,
    ratio,
    read_calls,
    render,
    rss_summary,
    targets,
    tokens_a_step,
)


def _stream(start: float, ttft: float, tpot: float, kind: str = "stream", proto: str = "grpc", **kw: object) -> Call:
    return Call(start, "good", proto, kind, "ok", True, ttft + 63 * tpot, ttft, tpot, 64, **kw)  # type: ignore[arg-type]


def _phase(name: str, ttft: float, tpot: float, tps: float = 4.0, rss_kb: int = 1_000_000) -> Phase:
    """100 streams with TTFT/TPOT 1x..2x the given (p99: 1.98x, with the repeats at 1x), half of
    them over HTTP, repeated prompts at `tps` tokens a step during the load and in the idle probe
    after it; beside the hostile tenant, one of its calls."""
    calls = [_stream(float(i), ttft * (1 + i / 100), tpot * (1 + i / 100), proto=("grpc", "http")[i % 2])
             for i in range(100)]  # fmt: skip
    if name == "hostile":
        calls.append(Call(0.5, "hostile", "http", "idle-socket", "closed by the server after 10 s", True, 10_000))
    calls += [_stream(100.0 + i, ttft, tpot, "repeat", tps=tps, key=str(i % 2)) for i in range(10)]
    calls += [Call(200.0 + i, "good", "grpc", "probe", "ok", True, 900, tps=tps, key=str(i)) for i in range(2)]
    return Phase(name, calls, [(0.0, rss_kb), (2.0, rss_kb + 10_000), (4.0, rss_kb)])


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(100, 0, -1)]
    assert percentile(values, 0.5) == 50 and percentile(values, 0.99) == 99 and percentile(values, 1.0) == 100
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) is None


def test_ratio_needs_both_sides():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None


def test_the_call_log_reads_back(tmp_path: Path):
    log = tmp_path / "calls.csv"
    with open(log, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, restval="")
        w.writerow(dict(zip(FIELDS, ["1.5", "good", "http", "repeat", "ok", 1, "900", "100", "12.5", 64, "3.2", "1"])))
        w.writerow(dict(zip(FIELDS, ["2", "hostile", "grpc", "resume", "grpc OK", 1, "50"])))
    good, hostile = read_calls(log)
    assert good == Call(1.5, "good", "http", "repeat", "ok", True, 900.0, 100.0, 12.5, 64, 3.2, "1")
    assert hostile.ttft_ms is None and hostile.tps is None and hostile.tokens == 0 and hostile.key == ""


def test_latency_counts_the_well_behaved_streams_only():
    calls = [_stream(0, 100, 10), _stream(1, 300, 30, kind="repeat")]
    calls += [Call(2, "good", "grpc", "stream", "UNAVAILABLE", False, 5, 9999, None)]  # failed: not a latency
    calls += [Call(3, "good", "grpc", "cancel", "ok", True, 5, 9999, None)]  # a walk-away
    calls += [Call(4, "hostile", "http", "slow-reader", "http 200", True, 5, 9999, 9999)]
    got = latency(calls)
    assert got == {"ttft_p50": 100, "ttft_p99": 300, "tpot_p50": 10, "tpot_p99": 30, "streams": 2}


def test_tokens_a_step_leaves_each_prompts_first_call_out():
    calls = [_stream(t, 1, 1, "repeat", tps=tps, key=key) for t, tps, key in
             [(0, 1.0, "a"), (1, 1.5, "b"), (2, 5.0, "a"), (3, 7.0, "b"), (4, 6.0, "a")]]  # fmt: skip
    assert tokens_a_step(calls) == (6.0, 3)
    assert tokens_a_step([_stream(0, 1, 1, "repeat", tps=2.0, key="a")]) == (None, 0)
    # The probe after the load: every call counts (the load taught the drafter each prompt).
    probes = [Call(t, "good", "grpc", "probe", "ok", True, 1, tps=tps, key=key) for t, tps, key in
              [(0, 6.0, "0"), (1, 7.0, "1")]]  # fmt: skip
    assert tokens_a_step(calls + probes, "probe") == (6.5, 2)


def test_the_same_load_beside_the_hostile_tenant_meets_the_targets_within_the_bounds():
    alone = _phase("alone", 200, 20)
    hostile = _phase("hostile", 200 * 1.2, 20 * 1.24, tps=3.7, rss_kb=1_090_000)
    hostile.calls.append(Call(50, "hostile", "http", "huge-over-limit", "http 413", True, 3))
    assert all(met for _, met, _ in targets(alone, hostile)), targets(alone, hostile)
    text, ok = render(alone, hostile, ["# header"])
    assert ok and text.startswith("# header") and "result: PASS" in text
    assert "| TTFT P99 ms | 396 | 475 | 1.20x |" in text
    assert "huge-over-limit/http: 1 sent (p50 3 ms): http 413 x1" in text


@pytest.mark.parametrize(
    ("change", "missed"),
    [
        ({"ttft": 1.3}, "ttft_p99"),
        ({"tpot": 1.3}, "tpot_p99"),
        ({"tps": 3.5}, "tokens a step"),
        ({"rss_kb": 1_120_000}, "peak RSS"),
    ],
)
def test_a_missed_target_fails_the_report(change: dict[str, float], missed: str):
    alone = _phase("alone", 200, 20)
    hostile = _phase(
        "hostile", 200 * change.get("ttft", 1.0), 20 * change.get("tpot", 1.0),
        tps=change.get("tps", 4.0), rss_kb=int(change.get("rss_kb", 1_000_000)),
    )  # fmt: skip
    assert [name for name, met, _ in targets(alone, hostile) if not met] == [
        name for name, _, _ in targets(alone, hostile) if missed in name
    ]
    assert "result: FAIL" in render(alone, hostile, [])[0]


def test_only_well_behaved_failures_and_a_dead_server_fail():
    alone, hostile = _phase("alone", 200, 20), _phase("hostile", 200, 20)
    hostile.calls += [Call(5, "hostile", "http", "echo-logprobs", "http 400", True, 1),
                      Call(6, "hostile", "grpc", "cancel", "error RuntimeError", True, 1)]  # fmt: skip
    assert all(met for _, met, _ in targets(alone, hostile))
    hostile.calls.append(Call(7, "good", "http", "generate", "HTTP 429: busy", False, 1))
    hostile.died = "exited with -9 during the run"
    missed = {name: measured for name, met, measured in targets(alone, hostile) if not met}
    assert missed == {"well-behaved calls failed (hostile) == 0": "1", "server alive through both runs":
                      "hostile: exited with -9 during the run"}  # fmt: skip
    assert "FAILED (hostile) http generate: HTTP 429: busy" in render(alone, hostile, [])[0]


def test_outcomes_and_overlaps_group_the_hostile_calls_by_kind():
    calls = [Call(10, "hostile", "grpc", "resume", "grpc OK", True, 2000),  # in flight from 10 s to 12 s
             Call(11, "hostile", "grpc", "resume", "grpc INVALID_ARGUMENT", True, 10),
             Call(20, "hostile", "http", "cancel", "http 200 dropped", True, 10),
             _stream(11.5, 1000, 10), _stream(30, 50, 10)]  # fmt: skip
    assert {k: dict(v) for k, v in outcomes(calls).items()} == {
        "cancel/http": {"http 200 dropped": 1},
        "resume/grpc": {"grpc OK": 1, "grpc INVALID_ARGUMENT": 1},
    }
    assert overlaps(calls) == {"none": (1, 50.0), "resume": (1, 1000.0)}


def test_rss_summary():
    assert rss_summary([(0, 1024 * 1000), (2, 1024 * 1300), (4, 1024 * 1100)]) == {
        "start": 1000, "peak": 1300, "end": 1100, "growth": pytest.approx(0.1),
    }  # fmt: skip
    assert rss_summary([]) == {}


def test_calls_the_run_cut_short_are_neither_successes_nor_failures():
    alone, hostile = _phase("alone", 200, 20), _phase("hostile", 200, 20)
    hostile.calls.append(Call(7, "good", "grpc", "stream", UNFINISHED, False, 90_000))
    assert all(met for _, met, _ in targets(alone, hostile))
    assert latency(hostile.calls) == latency(hostile.calls[:-1])
    assert "unfinished 1" in render(alone, hostile, [])[0]


def test_a_soak_whose_users_sent_nothing_or_one_protocol_only_fails():
    """A hostile user that never started (its key refused at start-up, say) measured nothing: the
    report fails rather than pass; so do well-behaved users of one protocol only."""
    alone, hostile = _phase("alone", 200, 20), _phase("hostile", 200, 20)
    hostile.calls = [c for c in hostile.calls if c.role == "good"]
    missed = [name for name, met, _ in targets(alone, hostile) if not met]
    assert missed == ["the hostile users sent calls"]
    alone.calls = [c for c in alone.calls if c.proto == "grpc"]
    missed = [name for name, met, _ in targets(alone, hostile) if not met]
    assert "well-behaved users called over gRPC and HTTP (alone)" in missed


def test_a_removed_keys_stream_must_end_within_the_bound():
    alone, hostile = _phase("alone", 200, 20), _phase("hostile", 200, 20)
    ok = "ended UNAUTHENTICATED after 0.1 s; a new call UNAUTHENTICATED"
    hostile.calls.append(Call(9, "hostile", "grpc", "key-revocation", ok, True, 30))
    assert all(met for _, met, _ in targets(alone, hostile))
    for outcome in ("ended UNAUTHENTICATED after 6.2 s; a new call UNAUTHENTICATED",
                    "ran to its end after the key was removed",
                    "ended UNAUTHENTICATED after 0.1 s; a new call still taken"):  # fmt: skip
        late = replace(hostile, calls=[*hostile.calls, Call(10, "hostile", "grpc", "key-revocation", outcome, True, 9)])
        missed = [name for name, met, _ in targets(alone, late) if not met]
        assert missed == ["a removed key's stream ends within 5 s and the key is refused"], outcome
