"""One tenant cannot trim, evict or plant another's drafter state (issue 79, items 2 and 10).

Each scope is bounded on its own: a flood of output from some tenants trims only their own
state, and an idle tenant's trie, recent outputs and drafts on its repeated prompt come through
unchanged; a scope's bytes stay under `trie_scope_bytes` through a flood, and a trie trimmed after
one gives its memory back. A resumed request's tokens are its own text only: its scope learns
what it generates, never what it was sent, so nothing a client sends shows up in a shared scope."""

from __future__ import annotations

import random
from typing import Any

import pytest

from batchserve.config import DraftConfig
from batchserve.draft.trie import TrieDrafter
from batchserve.trees import DraftTree

SEP = -1  # between two outputs in `recent_text`
PROMPT = list(range(100, 140))
ANSWER = random.Random(9).sample(range(5000, 6000), 60)


def _agreeing(tree: DraftTree | None, wanted: list[int]) -> int:
    """How many of `wanted` the tree's best path holds: what verification accepts."""
    parent, n = None, 0
    for tok in wanted if tree is not None else ():
        assert tree is not None
        kid = next((i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if p == parent and t == tok), None)
        if kid is None:
            break
        parent, n = kid, n + 1
    return n


def _tokens_a_step(d: TrieDrafter, rid: str, scope: str, prompt: list[int], answer: list[int]) -> float:
    """Generate `answer` as greedy verification would: each step emits what the draft got right
    and one token more. Returns the tokens a step."""
    d.on_request_start(rid, prompt, scope=scope)
    text, done, steps = list(prompt), 0, 0
    while done < len(answer):
        emitted = answer[done : done + _agreeing(d.propose(rid, text, 16), answer[done:]) + 1]
        d.on_tokens_accepted(rid, emitted)
        text, done, steps = text + emitted, done + len(emitted), steps + 1
    d.on_request_finish(rid)
    return len(answer) / steps


