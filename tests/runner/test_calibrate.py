"""Calibration on the tiny model: profile shape, caching, and the `batchserve calibrate` CLI."""

from __future__ import annotations

import itertools

import pytest

from batchserve.admission import Submission
from batchserve.config import CacheConfig, DraftConfig, EngineConfig, SchedulerConfig
from batchserve.cost_profile import CostProfile
from batchserve.engine import EngineCore
from batchserve.runner import calibrate as cal
from tests.conftest import make_tiny_model, make_tiny_tokenizer


def _core(num_blocks: int = 256, **draft) -> EngineCore:
    config = EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
        draft=DraftConfig(**{"adaptive": False, **draft}),
    )
    return EngineCore(config, make_tiny_model(), make_tiny_tokenizer())


def test_a_curve_that_pays_a_whole_block_for_its_first_row_has_that_block():
    counts = (1, 2, 4, 5, 8, 9, 16)
    assert cal.row_block_of(counts, (11, 11, 14, 24, 25, 35, 47)) == 4  # int4 on AVX2, measured
    assert cal.row_block_of(counts, (30, 31, 36, 49, 56, 75, 80)) == 4  # whole steps of that model, measured
    assert cal.row_block_of(counts, (11, 12, 14, 17, 26, 52, 58)) == 8  # 9 rows pay most of 9-16
    assert cal.row_block_of(counts, (10, 11, 12, 13, 16, 17, 24)) == 1  # linear: no block
    assert cal.row_block_of((1, 2, 4, 8), (10, 11, 12, 20)) == 1  # 5 and 9 not measured: no claim


def test_calibrate_measures_a_curve_per_context():
    core = _core()
    profile = cal.calibrate(core.runner, max_tokens=48, max_context=1024, contexts=(8, 128), repeats=2, progress=False)
    assert profile.contexts == (8, 128)
    assert profile.token_counts[0] == 1 and profile.token_counts[-1] == 48
    assert set(profile.token_counts) <= set(cal.TOKEN_COUNTS) | {48}
    for row in profile.step_ms:
        assert len(row) == len(profile.token_counts) and all(t > 0 for t in row)
    assert len(profile.per_seq_ms) == 2 and all(t >= 0 for t in profile.per_seq_ms)
    assert profile.key == cal.profile_key(core.runner)
    assert 1 <= profile.critical_decoding_length() <= 48
    # The synthetic steps leave no runner state behind, and the engine still generates.
    assert not core.runner._generators
    core.add_request(Submission([1, 2, 3]))
    while core.has_work():
        core.step()


def test_calibrate_keeps_the_dips_and_ignores_interference(monkeypatch):
    """A step with more rows may be faster (CPU matmul kernels change with the row count):
    the profile keeps that. A slow run (another process on the machine) moves nothing."""
    cost = {1: 10.0, 2: 30.0, 3: 28.0, 4: 14.0, 5: 15.0, 6: 16.0, 8: 18.0}
    calls = itertools.count()

    def fake_time(runner, out):
        rows = sum(len(r.token_ids) + len(r.draft or ()) for r in out.requests)
        # Every 3rd timing is disturbed; what one request's rows cost is the scripted table.
        return cost.get(rows, 20.0 + rows) * (5.0 if next(calls) % 3 == 0 else 1.0)

    monkeypatch.setattr(cal, "_time_once", fake_time)
    profile = cal.calibrate(_core().runner, max_tokens=8, max_context=1024, contexts=(8,), repeats=6, progress=False)
    assert profile.token_counts == (1, 2, 3, 4, 5, 6, 8)
    assert profile.step_ms == ((10.0, 30.0, 28.0, 14.0, 15.0, 16.0, 18.0),)
    assert profile.time_ms(4) < profile.time_ms(2)  # the policy sees the cheaper step


