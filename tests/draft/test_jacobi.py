"""The Jacobi window, the n-gram pool and the hybrid merge (Lookahead Decoding), without a model."""

from __future__ import annotations

import numpy as np
import pytest

from batchserve.config import DraftConfig
from batchserve.draft import HybridDrafter, JacobiDrafter, WindowDrafter
from batchserve.draft.jacobi import JacobiShape, NgramPool, merge_trees
from batchserve.request import SamplingParams
from batchserve.trees import DraftTree, window_rows
from tests.engine.drafters import token_path


def _drafter(**kw) -> JacobiDrafter:
    kw.setdefault("window_size", 3)
    kw.setdefault("ngram_size", 3)
    kw.setdefault("guesses", 4)
    return JacobiDrafter(DraftConfig(method="jacobi", **kw))


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {token_path(tree, i) for i in range(len(tree))}


def test_window_rows_are_causal_chains_of_consecutive_positions():
    """Row (level i, column j) sees level 0 up to column j, then column j of levels 1..i: a chain
    whose positions run 1, 2, ... below the root with no gap, ending at the row itself."""
    levels = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    rows = window_rows(levels)
    assert rows.tokens == (10, 11, 12, 20, 21, 22, 30, 31, 32)
    assert rows.num_outputs == 3  # the last level's rows feed the next level
    width = 3
    for r in range(len(rows)):
        i, j = divmod(r, width)
        seen = np.flatnonzero(rows.mask[r]).tolist()
        assert seen == sorted([*range(j + 1), *(lv * width + j for lv in range(1, i + 1))])
        assert sorted(rows.offsets[c] for c in seen) == list(range(1, rows.offsets[r] + 1))
        assert rows.offsets[r] == 1 + i + j


def test_pool_keeps_most_recent_first_counts_repeats_and_bounds_size():
    pool = NgramPool(capacity=4, per_key=2)
    pool.add("a", [1, 2, 3])
    pool.add("a", [1, 4, 5])
    pool.add("a", [1, 2, 3])  # seen again: most recent, counted twice
    assert pool.candidates("a", 1, 5) == [((2, 3), 2), ((4, 5), 1)]
    pool.add("a", [1, 6, 7])  # a third continuation of 1: the oldest goes (per_key)
    assert pool.candidates("a", 1, 5) == [((6, 7), 1), ((2, 3), 2)]
    assert pool.candidates("b", 1, 5) == []  # scopes never mix
    for first in (8, 9, 10):
        pool.add("b", [first, 0])
    assert len(pool) == 4  # capacity: the scope holding the most gave up its oldest
    assert pool.candidates("a", 1, 5) == [((6, 7), 1), ((2, 3), 2)]
    assert [pool.candidates("b", f, 1) for f in (8, 9, 10)] == [[], [((0,), 1)], [((0,), 1)]]
    pool.drop_scope("b")
    assert len(pool) == 2 and pool.candidates("b", 9, 1) == []


def test_a_scope_that_floods_the_pool_evicts_its_own_ngrams_only():
    pool = NgramPool(capacity=10, per_key=4)
    for first in range(3):
        pool.add("quiet", [first, 1, 2])
    for first in range(100, 1100):
        pool.add("flood", [first, 1, 2])
    assert len(pool) == 10
    assert [pool.candidates("quiet", f, 1) for f in range(3)] == [[((1, 2), 1)]] * 3
    assert [pool.candidates("flood", f, 1) for f in range(1093, 1100)] == [[((1, 2), 1)]] * 7


def test_the_window_grows_to_n_minus_one_levels_then_pools_ngrams_and_slides():
    d = _drafter(window_size=3, ngram_size=4)
    prompt = [5, 6, 7, 8, 9]
    d.on_request_start("r", prompt, scope=None)
    rows = d.window("r", 100)
    assert rows is not None and len(rows) == 3 and set(rows.tokens) <= set(prompt)  # level 0 from the prompt
    first = list(rows.tokens)
    d.on_window_outputs("r", rows, [40, 41, 42])
    d.on_window_outputs("r", d.window("r", 100), [50, 51, 52])
    assert len(d.window("r", 100)) == 9 and len(d.pool) == 0  # 3 levels = N - 1: now full
    d.on_window_outputs("r", d.window("r", 100), [60, 61, 62])
    # Each column read down the levels, plus the new guess: one n-gram of N tokens per column.
    for j in range(3):
        assert (40 + j, 50 + j, 60 + j) in [rest for rest, _ in d.pool.candidates(("request", "r"), first[j], 10)]
    assert len(d.pool) == 3
    rows = d.window("r", 100)
    assert rows.tokens == (40, 41, 42, 50, 51, 52, 60, 61, 62)  # the oldest level dropped out
    assert d.window("r", 8) is None  # all or nothing: 9 rows do not fit 8
    d.on_window_outputs("r", window_rows([[1, 2, 3]]), [0, 0, 0])  # not this window: ignored
    assert d.window("r", 100).tokens == rows.tokens


