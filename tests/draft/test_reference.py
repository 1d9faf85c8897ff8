"""Drafts from a request's references (predicted outputs): where they copy from, how long the
chains are, that every drafter takes them, and that they stay private to their request."""

from __future__ import annotations

import pytest

from batchserve.config import DraftConfig
from batchserve.draft import HybridDrafter, JacobiDrafter, NoDrafter, SingleBranchDrafter, TrieDrafter
from batchserve.draft.reference import ReferenceDrafts
from batchserve.draft.simulate import simulate
from batchserve.trees import MATCH_CAP, DraftTree, merge_trees
from tests.engine.drafters import token_path

REF = [10, 11, 12, 13, 14, 15, 16, 17]


def _paths(tree: DraftTree | None) -> set[tuple[int, ...]]:
    return set() if tree is None else {token_path(tree, i) for i in range(len(tree))}


def test_a_prediction_drafts_from_its_first_token_and_follows_accepted_text():
    d = ReferenceDrafts()
    d.start("r", [REF])
    tree = d.propose("r", [1, 2, 3], 3)  # nothing generated yet: the prediction's start
    assert tree.tokens == (10, 11, 12) and tree.parents == (None, 0, 1)
    assert tree.referenced == frozenset(range(3))
    d.accepted("r", [10, 11, 12, 13])  # three drafts and the bonus, all as predicted
    assert d.propose("r", [1, 2, 3, 10, 11, 12, 13], 8).tokens == (14, 15, 16, 17)  # to the end
    d.accepted("r", [14, 15, 16, 17])
    assert d.propose("r", [1, 2, 3, *REF], 8) is None  # nothing left to copy
    d.finish("r")
    assert len(d) == 0 and d.propose("r", [1], 4) is None


def test_after_a_miss_the_chain_shrinks_then_doubles_while_accepted_whole():
    d = ReferenceDrafts()
    d.start("r", [list(range(100, 140))])
    assert len(d.propose("r", [1], 16)) == 16
    d.accepted("r", [100, 101, 7])  # two drafts accepted, then the model's own token
    tokens = [1, 100, 101, 7]
    # Lost: the prediction is found again after the longest suffix it holds ([101] here, the
    # 7 is nowhere in it), and the chain is one past what was accepted.
    assert d.propose("r", tokens, 16) is None  # [7] occurs nowhere: nothing to copy
    d.accepted("r", [102])
    tree = d.propose("r", [*tokens, 102], 16)
    assert tree.tokens == (103, 104, 105)  # copy length 3 (two hits + 1), from after 102
    d.accepted("r", [103, 104, 105, 106])
    assert len(d.propose("r", [*tokens, *range(102, 107)], 16)) == 6  # accepted whole: doubled


def test_finding_the_text_again_reads_the_document_forward():
    # An edit changes the middle; afterwards the text agrees with the prediction again. The
    # key [5] occurs twice; the search starts where the last agreement ended.
    ref = [5, 20, 21, 22, 23, 5, 30, 31, 32]
    d = ReferenceDrafts(max_match=1)
    d.start("r", [ref])
    d.accepted("r", [5, 20, 21, 22, 23])  # as predicted (pos 5)
    d.accepted("r", [99])  # the edit: lost
    assert d.propose("r", [0, 5, 20, 21, 22, 23, 99, 5], 3).tokens == (30, 31, 32)  # not (20, 21, 22)


def test_several_references_agreeing_first_then_by_match_length_merged_by_path():
    d = ReferenceDrafts(max_match=3)
    d.start("r", [[1, 2, 3, 40, 41], [7, 8, 9, 50], [2, 3, 60, 61]])
    d.accepted("r", [7])  # only the second reference still agrees
    tree = d.propose("r", [0, 1, 2, 3, 7], 10)
    assert token_path(tree, 0) == (8,)  # the agreeing one first
    d.accepted("r", [8, 9, 51])
    tree = d.propose("r", [0, 2, 3], 10)  # all lost: found again by the suffix [2, 3]
    assert _paths(tree) >= {(40,), (40, 41), (60,), (60, 61)}
    assert tree.tokens[0] == 40  # a tie in match length: the first reference first


def test_references_come_first_and_the_drafter_fills_the_rest():
    own = DraftTree((10, 99, 5), (None, 0, None), (0.5, 0.5, 0.4))
    d = ReferenceDrafts()
    d.start("r", [REF])
    tree = d.ahead("r", [1], 5, own)
    assert tree.tokens[:5] == (10, 11, 12, 13, 14) and len(tree) == 5  # the chain took the budget
    d.start("r", [REF[:2]])
    tree = d.ahead("r", [1], 6, own)
    assert _paths(tree) == {(10,), (10, 11), (10, 99), (5,)}  # (10,) shared, not drafted twice
    assert {token_path(tree, i) for i in tree.referenced} == {(10,), (10, 11)}
    assert d.ahead("r", [1], 6, own, single=True).tokens == (10, 11)
    assert d.ahead("other", [1], 6, own) is own  # no references: the drafter's tree as it was