def test_calibrate_measures_what_a_draft_row_costs_among_many_requests(monkeypatch):
    """Uneven draft trees across many requests cost more a row than one request's chain (the
    attention pads or splits them): the profile's draft_ms is that extra, and only that."""

    def fake_time(runner, out):
        n = len(out.requests)
        rows = sum(1 + len(r.draft or ()) for r in out.requests)
        trees = any(r.draft is not None and len(r.draft) > 1 and r.draft.parents[1] is None for r in out.requests)
        return 10.0 + rows + 0.5 * (n - 1) + (3.0 * (rows - n) if n > 1 and trees else 0.0)

    monkeypatch.setattr(cal, "_time_once", fake_time)
    profile = cal.calibrate(_core().runner, max_tokens=48, max_context=1024, contexts=(8,), repeats=2, progress=False)
    assert profile.per_seq_ms == pytest.approx((0.5,))
    assert profile.draft_ms == pytest.approx((3.0,))
    # The measured step: DRAFT_PATTERN's trees, two draft rows a request on average.
    step = cal._draft_step(_core().runner, [8] * 16)
    assert cal._pattern_rows(16) == 32 == sum(len(r.draft or ()) for r in step.requests) and len(step.requests) == 16
    assert max(len(r.draft or ()) for r in step.requests) == max(cal.DRAFT_PATTERN)
    # Too few rows allowed for many requests' drafts: none measured, nothing claimed.
    small = cal.calibrate(_core().runner, max_tokens=4, max_context=1024, contexts=(8,), repeats=1, progress=False)
    assert small.draft_ms == (0.0,)


def test_lower_quartile():
    assert cal.lower_quartile([5.0]) == 5.0
    assert cal.lower_quartile([9.0, 1.0, 100.0, 2.0, 3.0]) == 2.0  # not the single luckiest run


def test_calibrate_fits_what_the_pool_and_context_allow():
    core = _core(num_blocks=8)  # 128 slots: neither 512 nor 2048 tokens of context fit
    profile = cal.calibrate(core.runner, max_tokens=32, max_context=1024, repeats=1, progress=False)
    assert len(profile.contexts) == 1 and profile.contexts[0] + 32 < 8 * 16
    with pytest.raises(ValueError):
        cal.calibrate(core.runner, max_tokens=0, progress=False)


def test_engine_calibrates_once_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHSERVE_CACHE_DIR", str(tmp_path))
    calls = []
    real = cal.calibrate

    def counting(*args, **kwargs):
        calls.append(kwargs)
        kwargs["repeats"] = 1
        kwargs["progress"] = False
        return real(*args, **kwargs)

    monkeypatch.setattr(cal, "calibrate", counting)
    first = _core(adaptive=True)
    assert len(calls) == 1 and calls[0]["max_tokens"] == 64
    # A server's first start measures only the quick profile (seconds, not minutes).
    quick = tuple(c for c in cal.QUICK_TOKEN_COUNTS if c <= 64)  # the tiny model affords every count
    assert calls[0]["token_counts"] == quick and calls[0]["contexts"] == cal.QUICK_CONTEXTS
    saved = list((tmp_path / "profiles").glob("*.json"))
    assert len(saved) == 1 and CostProfile.load(saved[0]) == first.cost_profile
    second = _core(adaptive=True)
    assert len(calls) == 1 and second.cost_profile == first.cost_profile
    assert second.speculation.policy is not None
    saved[0].write_text('{"key": ')  # a damaged cache entry is measured again, not fatal
    third = _core(adaptive=True)
    assert len(calls) == 2 and CostProfile.load(saved[0]) == third.cost_profile
    # No speculation, no profile needed.
    assert _core(adaptive=True, method="none").cost_profile is None and len(calls) == 2


