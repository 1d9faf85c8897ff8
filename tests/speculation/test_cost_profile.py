"""Cost profiles: interpolation across token counts and contexts, JSON storage, validation."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from batchserve.cost_profile import CostProfile
from tests.speculation.workloads import COUNTS, cpu_like, gpu_like


def test_profile_interpolates_extrapolates_and_round_trips(tmp_path):
    p = cpu_like()
    assert p.time_ms(1) == pytest.approx(80.0)
    assert p.time_ms(3) == pytest.approx(85.0)  # between the measured 2 and 4
    assert p.time_ms(1024) == pytest.approx(80 + 2.5 * 1023)  # the last segment extended
    assert p.time_ms(1, context=1024) == pytest.approx(100.0)  # halfway to the 1.5x context row
    assert p.time_ms(1, context=9999) > p.time_ms(1, context=2048)
    with_seqs = CostProfile("x", COUNTS, (0, 2048), p.step_ms, per_seq_ms=(0.5, 2.5))
    assert with_seqs.time_ms(16, num_seqs=16) == pytest.approx(p.time_ms(16) + 7.5)
    # Each further request costs more at longer contexts (its KV is gathered and padded).
    assert with_seqs.time_ms(16, 1024, num_seqs=16) == pytest.approx(p.time_ms(16, 1024) + 15 * 1.5)
    assert with_seqs.time_ms(16, 1024, num_seqs=1) == pytest.approx(p.time_ms(16, 1024))
    for profile in (p, with_seqs):
        profile.save(tmp_path / "p.json")
        assert CostProfile.load(tmp_path / "p.json") == profile
    with pytest.raises(ValueError, match="one entry per context"):
        CostProfile("x", COUNTS, (0, 2048), p.step_ms, per_seq_ms=(0.5,))


def test_replicas_saving_one_profile_at_once_never_fail_or_tear_it(tmp_path):
    # Replicas that share a cache directory and start together each save the profile they
    # measured: every save succeeds and the file is always one whole profile.
    profiles = [CostProfile(f"k{i}", COUNTS, (0, 2048), cpu_like().step_ms) for i in range(4)]
    target = tmp_path / "profiles" / "p.json"

    def save_many(profile: CostProfile) -> None:
        for _ in range(100):
            profile.save(target)
            assert CostProfile.load(target) in profiles

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(save_many, profiles))  # re-raises a failed save or a torn read
    assert [p.name for p in target.parent.iterdir()] == ["p.json"]  # no temporary file left
    assert target.stat().st_mode & 0o777 == 0o644  # readable by other replicas' users, as before


def test_profile_written_with_one_per_request_cost_still_loads(tmp_path):
    p = cpu_like()
    d = json.loads(p.to_json())
    d["per_seq_ms"] = 0.4  # an older profile: one number for every context
    (tmp_path / "old.json").write_text(json.dumps(d))
    old = CostProfile.load(tmp_path / "old.json")
    assert old.per_seq_ms == (0.4,) * len(p.contexts)
    assert old.seq_ms(777) == pytest.approx(0.4)


def test_a_started_row_block_costs_a_whole_one(tmp_path):
    # torch's int4 kernel on AVX2: each 4 rows read the weights again (measured 11, 14, 24, 25 ms
    # at 1, 4, 5 and 8 rows). Inside the first block rows are interpolated as measured.
    counts, ms = (1, 4, 5, 8, 16), (11.0, 14.0, 24.0, 25.0, 47.0)
    blocked = CostProfile("int4", counts, (0,), (ms,), row_block=4)
    assert blocked.time_ms(3) == pytest.approx(13.0)
    assert blocked.time_ms(5) == blocked.time_ms(7) == blocked.time_ms(8) == pytest.approx(25.0)
    assert blocked.time_ms(9) == blocked.time_ms(12) == pytest.approx(36.0)  # halfway from 8 to 16
    assert CostProfile("int4", counts, (0,), (ms,)).time_ms(6) == pytest.approx(24.33, abs=0.01)
    blocked.save(tmp_path / "p.json")
    assert CostProfile.load(tmp_path / "p.json") == blocked
    d = json.loads(blocked.to_json())
    del d["row_block"]  # a profile from before blocks were measured
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert CostProfile.load(tmp_path / "old.json").row_block == 1
    with pytest.raises(ValueError, match="row_block"):
        CostProfile("int4", counts, (0,), (ms,), row_block=0)


def test_critical_decoding_length():
    assert gpu_like(cdl=64).critical_decoding_length() == 64
    assert gpu_like(cdl=16).critical_decoding_length() == 16
    assert cpu_like().critical_decoding_length() == 4  # 87.5 ms is within 10% of 80, 97.5 is not


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(token_counts=(), contexts=(0,), step_ms=()),
        dict(token_counts=(2, 1), contexts=(0,), step_ms=((1.0, 2.0),)),
        dict(token_counts=(1, 2), contexts=(0,), step_ms=((1.0,),)),
        dict(token_counts=(1, 2), contexts=(0,), step_ms=((1.0, -2.0),)),
    ],
)
def test_bad_profiles_are_refused(kwargs):
    with pytest.raises(ValueError):
        CostProfile(key="k", **kwargs)


def test_load_of_something_else_names_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match=r"bad\.json"):
        CostProfile.load(bad)


def test_draft_rows_cost_their_extra_only_among_several_requests(tmp_path):
    p = cpu_like()
    drafty = CostProfile("x", COUNTS, (0, 2048), p.step_ms, draft_ms=(1.0, 3.0))
    # 16 rows of 8 requests, 8 of them drafts: the curve's share plus 8 draft rows' extra.
    assert drafty.time_ms(16, num_seqs=8, draft_rows=8) == pytest.approx(p.time_ms(16) + 8 * 1.0)
    assert drafty.time_ms(16, 1024, num_seqs=8, draft_rows=8) == pytest.approx(p.time_ms(16, 1024) + 8 * 2.0)
    # One request's chain is what the curve itself measured; no drafts, no extra.
    assert drafty.time_ms(16, num_seqs=1, draft_rows=15) == pytest.approx(p.time_ms(16))
    assert drafty.time_ms(16, num_seqs=16) == pytest.approx(p.time_ms(16, num_seqs=16))
    assert drafty.draft_row_ms(1024) == pytest.approx(2.0)
    drafty.save(tmp_path / "p.json")
    assert CostProfile.load(tmp_path / "p.json") == drafty
    d = json.loads(drafty.to_json())
    del d["draft_ms"]  # a profile from before draft rows were measured among requests
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert CostProfile.load(tmp_path / "old.json").draft_row_ms(0) == 0.0
    with pytest.raises(ValueError, match="one entry per context"):
        CostProfile("x", COUNTS, (0, 2048), p.step_ms, draft_ms=(1.0,))
    with pytest.raises(ValueError, match="positive"):
        CostProfile("x", COUNTS, (0, 2048), p.step_ms, draft_ms=(1.0, -1.0))