def test_proposals_merge_the_pooled_ngrams_that_continue_the_last_token():
    d = _drafter(guesses=2)
    d.on_request_start("r", [1, 2, 3], scope="")
    for ngram in ([7, 1, 2], [7, 1, 3], [7, 4, 5], [8, 9, 9]):
        d.pool.add(("scope", ""), ngram)
    tree = d.propose("r", [3, 3, 7], max_tokens=10)
    # G = 2: the two most recent continuations of 7, merged by token path.
    assert _paths(tree) == {(4,), (4, 5), (1,), (1, 3)}
    assert tree.pooled == frozenset(range(len(tree)))
    assert all(0 < s <= 1 for s in tree.scores)
    assert d.propose("r", [3, 3, 6], max_tokens=10) is None  # nothing starts with 6
    assert len(d.propose("r", [7], max_tokens=3)) == 3  # the budget caps the tree


def test_pools_follow_the_trie_scope_and_a_private_pool_ends_with_its_request():
    d = _drafter()
    d.on_request_start("a", [1, 2], scope="tenant-a")
    d.on_request_start("b", [1, 2], scope="tenant-b")
    d.on_request_start("c", [1, 2], scope=None)  # its own n-grams only
    d.pool.add(("scope", "tenant-a"), [5, 6, 7])
    d.pool.add(("request", "c"), [5, 8, 9])
    assert _paths(d.propose("a", [5], 10)) == {(6,), (6, 7)}
    assert d.propose("b", [5], 10) is None
    assert _paths(d.propose("c", [5], 10)) == {(8,), (8, 9)}
    d.on_request_finish("c")
    d.on_request_finish("a")
    assert d.pool.candidates(("request", "c"), 5, 10) == []
    assert d.pool.candidates(("scope", "tenant-a"), 5, 10) != []  # a scope's pool outlives its requests


def test_a_request_asks_for_a_smaller_window_never_a_larger_one():
    d = _drafter(window_size=4, ngram_size=3, guesses=2)
    d.on_request_start("small", [1, 2, 3], window=(2, None, 1))
    d.on_request_start("large", [1, 2, 3], window=(9, 9, 9))
    assert len(d.window("small", 100)) == 2
    assert len(d.window("large", 100)) == 4
    assert JacobiShape(4, 3, 2).asked((9, 9, 9)) == JacobiShape(4, 3, 2)
    with pytest.raises(ValueError, match="jacobi"):
        SamplingParams(jacobi=(0, 3, 1))
    with pytest.raises(ValueError, match="jacobi"):
        SamplingParams(jacobi=(2, 1, 1))
    with pytest.raises(ValueError, match="ngram_size"):
        DraftConfig(ngram_size=1)


def test_merge_puts_the_trie_first_and_marks_only_what_the_pool_added():
    trie = DraftTree((1, 2, 3), (None, 0, None), (0.9, 0.8, 0.5))
    pool = DraftTree((1, 4, 5), (None, 0, 1), (0.5, 0.25, 0.1))
    merged = merge_trees(trie, pool, 10)
    assert merged.tokens[:3] == (1, 2, 3)
    assert _paths(merged) == {(1,), (1, 2), (3,), (1, 4), (1, 4, 5)}
    assert {token_path(merged, i) for i in merged.pooled} == {(1, 4), (1, 4, 5)}  # (1,) was the trie's
    assert merged.scores[:3] == trie.scores
    assert merged.prefix(4).pooled == frozenset({3})
    capped = merge_trees(trie, pool, 4)
    assert len(capped) == 4 and _paths(capped) == {(1,), (1, 2), (3,), (1, 4)}
    assert merge_trees(None, pool, 2).tokens == (1, 4)
    assert merge_trees(trie, None, 10) is trie


def test_hybrid_is_a_trie_drafter_with_a_window():
    d = HybridDrafter(DraftConfig(method="hybrid", branch_length=4, window_size=2, ngram_size=2, guesses=2))
    assert isinstance(d, WindowDrafter)
    d.warm_up([[1, 2, 3, 4]])  # the trie's warm-up works as before
    d.on_request_start("r", [9, 1, 2], scope="")
    d.jacobi.pool.add(("scope", ""), [2, 7])
    tree = d.propose("r", [9, 1, 2], 10)
    assert (3,) in _paths(tree) and (7,) in _paths(tree)
    assert {token_path(tree, i) for i in tree.pooled} == {(7,)}
    d.on_request_finish("r")
    assert d.window("r", 100) is None


def test_a_flood_of_one_off_scopes_never_evicts_a_tenant_that_came_back():
    d = _drafter(window_size=3, ngram_size=3, pool_capacity=12)
    for first in range(6):
        d.pool.add(("scope", "acme"), [first, 1, 2])
    d.on_request_start("again", [5, 6, 7], scope="acme")  # it comes back while its n-grams are pooled
    d.on_request_finish("again")
    assert d.pool.proven == {("scope", "acme")}
    for key in range(500):  # one-off scopes, each smaller than acme (it held the most: the old victim)
        for first in range(2):
            d.pool.add(("scope", f"key{key}"), [100 + first, key % 7, 3])
    assert len(d.pool) == 12
    assert [d.pool.candidates(("scope", "acme"), f, 1) for f in range(6)] == [[((1, 2), 1)]] * 6