def test_merging_and_cutting_trees_keeps_the_marks():
    ref = DraftTree.chain([1, 2]).with_referenced({0, 1})
    pool = DraftTree((1, 3), (None, 0)).with_pooled({0, 1})
    merged = merge_trees(ref, pool, 10)
    assert {token_path(merged, i) for i in merged.referenced} == {(1,), (1, 2)}
    assert {token_path(merged, i) for i in merged.pooled} == {(1, 3)}  # (1,) came from the reference
    assert merged.prefix(1).referenced == frozenset({0}) and merged.prefix(1).pooled == frozenset()
    # The merged tree's match is its best source's; cutting and marking keep it; it is capped.
    assert merge_trees(ref.with_match(3), pool.with_match(9), 10).match == 9
    assert merge_trees(ref.with_match(3), pool, 10).match == 3
    kept = ref.with_match(7)
    assert kept.prefix(1).match == kept.with_pooled({0}).match == kept.with_referenced({1}).match == 7
    assert ref.with_match(10**6).match == MATCH_CAP


def test_a_prediction_being_followed_is_the_longest_match():
    d = ReferenceDrafts()
    d.start("r", [REF])
    assert d.propose("r", [1, 2, 3], 3).match == MATCH_CAP  # read from its start, then along
    d.accepted("r", [10, 99])  # the output left it
    assert d.propose("r", [1, 2, 3, 10, 99, 13], 3).match == 1  # found again from one token
    # A reference followed to its end drafts nothing, so it does not lend the tree its match.
    d.start("s", [[10, 11], [11, 30, 31]])
    d.accepted("s", [10, 11])
    tree = d.propose("s", [1, 10, 11], 4)
    assert tree.tokens == (30, 31) and tree.match == 1
    with pytest.raises(ValueError, match="match"):
        DraftTree((1,), (None,), match=-1)


@pytest.mark.parametrize("make", [TrieDrafter, SingleBranchDrafter, JacobiDrafter, HybridDrafter])
def test_every_drafter_drafts_the_references_first_and_forgets_them(make):
    d = make(DraftConfig(method="jacobi")) if make in (JacobiDrafter, HybridDrafter) else make()
    d.on_request_start("r", [1, 2, 3], references=[REF])
    tree = d.propose("r", [1, 2, 3], 4)
    assert tree.tokens[:4] == (10, 11, 12, 13) and set(range(4)) <= tree.referenced
    d.on_tokens_accepted("r", [10, 11])
    assert d.propose("r", [1, 2, 3, 10, 11], 2).tokens[:2] == (12, 13)
    d.on_request_finish("r")
    assert len(d.references) == 0


def test_no_drafter_takes_references_and_drafts_nothing():
    d = NoDrafter()
    d.on_request_start("r", [1, 2, 3], references=[REF])
    assert d.propose("r", [1, 2, 3], 8) is None


def test_a_prediction_never_reaches_another_request_or_the_shared_trie():
    d = TrieDrafter(DraftConfig(branch_length=4))
    secret = [200, 201, 202, 203, 204, 205]
    d.on_request_start("a", [1, 2, 3], scope="", references=[secret])
    d.on_request_start("b", [1, 2, 3], scope="")  # the same scope: they share output n-grams
    assert d.propose("a", [1, 2, 3], 4).tokens == (200, 201, 202, 203)
    d.on_tokens_accepted("a", [7])  # a's output is not its prediction
    nodes = d.num_nodes
    for key in ([1, 2, 3], [1, 2, 3, 200], [200, 201], [3]):
        tree = d.propose("b", key, 16)
        assert not set(secret) & set(tree.tokens if tree is not None else ())
        assert tree is None or not tree.referenced
    assert d.num_nodes == nodes and (200,) not in (d.trie_counts("") or {})  # the trie holds output only
    d.on_request_finish("a")  # finished or aborted: the scheduler calls the same
    assert len(d.references) == 0 and d.propose("a", [1, 2, 3], 4) is None
    d.on_request_finish("b")


def test_simulation_takes_references():
    output = list(range(50, 90))
    plain = simulate(TrieDrafter(), "r", [1, 2, 3], output, 16)
    predicted = simulate(TrieDrafter(), "r", [1, 2, 3], output, 16, references=[output])
    assert plain.steps == len(output) and predicted.steps <= 3