def test_a_cache_that_cannot_be_written_still_serves(tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")  # profiles/ cannot be made under a file
    monkeypatch.setenv("BATCHSERVE_CACHE_DIR", str(blocked))
    monkeypatch.setattr(cal, "QUICK_REPEATS", 1)
    with caplog.at_level("WARNING"):
        core = _core(adaptive=True)
    assert core.cost_profile is not None and core.speculation.policy is not None
    assert "could not save cost profile" in caplog.text


def test_profile_path_is_per_key(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHSERVE_CACHE_DIR", str(tmp_path))
    a, b = cal.profile_path("m-1-float32-cpu x2"), cal.profile_path("m-1-bfloat16-cpu x2")
    assert a != b and a.parent == tmp_path / "profiles" and " " not in a.name


def test_calibrate_cli(tmp_path, capsys):
    from batchserve.cli import main

    model_dir = tmp_path / "tiny"
    make_tiny_model().save_pretrained(model_dir)
    make_tiny_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "profile.json"
    argv = ["calibrate", "--model", str(model_dir), "--max-tokens", "16", "--contexts", "8,32", "--repeats", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "critical decoding length at context 8" in text and str(out) in text
    profile = CostProfile.load(out)
    assert profile.contexts == (8, 32) and profile.token_counts[-1] == 16
    assert main(["calibrate", "--model", str(tmp_path / "missing")]) == 2
    assert main(["calibrate", "--model", str(model_dir), "--max-tokens", "0"]) == 2


def test_the_quick_profile_measures_what_its_budget_affords_and_extrapolates_the_rest(tmp_path, monkeypatch, caplog):
    core = _core()

    # Steps of 100 ms a row: 1, 2 and 4 rows project to 0.7 s + 9 runs x (0.7 s + four 4-row steps
    # for the per-request cost) = 21.4 s; with 5 rows, 30 s.
    def rows(out) -> int:
        return sum(len(r.token_ids) + (len(r.draft.tokens) if r.draft else 0) for r in out.requests)

    monkeypatch.setattr(cal, "_time_once", lambda runner, out: 100.0 * rows(out))
    counts = cal.affordable_counts(core.runner, (1, 2, 4, 5, 8, 64), 64, runs=9, budget_s=25.0)
    assert counts == (1, 2, 4)
    assert cal.affordable_counts(core.runner, (1, 2, 4), 64, runs=9, budget_s=0.0) == (1, 2)  # two at least
    assert cal.affordable_counts(core.runner, (1, 2, 4, 5), 64, runs=9, budget_s=1e9) == (1, 2, 4, 5)
    # At start-up: the profile stops at the affordable counts, its curve extrapolated past them.
    monkeypatch.setenv("BATCHSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cal, "QUICK_BUDGET_S", 25.0)
    monkeypatch.setattr(cal, "QUICK_REPEATS", 1)
    with caplog.at_level("INFO", logger="batchserve"):
        profile = _core(adaptive=True).cost_profile
    assert profile is not None and profile.token_counts[-1] < 64
    assert "the rest extrapolated" in caplog.text
    last = profile.token_counts[-1]
    assert profile.time_ms(64, 64) > profile.time_ms(last, 64) > profile.time_ms(1, 64)  # the last segment, on


def test_a_steps_rows_carry_distinct_ids_spread_over_the_vocabulary():
    """A mixture of experts routes each row by its token: rows of one id (every request's root
    the same token, as the steps had) read one token's experts where text reads many, and the
    profile priced an MoE step's rows far below their cost."""
    runner = _core().runner
    vocab = cal.vocab_of(runner)
    assert vocab == 256
    many = cal.step_of(runner, [8] * 16, 16)  # 16 requests, a row each
    roots = [r.token_ids[0] for r in many.requests]
    assert len(set(roots)) == 16 and max(roots) - min(roots) > vocab // 2
    one = cal.step_of(runner, [8], 40)  # one request's chain
    chain = one.requests[0].draft
    assert chain is not None and len(set(chain.tokens)) == 39 and set(chain.tokens).isdisjoint(roots[:1])
    trees = cal._draft_step(runner, [8] * 8)
    for r in trees.requests:
        if r.draft is not None and len(r.draft) > 1:  # the root's two branches differ
            assert r.draft.tokens[0] != r.draft.tokens[1]
    assert all(0 <= t < vocab for t in cal.spread_tokens(5000, vocab))
    assert len(set(cal.spread_tokens(vocab, vocab))) == vocab  # distinct up to the vocabulary's size
