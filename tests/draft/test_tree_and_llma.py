from __future__ import annotations

import random

import pytest

from batchserve.config import DraftConfig
from batchserve.draft import NoDrafter, SingleBranchDrafter, TrieDrafter, make_drafter
from batchserve.trees import DraftTree
from tests.engine.drafters import random_tree, token_path


def test_tree_derived_fields():
    t = DraftTree((5, 6, 7, 8), (None, 0, None, 1))
    assert t.depths == (1, 2, 1, 3)
    assert t.children[None] == {5: 0, 7: 2}  # the root's children
    assert t.children[0] == {6: 1} and t.children[1] == {8: 3} and 2 not in t.children
    assert t.child(None, 7) == 2 and t.child(1, 8) == 3 and t.child(1, 5) is None and t.child(3, 5) is None
    assert token_path(t, 3) == (5, 6, 8)
    assert len(t) == 4


@pytest.mark.parametrize(
    ("tokens", "parents", "message"),
    [
        ((1, 2), (None,), "same length"),
        ((1, 2), (None, 1), "precede"),
        ((1, 2), (1, None), "precede"),
        ((1, 1), (None, None), "duplicate sibling"),
        ((1, 2, 2), (None, 0, 0), "duplicate sibling"),
    ],
)
def test_tree_invariants_are_enforced(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        DraftTree(tokens, parents)


def test_tree_scores_are_per_node_probabilities_and_follow_prefixes():
    t = DraftTree((5, 6, 7), (None, 0, None), (0.9, 0.5, 0.1))
    assert t.prefix(2).scores == (0.9, 0.5) and t.prefix(9) is t
    assert DraftTree((5, 6), (None, 0)).prefix(1).scores == ()  # a drafter without scores
    with pytest.raises(ValueError, match="one per node"):
        DraftTree((5, 6), (None, 0), (0.5,))
    for bad in ((1.5,), (-0.1, 0.5), (0.5, float("nan")), (float("nan"), 0.5), (0.2, float("inf"))):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            DraftTree((5, 6), (None, 0), bad) if len(bad) == 2 else DraftTree((5,), (None,), bad)


def test_chain_and_random_trees_hold_invariants():
    assert DraftTree.chain([4, 4, 4]).parents == (None, 0, 1)
    assert len(DraftTree.chain([])) == 0
    rng = random.Random(0)
    for _ in range(200):
        t = random_tree(rng, rng.randint(1, 64), 50)
        for i, p in enumerate(t.parents):
            assert p is None or p < i
        for parent, kids in t.children.items():
            assert all(t.parents[child] == parent and t.tokens[child] == tok for tok, child in kids.items())
        assert sum(len(kids) for kids in t.children.values()) == len(t)


def test_derived_trees_equal_the_same_trees_built_and_checked_from_scratch():
    rng = random.Random(1)
    for _ in range(200):
        t = random_tree(rng, rng.randint(1, 64), 50)
        n = len(t)
        scores = tuple(sorted((rng.random() for _ in range(n)), reverse=True))
        t = DraftTree(t.tokens, t.parents, scores)
        pooled, referenced = {i for i in range(n) if rng.random() < 0.3}, {i for i in range(n) if rng.random() < 0.3}
        match = rng.randrange(0, 50)
        if rng.random() < 0.5:
            t.mask  # noqa: B018 - a cached mask is carried into a prefix
        derived = t.with_pooled(pooled).with_referenced(referenced).with_match(match)
        assert derived == DraftTree(t.tokens, t.parents, scores, frozenset(pooled), frozenset(referenced), match)
        k = rng.randint(0, n)
        cut = derived.prefix(k)
        fresh = DraftTree(
            t.tokens[:k],
            t.parents[:k],
            scores[:k],
            frozenset(i for i in pooled if i < k),
            frozenset(i for i in referenced if i < k),
            match,
        )
        assert cut == fresh and (cut.mask == fresh.mask).all() and cut.children == fresh.children
    with pytest.raises(ValueError, match=">= 0"):
        DraftTree((5,), (None,)).with_match(-1)


def test_llma_copies_after_longest_most_recent_match():
    d = SingleBranchDrafter(max_match=4)
    #        0  1  2  3  4  5  6  7  8  9 10
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    # Suffix [1,2,3] last occurred at 5..7, followed by 7 5 1 2 3.
    tree = d.propose("r", toks, 3)
    assert tree is not None and tree.tokens == (7, 5, 1) and tree.parents == (None, 0, 1)
    # Longer match wins over a more recent shorter one.
    toks = [4, 5, 6, 100, 6, 200, 4, 5, 6]
    assert d.propose("r", toks, 2).tokens == (100, 6)


def test_llma_budget_and_no_match():
    d = SingleBranchDrafter()
    assert d.propose("r", [1, 2, 3, 4], 8) is None  # nothing repeats
    assert d.propose("r", [1, 2, 1], 0) is None  # no budget
    assert d.propose("r", [7], 4) is None
    tree = d.propose("r", [1, 2, 3, 1], 8)  # suffix [1] seen at 0: copy 2 3 1
    assert tree.tokens == (2, 3, 1)


def test_make_drafter():
    assert isinstance(make_drafter(DraftConfig(method="none")), NoDrafter)
    assert isinstance(make_drafter(DraftConfig(method="llma")), SingleBranchDrafter)
    assert isinstance(make_drafter(DraftConfig(method="lookahead")), TrieDrafter)
    with pytest.raises(ValueError, match="draft method"):
        DraftConfig(method="magic")  # type: ignore[arg-type]


def test_the_emitted_tokens_judge_a_whole_proposal_as_far_as_they_reach():
    t = DraftTree((5, 6, 7, 8), (None, 0, 1, None))  # a chain 5 6 7, and 8 beside 5
    assert t.judged([5, 6]) == (2, [0, 1])  # 7 sits below the last emitted token: undecided
    assert t.judged([5, 9]) == (4, [0])  # 6 missed, so 7 could not be reached: all decided
    assert t.judged([9]) == (4, [])
    assert t.judged([8]) == (4, [3])
    assert t.judged([5]) == (1, [0])  # one token: only the first level is decided
    assert t.judged([]) == (0, [])  # nothing emitted: nothing decided
