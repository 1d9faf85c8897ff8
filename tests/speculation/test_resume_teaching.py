"""What a resumed request teaches the drafter through the planner: nothing of what it was sent.

`resume_token_ids` are whatever a client says it generated before. The planner hands them to the
drafter as the request's own text, so the request drafts from them, but no scope's trie or
recent outputs learn them: a flood of random resumed ids leaves another tenant's state as it was,
and text resumed in the shared scope (clients without a tenant key) is nobody else's draft."""

from __future__ import annotations

import random
from collections.abc import Sequence

from batchserve.config import DraftConfig
from batchserve.draft.trie import TrieDrafter
from batchserve.records import CommittedDraft, ScheduledRequest
from batchserve.request import Request, SamplingParams
from batchserve.speculation.planner import Speculation

SEP = -1  # between two outputs in `recent_text`


def _planner() -> Speculation:
    config = DraftConfig(method="lookahead", adaptive=False)
    return Speculation(TrieDrafter(config), config, policy=None)


def _request(rid: str, prompt: Sequence[int], tenant: str = "", resumed: Sequence[int] = ()) -> Request:
    """A request as the engine admits it; a resumed one holds its resumed tokens as output."""
    params = SamplingParams(max_new_tokens=len(resumed) + 100)
    req = Request(rid, list(prompt), params, frozenset(), max_total_len=100_000, tenant=tenant)
    req.output_token_ids = list(resumed)
    req.all_token_ids = [*prompt, *resumed]
    return req


def _generate(planner: Speculation, req: Request, output: Sequence[int]) -> None:
    """Run `req` through the planner: it starts, commits `output` a few tokens a step, ends."""
    planner.start(req)
    for i in range(0, len(output), 3):
        tokens = list(output[i : i + 3])
        last = (req.all_token_ids[-1],)
        item = ScheduledRequest(req.request_id, last, req.num_tokens - 1, (), None, True, req.params)
        req.output_token_ids += tokens
        req.all_token_ids += tokens
        planner.commit([CommittedDraft(item, [], tokens, None)])
    planner.finish(req.request_id)


def test_a_flood_of_resumed_ids_teaches_no_scope_and_leaves_other_tenants_intact() -> None:
    flooded, calm = _planner(), _planner()
    answer = random.Random(1).sample(range(5000, 6000), 60)
    for planner in (flooded, calm):
        _generate(planner, _request("b", range(100, 140), tenant="B"), answer)
    rng = random.Random(0)
    for i in range(4):  # other tenants resume 7,000 random ids each, then generate a little
        resumed = [rng.randrange(50_000) for _ in range(7000)]
        _generate(flooded, _request(f"a{i}", [1, 2, 3], tenant="A", resumed=resumed), [7, 8, 9])
    drafter, twin = flooded.drafter, calm.drafter
    assert isinstance(drafter, TrieDrafter) and isinstance(twin, TrieDrafter)
    assert drafter.trie_counts("B") == twin.trie_counts("B") and drafter.recent_text("B") == twin.recent_text("B")
    # Tenant A's scope learned what its requests generated, none of what they were sent.
    assert drafter.recent_text("A") == [7, 8, 9, SEP] * 4
    assert set(drafter.trie_counts("A") or {}) == {(7,), (7, 8), (7, 8, 9), (8,), (8, 9), (9,)}


def test_text_resumed_in_the_shared_scope_is_nobody_elses_draft() -> None:
    planner = _planner()
    sent = random.Random(2).sample(range(7000, 8000), 300)  # no tenant key: the shared scope ""
    _generate(planner, _request("x", [5, 6], resumed=sent), [1, 2, 3])
    drafter = planner.drafter
    assert isinstance(drafter, TrieDrafter)
    assert drafter.recent_text("") == [1, 2, 3, SEP]
    assert not any(t in sent for path in drafter.trie_counts("") or {} for t in path)
    for rid, prompt in (("same prompt", [5, 6]), ("its prefix", sent[:50])):
        probe = _request(rid, prompt)
        planner.start(probe)
        assert drafter.propose(rid, probe.all_token_ids, 64) is None, rid
        planner.finish(rid)
