"""Seats per tenant: a tenant's long decodes give up seats, youngest first, to another tenant
waiting for one; within their shares, or alone, tenants see first come, first served."""

from __future__ import annotations

from batchserve.request import RequestStatus
from batchserve.scheduler.seats import SeatShares
from tests.scheduler.test_fairness import _req, _run, _sched


def _running(s, tenant: str) -> list[str]:
    return [r.request_id for r in s.running if r.tenant == tenant]


def test_a_seat_hogs_youngest_decode_gives_its_seat_at_the_next_step() -> None:
    s = _sched(max_num_seqs=4)
    for i in range(4):
        s.add_request(_req(f"hog{i}", 8, "hog"))
    for _ in range(3):  # every seat decoding
        _run(s)
    assert _running(s, "hog") == ["hog0", "hog1", "hog2", "hog3"]
    s.add_request(_req("small", 8, "small", max_new=1))
    out = _run(s)
    assert "small" in {r.request_id for r in out.requests}  # seated at once, not after a decode ends
    assert s.requests["hog3"].status is RequestStatus.WAITING and s.requests["hog3"].stats.num_preemptions == 1
    assert s.num_preemptions == 1
    _run(s)  # small finished; the hog's request comes back and recomputes
    assert "small" not in s.requests and _running(s, "hog") == ["hog0", "hog1", "hog2", "hog3"]


def test_a_tenant_at_its_share_is_not_preempted_again_and_keeps_its_place() -> None:
    s = _sched(max_num_seqs=4)
    for i in range(4):
        s.add_request(_req(f"hog{i}", 8, "hog"))
    _run(s)
    for i in range(5):  # a long queue of another tenant's decodes
        s.add_request(_req(f"b{i}", 8, "b", max_new=50))
    for _ in range(20):
        _run(s)
        assert sorted(r.tenant for r in s.running) == ["b", "b", "hog", "hog"]
    assert s.num_preemptions == 2  # once per seat over the share, never back and forth


def test_three_tenants_share_the_seats_rounded_up() -> None:
    s = _sched(max_num_seqs=4)
    for i in range(4):
        s.add_request(_req(f"a{i}", 8, "a"))
    _run(s)
    for t in "bc":
        for i in range(3):
            s.add_request(_req(f"{t}{i}", 8, t))
    _run(s)
    assert sorted(r.tenant for r in s.running) == ["a", "a", "b", "c"]  # at most ceil(4 / 3), wanting floor(4 / 3)


def test_one_tenant_alone_or_within_shares_is_never_preempted_for_seats() -> None:
    s = _sched(max_num_seqs=2)
    for i in range(6):
        s.add_request(_req(f"a{i}", 8, "a", max_new=20))
    for _ in range(10):
        _run(s)
    assert s.num_preemptions == 0 and _running(s, "a") == ["a0", "a1"]
    s.add_request(_req("b0", 8, "b", max_new=20))
    _run(s)
    assert s.num_preemptions == 1 and _running(s, "a") == ["a0"] and _running(s, "b") == ["b0"]
    s.add_request(_req("b1", 8, "b", max_new=20))  # b at its share: waits like anyone else
    for _ in range(5):
        _run(s)
    assert s.num_preemptions == 1


def test_a_background_tenant_wants_no_decodes_seat() -> None:
    s = _sched(budget=64, max_num_seqs=2)
    s.add_request(_req("a0", 8, "a"))
    s.add_request(_req("a1", 8, "a"))
    _run(s)
    s.add_request(_req("flood", 2000, "flood", max_new=10))  # more prompt than a step: background
    for _ in range(3):
        _run(s)
    assert s.num_preemptions == 0 and _running(s, "a") == ["a0", "a1"]


def test_shares_count_what_each_tenant_holds_and_wants() -> None:
    running = [_req(f"a{i}", 4, "a") for i in range(5)] + [_req("b0", 4, "b")]
    waiting = [_req("b1", 4, "b"), _req("b2", 4, "b"), _req("b3", 4, "b"), _req("c0", 4, "c")]
    seats = SeatShares.of(running, waiting, 6, frozenset())
    assert seats.share == 2 and seats.wanted == {"b": 1, "c": 1} and seats.free == 0  # 6 seats, 3 tenants
    assert [r.request_id for r in seats.victims(running)] == ["a4", "a3"]
    assert not seats.may_take(running[0]) and seats.may_take(waiting[0])
    assert SeatShares.of(running, waiting, 6, frozenset({"b", "c"})).victims(running) == []


def test_a_few_ordinary_prompts_beside_a_decoding_hog_are_not_background() -> None:
    """A seat hog's backlog is 0 (it only decodes): a tenant's 8 prompts of 110 tokens are 880,
    more than a step and twice the hog's; but they fit its share of the seats and a step each:
    no flood. They take their seats and are computed at once, not in the slack."""
    from batchserve.scheduler.fairness import background_tenants

    s = _sched(budget=512, max_num_seqs=16)
    for i in range(16):
        s.add_request(_req(f"hog{i}", 12, "hog"))
    _run(s)
    for i in range(8):
        s.add_request(_req(f"good{i}", 110, "good", max_new=8))
    assert background_tenants(s.requests.values(), 512, seats=16) == frozenset()
    assert background_tenants(s.requests.values(), 512) == {"good"}  # without the seats' view: held back
    sampled: set[str] = set()
    for _ in range(3):
        sampled |= {r.request_id for r in _run(s).requests if r.sample and r.request_id.startswith("good")}
    assert sampled == {f"good{i}" for i in range(8)}  # all eight first tokens within three steps
    flood = [_req(f"f{i}", 110, "flood") for i in range(20)] + [_req("d", 5, "decoder")]
    assert background_tenants(flood, 512, seats=16) == {"flood"}  # more requests than its share: a flood
