"""Where new requests start, per draft scope: one tenant's acceptance (or its drafts failing on
purpose) never moves where another tenant's requests start."""

from __future__ import annotations

from batchserve.speculation import acceptance
from batchserve.speculation.acceptance import AcceptanceTracker, WindowTracker


def test_a_scopes_failures_move_only_its_own_new_requests() -> None:
    t = AcceptanceTracker(8, decay=0.5, pool_rate=0.5)
    for i in range(20):
        t.begin(f"a{i}", "tenant-a")
        t.observe(f"a{i}", 8, ())  # every draft rejected
    t.begin("new-a", "tenant-a")
    t.begin("new-b", "tenant-b")
    t.begin("alone", None)
    assert t.gains("new-b", 8) == t.gains("never-begun", 8) == t.gains("alone", 8)  # the first guess
    assert t.gains("new-a", 8)[0] < 0.05 < t.gains("new-b", 8)[0]
    t.observe("alone", 8, ())  # a request that shares nothing teaches no one
    t.begin("alone-2", None)
    assert t.gains("alone-2", 8) == t.gains("new-b", 8)
    t.forget("alone")
    assert "\0alone" not in t._priors


def test_scope_priors_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(acceptance, "MAX_SCOPE_PRIORS", 3)
    t, w = AcceptanceTracker(4), WindowTracker()
    for i in range(10):
        for tracker in (t, w):
            tracker.begin(f"r{i}", f"scope{i}")
        t.observe(f"r{i}", 4, (0,))
        w.observe(f"r{i}", 2)
    assert len(t._priors) == len(w._priors) == 3 and "" in t._priors and "" in w._priors


def test_a_scopes_window_gains_stay_its_own() -> None:
    w = WindowTracker(initial=0.5, decay=0.5, pool_rate=0.5)
    for i in range(10):
        w.begin(f"a{i}", "a")
        w.observe(f"a{i}", 4)
    w.begin("new-a", "a")
    w.begin("new-b", "b")
    assert w.gain("new-a") > 1.5 and w.gain("new-b") == 0.5 == w.prior


def test_the_engine_begins_each_request_in_its_tenants_scope() -> None:
    from batchserve import SamplingParams
    from batchserve.admission import Submission
    from tests.conftest import tiny_llm

    core = tiny_llm(None, draft="lookahead", adaptive=True).engine
    for rid, tenant in (("x", "acme"), ("y", "zeta")):
        core.add_request(Submission([1, 2, 3], SamplingParams(max_new_tokens=2), request_id=rid, tenant=tenant))
    core.step()
    assert core.speculation.policy.tracker._scopes == {"x": "acme", "y": "zeta"}
    while core.has_work():
        core.step()
    assert core.speculation.policy.tracker._scopes == {}  # forgotten with the requests
