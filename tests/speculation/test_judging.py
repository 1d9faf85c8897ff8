"""Draft trees judged over as many steps as their depth needs (`speculation/judging.py`)."""

from __future__ import annotations

from batchserve.speculation.judging import MAX_OPEN, Decided, OpenJudgements
from batchserve.trees import DraftTree


def test_a_chain_whose_first_token_matches_is_decided_by_the_next_steps_tokens():
    j = OpenJudgements()
    chain = DraftTree((5, 6, 7, 8), (None, 0, 1, 2), (0.9, 0.8, 0.7, 0.6))
    now, late = j.judge("r", chain, [5])  # a shadow draft: one token emitted, node 0 hit
    assert now == Decided(0, 1, (0,), (0.9,)) and late == []
    assert j.num_open("r") == 1
    now, late = j.judge("r", None, [6, 7])  # the next step: two more tokens, two more hits
    assert now is None and late == [Decided(1, 3, (1, 2), (0.8, 0.7))]
    _, late = j.judge("r", None, [9])  # leaves the chain: node 3 is a miss, and the tree is done
    assert late == [Decided(3, 4, (), (0.6,))]
    assert j.num_open("r") == 0


def test_a_tree_the_first_token_leaves_is_decided_at_once_and_not_kept():
    j = OpenJudgements()
    now, late = j.judge("r", DraftTree.chain([5, 6, 7]), [4])
    assert now == Decided(0, 3, (), ()) and late == [] and j.num_open("r") == 0


def test_branches_are_decided_in_node_order_across_steps():
    # node 0: 5, node 1: 9 (a sibling), node 2: 6 under 5, node 3: 7 under 6
    tree = DraftTree((5, 9, 6, 7), (None, None, 0, 2))
    j = OpenJudgements()
    now, _ = j.judge("r", tree, [5])  # node 0 hit, node 1 missed; node 2 (and 3 below) open
    assert now == Decided(0, 2, (0,), ())
    _, late = j.judge("r", None, [6])
    assert late == [Decided(2, 3, (2,), ())]
    _, late = j.judge("r", None, [7])
    assert late == [Decided(3, 4, (3,), ())] and j.num_open("r") == 0


def test_every_open_tree_of_a_request_is_judged_oldest_first_and_forgotten_with_it():
    j = OpenJudgements()
    j.judge("r", DraftTree.chain([1, 2, 3]), [1])
    now, late = j.judge("r", DraftTree.chain([2, 3, 4]), [2])  # hits the old tree's node 1 too
    assert late == [Decided(1, 2, (1,), ())] and now == Decided(0, 1, (0,), ())
    assert j.num_open("r") == 2
    j.judge("other", DraftTree.chain([1, 2]), [1])
    j.forget("r")
    assert j.num_open("r") == 0 and j.num_open("other") == 1


def test_open_trees_are_bounded_per_request():
    j = OpenJudgements()
    for step in range(3 * MAX_OPEN):
        # Each step proposes the true next 100 tokens and emits one: every tree stays undecided.
        j.judge("r", DraftTree.chain(list(range(step, step + 100))), [step])
    assert j.num_open("r") == MAX_OPEN


def test_nothing_emitted_decides_nothing():
    j = OpenJudgements()
    assert j.judge("r", DraftTree.chain([1, 2]), []) == (None, [])
    assert j.num_open("r") == 0