def _flood(d: TrieDrafter, requests: int, tokens: int, seed: int = 0) -> None:
    """Other tenants' long random outputs, two scopes of them."""
    rng = random.Random(seed)
    for i in range(requests):
        d.on_request_start(f"flood{i}", [1, 2, 3], scope=f"A{i % 2}")
        for _ in range(tokens // 500):
            d.on_tokens_accepted(f"flood{i}", [rng.randrange(50_000) for _ in range(500)])
        d.on_request_finish(f"flood{i}")


@pytest.mark.parametrize("bounds", [{}, {"trie_scope_bytes": 1 << 20}], ids=["node cap", "byte quota"])
def test_a_flood_from_other_tenants_leaves_an_idle_tenants_state_and_drafts_intact(bounds: dict[str, Any]) -> None:
    flooded, calm = (TrieDrafter(DraftConfig(method="lookahead", **bounds)) for _ in range(2))
    for d in (flooded, calm):
        _tokens_a_step(d, "b1", "B", PROMPT, ANSWER)  # B answered once and went idle
    before = (calm.trie_counts("B"), calm.recent_text("B"), calm.scope_bytes("B"))
    _flood(flooded, requests=4, tokens=7000)
    _flood(flooded, requests=1, tokens=20_000, seed=1)
    assert (flooded.trie_counts("B"), flooded.recent_text("B"), flooded.scope_bytes("B")) == before
    for scope in ("A0", "A1"):  # the flooding scopes trimmed themselves to their bounds
        size = flooded.scope_bytes(scope)
        assert size is not None and size <= flooded.config.trie_scope_bytes
        assert 0 < len(flooded.trie_counts(scope) or {}) <= flooded.config.trie_capacity
    rate = _tokens_a_step(calm, "b2", "B", PROMPT, ANSWER)
    assert _tokens_a_step(flooded, "b2", "B", PROMPT, ANSWER) == rate >= 7  # its repeat drafts as before


def test_a_scope_stays_under_its_byte_quota_through_a_flood() -> None:
    quota = 512 << 10
    d = TrieDrafter(DraftConfig(method="lookahead", trie_scope_bytes=quota))
    rng = random.Random(2)
    for i in range(12):
        d.on_request_start(f"r{i}", [1], scope="s")
        for _ in range(8):
            d.on_tokens_accepted(f"r{i}", [rng.randrange(50_000) for _ in range(250)])
            size = d.scope_bytes("s")
            assert size is not None and size <= quota
        d.on_request_finish(f"r{i}")  # its output joins the recent outputs: still within the quota
        size = d.scope_bytes("s")
        assert size is not None and size <= quota
    assert d.num_nodes > 0 and d.stats()["scopes"] == ["s"]  # trimmed, not dropped
    assert d.memory_bytes() <= quota  # nothing else is held once no request runs


def test_a_trie_trimmed_after_a_flood_gives_its_memory_back() -> None:
    # 3k nodes held 14.9 MB after a flood: pruning freed slots, never the arrays.
    d = TrieDrafter(DraftConfig(method="lookahead", trie_capacity=3000, recent_output_tokens=0))
    rng = random.Random(1)
    d.on_request_start("a", [1], scope="s")
    for _ in range(100):
        d.on_tokens_accepted("a", [rng.randrange(50_000) for _ in range(200)])
        assert d.num_nodes <= 3000
        size = d.scope_bytes("s")
        # Up to 3000 nodes of 24 bytes (the array up to doubled) and a table of 4096 12-byte slots.
        assert size is not None and size <= 2 * 3001 * 24 + 4096 * 12 + 4096
    d.on_request_finish("a")
    assert d.memory_bytes() < 256 << 10


def test_resumed_tokens_are_the_requests_own_text_and_no_scopes() -> None:
    d = TrieDrafter(DraftConfig(method="lookahead", branch_length=4))
    sent = random.Random(4).sample(range(7000, 8000), 300)  # what a client says it generated before
    d.on_request_start("r", PROMPT, scope="")
    d.on_tokens_resumed("r", sent)
    tree = d.propose("r", [*PROMPT, *sent, *sent[:3]], 8)  # it drafts from them: they are its own text
    assert tree is not None and tree.tokens[:3] == tuple(sent[3:6])
    d.on_tokens_accepted("r", [1, 2, 3])
    d.on_request_finish("r")
    # The scope learned the generated tokens alone: no run reaches into the resumed ones.
    assert d.recent_text("") == [1, 2, 3, SEP]
    assert set(d.trie_counts("") or {}) == {(1,), (1, 2), (1, 2, 3), (2,), (2, 3), (3,)}
    for probe in (PROMPT, sent[:50]):  # its prompt (no repeat source) or a prefix of what it was sent
        d.on_request_start("probe", probe, scope="")
        assert d.propose("probe", probe, 64) is None
        d.on_request_finish("probe")


def test_a_flood_of_one_off_tenants_never_evicts_an_idle_tenant_that_came_back() -> None:
    """1,024 one-token requests under fresh keys (issue 89): new scopes share the probation
    quarter of the scope count and evict one another; a tenant whose second request ended is
    proven, and its trie and recent outputs survive the flood while it is idle."""
    d = TrieDrafter(DraftConfig(method="lookahead", branch_length=4, trie_max_scopes=16, recent_output_tokens=200))
    for i in range(2):  # the tenant comes back once: proven
        d.on_request_start(f"acme{i}", PROMPT, scope="acme")
        d.on_tokens_accepted(f"acme{i}", ANSWER)
        d.on_request_finish(f"acme{i}")
    trie, recent = d.trie_counts("acme"), d.recent_text("acme")
    for i in range(1024):
        d.on_request_start(f"f{i}", [1, 2], scope=f"key{i}")
        d.on_tokens_accepted(f"f{i}", [i % 97])
        d.on_request_finish(f"f{i}")
        assert len(d.stats()["scopes"]) <= 16
    assert d.trie_counts("acme") == trie and d.recent_text("acme") == recent
    assert sum(s.startswith("key") for s in d.stats()["scopes"]) == 4  # the probation quarter
    assert _tokens_a_step(d, "again", "acme", PROMPT, ANSWER) > 5  # its repeated prompt still drafts
