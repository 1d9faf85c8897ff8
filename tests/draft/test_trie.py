"""The Lookahead trie drafter: each procedure of the paper, one test or more."""

from __future__ import annotations

import json
import random

import pytest

from batchserve.config import DraftConfig
from batchserve.draft import TrieDrafter
from batchserve.draft.simulate import simulate
from batchserve.request import SamplingParams
from batchserve.trees import MATCH_CAP, DraftTree
from tests.engine.drafters import token_path


def _drafter(**kw) -> TrieDrafter:
    kw.setdefault("branch_length", 6)
    return TrieDrafter(DraftConfig(**kw))


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Every root-to-node token path of a tree."""
    return {token_path(tree, i) for i in range(len(tree))}


def _runs(tokens: list[int], b: int) -> dict[tuple[int, ...], float]:
    """The oracle: every run of up to `b` consecutive tokens of `tokens`, counted."""
    counts: dict[tuple[int, ...], float] = {}
    for start in range(len(tokens)):
        for end in range(start + 1, min(len(tokens), start + b) + 1):
            counts[tuple(tokens[start:end])] = counts.get(tuple(tokens[start:end]), 0.0) + 1
    return counts


def test_the_output_trie_counts_every_run_up_to_branch_length():
    d = _drafter(branch_length=3)
    d.warm_up([[1, 2, 1, 2, 3]])
    counts = d.trie_counts("")
    assert counts == _runs([1, 2, 1, 2, 3], 3)
    assert counts[(1,)] == 2 and counts[(1, 2)] == 2 and (1, 2, 1, 2) not in counts  # longer than 3
    # Output inserted as it is accepted, a few tokens a step, counts the same runs: its own only
    # (its prompt never), in a scope of its own.
    rng = random.Random(4)
    output = [rng.randrange(5) for _ in range(60)]
    d.on_request_start("a", [9, 9, 9], scope="s")
    at = 0
    while at < len(output):
        k = rng.randint(1, 4)
        d.on_tokens_accepted("a", output[at : at + k])
        at += k
    assert d.trie_counts("s") == _runs(output, 3) and d.num_nodes == len(counts) + len(_runs(output, 3))


def test_prompt_branches_are_inserted_at_start():
    d = _drafter()
    d.on_request_start("a", [5, 6, 7, 8, 9, 5, 6])
    tree = d.propose("a", [5, 6, 7, 8, 9, 5, 6], 4)
    assert tree is not None and tree.tokens[:3] == (7, 8, 9)


def test_a_request_copying_its_prompt_drafts_past_the_output_tries_depth():
    # A 20-token run of the prompt, started again: the request's own text drafts all of it in one
    # path (own_branch_length 24), while the output trie counts runs of branch_length (6) only.
    run = list(range(100, 120))
    d = _drafter(own_branch_length=24)
    d.on_request_start("a", [*run, 7, run[0]], scope="")
    tree = d.propose("a", [*run, 7, run[0]], 32)
    # The whole rest of the prompt after the 1-token match: 21 tokens in one path.
    assert tree is not None and (*run[1:], 7, run[0]) in _paths(tree)
    d.on_tokens_accepted("a", run[1:])  # the same run as output: the trie keeps 6-token runs
    counts = d.trie_counts("")
    assert tuple(run[1:7]) in counts and tuple(run[1:8]) not in counts
    shallow = _drafter(own_branch_length=6)
    shallow.on_request_start("a", [*run, 7, run[0]])
    tree = shallow.propose("a", [*run, 7, run[0]], 32)
    assert tree is not None and max(map(len, _paths(tree))) == 5  # 6 tokens, the match key's among them


def test_own_output_is_reused_on_the_fly():
    d = _drafter()
    prompt = [1, 2, 3]
    d.on_request_start("a", prompt)
    phrase = [40, 41, 42, 43, 44]
    d.on_tokens_accepted("a", [*phrase, 9])
    # Before the request finishes, its own output already drafts the phrase again.
    tree = d.propose("a", [*prompt, *phrase, 9, 40], 4)
    assert tree is not None and (41, 42, 43, 44) in _paths(tree)


def test_other_requests_outputs_are_shared_but_prompts_are_not():
    d = _drafter()
    d.on_request_start("a", [100, 101, 102, 103])  # prompt only
    d.on_tokens_accepted("a", [7, 8, 9, 10])  # output
    d.on_request_start("b", [1])
    assert d.propose("b", [1, 7], 4).tokens[:3] == (8, 9, 10)  # a's output, seen by b
    assert d.propose("b", [1, 100], 4) is None  # a's prompt stays a's own


def test_branch_elimination_leaves_no_trace_of_a_finished_prompt():
    d = _drafter()
    d.on_request_start("warm", [1, 2])
    d.on_tokens_accepted("warm", [3, 4, 5])
    d.on_request_finish("warm")
    before = d.trie_counts("")
    prompt = [90, 91, 92, 93, 94, 95, 96]
    d.on_request_start("a", prompt)
    assert d.num_indexed_tokens == len(prompt) and d.trie_counts("") == before  # a prompt goes to its own index
    d.on_request_finish("a")
    assert d.trie_counts("") == before and d.num_nodes == len(before) and d.num_indexed_tokens == 0
    assert d.stats()["requests"] == 0
    d.on_request_start("b", [1])
    assert d.propose("b", [1, 90], 8) is None  # nothing of a's prompt is retrievable


def test_pruning_keeps_the_output_trie_under_capacity_and_keeps_frequent_nodes():
    d = _drafter(trie_capacity=500)
    rng = random.Random(0)
    frequent = [7, 7, 8, 9]
    d.on_request_start("a", [1])
    for _ in range(300):
        d.on_tokens_accepted("a", [rng.randrange(1000) for _ in range(5)] + frequent)
        assert d.num_nodes <= 500 + 6 * 9  # pruned as soon as one update overflows
    counts = d.trie_counts("")
    assert counts is not None and counts.get(tuple(frequent), 0) >= 1
    # Counts were halved at least once: the frequent run was seen 300 times.
    assert counts[tuple(frequent)] < 300
    # The node counter is exact after pruning, and no node below 1 survived the last prune
    # unless made since (each later step adds at most 6 * 9 nodes).
    assert len(counts) == d.num_nodes
    assert sum(1 for c in counts.values() if c < 1) <= 6 * 9


def test_multi_stage_retrieval_prefers_the_longest_match_then_fills_from_shorter():
    d = _drafter(max_match=3, branch_length=8)
    d.warm_up([[1, 2, 3, 50, 51], [9, 3, 60, 61], [9, 3, 60, 61], [9, 3, 60, 61]])
    d.on_request_start("a", [0])
    # Key [2, 3] matches the first run: 50 51 comes first although 3 -> 60 is more frequent.
    tree = d.propose("a", [0, 1, 2, 3], 2)
    assert tree.tokens == (50, 51)
    # With more budget, the shorter match [3] adds its branch (60 61) to the same tree.
    tree = d.propose("a", [0, 1, 2, 3], 4)
    assert _paths(tree) >= {(50,), (50, 51), (60,), (60, 61)}
    # No match of any length: no draft.
    assert d.propose("a", [0, 77], 4) is None


def test_scores_are_path_frequencies_under_the_match():
    d = _drafter(max_match=2, min_match=2)
    # After [1, 2]: 30 three times, 40 once; after [1, 2, 30]: 31 twice, 32 once.
    d.warm_up([[1, 2, 30, 31], [1, 2, 30, 31], [1, 2, 30, 32], [1, 2, 40]])
    d.on_request_start("a", [0])
    tree = d.propose("a", [0, 1, 2], 8)
    score = {token_path(tree, i): tree.scores[i] for i in range(len(tree))}
    assert score[(30,)] == pytest.approx(0.75) and score[(40,)] == pytest.approx(0.25)
    assert score[(30, 31)] == pytest.approx(0.75 * 2 / 3) and score[(30, 32)] == pytest.approx(0.25)
    # Every layout scores its nodes, never a child above its parent.
    for layout in ("parallel", "single"):
        d.on_request_start(layout, [0], layout=layout)
        t = d.propose(layout, [0, 1, 2], 8)
        assert len(t.scores) == len(t) and t.scores[0] == pytest.approx(0.75)
        assert all(p is None or t.scores[i] <= t.scores[p] for i, p in enumerate(t.parents))


def test_own_prompt_outranks_global_output():
    d = _drafter()
    d.warm_up([[5, 6, 30, 31]] * 20)  # globally frequent continuation of 5 6
    d.on_request_start("a", [5, 6, 70, 71, 1])
    tree = d.propose("a", [5, 6, 70, 71, 1, 5, 6], 2)
    assert tree.tokens == (70, 71)
    # Without the weighting, the global branch wins (the copy chain, which reads the request's
    # own text whatever the weights, off).
    d2 = _drafter(prompt_weight=0.01, copy_chain=False)
    d2.warm_up([[5, 6, 30, 31]] * 20)
    d2.on_request_start("a", [5, 6, 70, 71, 1])
    assert d2.propose("a", [5, 6, 70, 71, 1, 5, 6], 2).tokens == (30, 31)


def test_layouts():
    corpus = [[1, 10, 11, 12], [1, 10, 11, 13], [1, 10, 14], [1, 20, 21]]
    tokens = [0, 1]
    hier = _drafter(layout="hierarchical")
    hier.warm_up(corpus)
    hier.on_request_start("a", [0])
    t = hier.propose("a", tokens, 16)
    # Shared prefixes merged: 10 appears once with children 11 and 14.
    assert t.tokens.count(10) == 1 and _paths(t) >= {(10, 11, 12), (10, 11, 13), (10, 14), (20, 21)}

    par = _drafter(layout="parallel")
    par.warm_up(corpus)
    par.on_request_start("a", [0])
    t = par.propose("a", tokens, 16)
    # Disjoint chains, one per first token, heaviest path under each.
    assert all(t.parents[i] is None or t.parents[i] == i - 1 for i in range(len(t)))
    assert _paths(t) >= {(10, 11, 12), (20, 21)} and (10, 14) not in _paths(t)

    single = _drafter(layout="single")
    single.warm_up(corpus)
    single.on_request_start("a", [0])
    t = single.propose("a", tokens, 16)
    assert t.tokens == (10, 11, 12) and t.parents == (None, 0, 1)

    # Per-request override of the server's layout.
    hier.on_request_start("b", [0], layout="single")
    assert hier.propose("b", tokens, 16).tokens == (10, 11, 12)
    # A request's layout is validated once, where it enters: SamplingParams.
    with pytest.raises(ValueError, match="draft_layout"):
        SamplingParams(draft_layout="zigzag")


@pytest.mark.parametrize("layout", ["hierarchical", "parallel", "single"])
def test_proposals_always_satisfy_tree_invariants(layout):
    rng = random.Random(1)
    d = _drafter(layout=layout, branch_length=8, trie_capacity=3000)
    d.warm_up([[rng.randrange(12) for _ in range(50)] for _ in range(20)])
    for r in range(20):
        tokens = [rng.randrange(12) for _ in range(rng.randint(1, 30))]
        d.on_request_start(f"r{r}", tokens)
        for _ in range(10):
            budget = rng.randint(1, 64)
            tree = d.propose(f"r{r}", tokens, budget)
            if tree is None:
                continue
            assert 1 <= len(tree) <= budget
            for i, p in enumerate(tree.parents):  # DraftTree itself rejects duplicate siblings
                assert p is None or p < i
                assert p is None or tree.scores[i] <= tree.scores[p]
            new = [rng.randrange(12) for _ in range(rng.randint(1, 4))]
            tokens += new
            d.on_tokens_accepted(f"r{r}", new)
        d.on_request_finish(f"r{r}")


def test_warm_up_file(tmp_path):
    path = tmp_path / "warm.jsonl"
    path.write_text(json.dumps({"token_ids": [1, 2, 3]}) + "\n\n" + json.dumps({"text": "ab"}) + "\n")
    d = _drafter()
    assert d.warm_up_file(path, tokenize=lambda s: [ord(c) for c in s]) == 2
    assert {(1, 2, 3), (97, 98)} <= set(d.trie_counts("") or {})
    with pytest.raises(ValueError, match="tokenizer"):
        _drafter().warm_up_file(path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"token_ids": [1]}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2: not JSON"):
        _drafter().warm_up_file(bad)


def test_simulation_counts_steps():
    d = _drafter()
    out = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6]
    res = simulate(d, "s", [1, 2], out, decoding_length=8)
    assert res.tokens == len(out)
    # The repeat is drafted from the request's own output once it has been seen.
    assert res.steps < len(out) and res.tokens_per_step > 1.5
    assert d.stats()["requests"] == 0 and d.num_indexed_tokens == 0  # finished and eliminated


def test_warm_up_goes_into_its_scope_and_drafts_only_there():
    d = TrieDrafter(DraftConfig(method="lookahead", decoding_length=8, branch_length=6))
    assert d.warm_up([[1, 2, 3, 4, 5, 6, 7]], scope="acme") == 1
    d.on_request_start("ours", [9, 1, 2], scope="acme")
    d.on_request_start("theirs", [9, 1, 2], scope="")
    d.on_request_start("alone", [9, 1, 2], scope=None)
    assert d.propose("ours", [9, 1, 2], 8).tokens[:3] == (3, 4, 5)
    assert d.propose("theirs", [9, 1, 2], 8) is None  # nothing of acme's corpus outside acme
    assert d.propose("alone", [9, 1, 2], 8) is None
    # A scoped request's output feeds its own scope only.
    d.on_tokens_accepted("theirs", [40, 41, 42])
    assert (40, 41) not in (d.trie_counts("acme") or {}) and (40, 41) in (d.trie_counts("") or {})
    d.on_tokens_accepted("alone", [50, 51, 52])  # no scope: no trie learns it
    assert all((50, 51) not in (d.trie_counts(s) or {}) for s in d.stats()["scopes"])


def test_match_length_is_the_longest_run_said_before_with_what_came_next():
    d = _drafter(branch_length=4)
    text = [7, 1, 2, 3, 4, 9, 2, 3, 4]
    d.on_request_start("own", text, scope=None)  # its own text only
    assert d.match_length("own", text) == 3  # [2 3 4] at 2-4, followed by 9
    d.on_request_start("copy", [7, 1, 2, 3, 4, 9, 1, 2, 3, 4], scope=None)
    assert d.match_length("copy", [7, 1, 2, 3, 4, 9, 1, 2, 3, 4]) == 4
    d.on_request_start("end", [1, 2, 3, 4], scope=None)
    assert d.match_length("end", [1, 2, 3, 4]) == 0  # only at the very end: nothing came next
    assert d.match_length("nobody", [1, 2]) == 0 and d.match_length("own", []) == 0
    # The scope's output trie: the longest suffix that is a path with children, up to its depth.
    d.warm_up([[1, 2, 3, 4, 9]])
    d.on_request_start("r", [0], scope="")
    assert d.match_length("r", [0, 2, 3, 4]) == 3  # [2 3 4] -> 9
    assert d.match_length("r", [0, 1, 2, 3]) == 3  # [1 2 3] -> 4, but [0 1 2 3] is not a path
    assert d.match_length("r", [0, 3, 9]) == 0  # 9 ends every run: nothing follows it


def _agreement(text: list[int], key: list[int], limit: int) -> list[int]:
    """The oracle: per position e (with a token after it) how many tokens back from e agree with
    key back from its end, at most `limit`."""
    agree = []
    for e in range(len(text) - 1):
        k = 0
        while k < min(limit, len(key)) and e - k >= 0 and text[e - k] == key[-1 - k]:
            k += 1
        agree.append(k)
    return agree


def _copy_oracle(text: list[int], depth: int) -> tuple[int, list[tuple[int, float]]]:
    """(m, chain) the copy chain must give for a request whose text is `text`: the longest suffix
    (<= MATCH_CAP) said before with a token after it; from m >= 3, what followed its most recent
    occurrence (2 tokens per token of match, up to `depth`), each token scored by the product of
    its shares among the occurrences (the 256 most recent) still agreeing."""
    agree = _agreement(text, text, MATCH_CAP)
    m = max(agree, default=0)
    if m < 3:
        return m, []
    after = [e + 1 for e, a in enumerate(agree) if a == m][-256:]
    chain, score = [], 1.0
    for i in range(after[-1], min(len(text), after[-1] + min(2 * m, depth))):
        tok = text[i]
        if len(after) > 1:
            after = [a for a in after if a < len(text)]
            agreeing = [a for a in after if text[a] == tok]
            score *= len(agreeing) / len(after)
            after = [a + 1 for a in agreeing]
        chain.append((tok, score))
    return m, chain


@pytest.mark.parametrize("seed", range(6))
def test_the_copy_chain_is_the_brute_force_one_over_the_requests_own_text(seed):
    """Texts with many occurrences of a key (a tiny vocabulary) and with few (a long copy): the
    tree's first branch is the copy chain the oracle computes, scores included, and its match."""
    rng = random.Random(seed)
    for vocab in (2, 3, 50):
        for _ in range(15):
            text = [rng.randrange(vocab) for _ in range(rng.randint(2, 120))]
            if rng.random() < 0.5 and len(text) > 10:  # copying: the text ends with an earlier run
                at = rng.randrange(1, len(text) - 1)
                text += text[max(0, at - rng.randint(3, 40)) : at]
            d = _drafter(branch_length=2, own_branch_length=12, max_match=1)
            d.on_request_start("a", text, scope=None)
            m, chain = _copy_oracle(text, 12)
            assert d.match_length("a", text) == m
            if not chain:
                continue
            n = len(chain)
            tree = d.propose("a", text, n)  # a budget the chain fills: nothing merges into it
            assert tree is not None and tree.match == m
            assert tree.tokens == tuple(t for t, _ in chain) and tree.parents == (None, *range(n - 1))
            assert tree.scores == tuple(s for _, s in chain)
            wider = d.propose("a", text, 64)  # with room, the counts' branches come after it
            assert wider is not None and wider.tokens[:n] == tree.tokens


def test_a_tree_reports_how_long_its_match_is():
    """A draft copying a long run of the request's own text says so (`match`), and one found
    from a single token says that: the policy's evidence before the forward."""
    d = _drafter(branch_length=6)
    code = list(range(100, 140))
    d.on_request_start("a", [*code, 7])
    copying = d.propose("a", [*code, 7, *code[:20]], 4)  # 20 tokens of the prompt copied so far
    assert copying.tokens == tuple(code[20:24]) and copying.match == 20
    # As in the engine, the request's own index holds what it said: its latest tokens are no match.
    d.on_tokens_accepted("a", code[:20])
    assert d.propose("a", [*code, 7, *code[:20]], 4).match == 20
    d.on_request_start("b", [*code, 7])
    guessing = d.propose("b", [*code, 7, 55, 56, 120], 4)  # only the last token was seen before
    assert guessing.tokens[0] == 121 and guessing.match == 1
    assert d.match_length("b", [*code, 7, 55, 56, 120]) == 1 == guessing.match  # before the search
    long = [*code, 7, *code, *code]
    d.on_request_start("c", long[:-1])
    assert d.propose("c", long, 2).match == MATCH_CAP
    # Another request's output (its scope's trie) counts, up to what the trie holds.
    d.on_request_start("w", [1])
    d.on_tokens_accepted("w", [60, 61, 62, 63, 64, 65, 66, 67])
    d.on_request_start("r", [2])
    assert d.propose("r", [2, 60, 61, 62, 63, 64], 2).match == 5  # branch_length - 1


def test_the_copy_chain_follows_the_longest_agreement_most_recent_first():
    # Continuations of 7: 8 9 twice (counts favour it), then 7 4 3 after "1 2 7", which the
    # text's end (the output so far) agrees with on three tokens.
    prompt = [5, 7, 8, 9, 6, 7, 8, 9, 1, 2, 7, 4, 3, 0, 11, 12, 13, 14]
    trees = []
    for copy_chain in (True, False):
        d = _drafter(branch_length=12, max_match=1, copy_chain=copy_chain)
        d.on_request_start("a", prompt)
        d.on_tokens_accepted("a", [1, 2, 7])
        trees.append(d.propose("a", [*prompt, 1, 2, 7], 8))
    tree, counts_only = trees
    assert tree.match == 3 and tree.tokens[:6] == (4, 3, 0, 11, 12, 13)  # 2 tokens per token of match
    assert tree.parents[:6] == (None, 0, 1, 2, 3, 4) and tree.scores[:6] == (1.0,) * 6  # one occurrence agrees
    assert tree.tokens[6:] == (8, 9)  # the counts fill the rest
    assert counts_only.tokens[:2] == (8, 9)  # counts alone: the common continuation first
    single = _drafter(branch_length=12, max_match=1, layout="single")
    single.on_request_start("a", prompt)
    single.on_tokens_accepted("a", [1, 2, 7])
    assert single.propose("a", [*prompt, 1, 2, 7], 8).tokens == (4, 3, 0, 11, 12, 13)  # one branch: the copy


def test_a_copy_is_scored_by_the_share_of_its_occurrences_and_a_guess_left_to_the_counts():
    # "1 2 3" occurred four times: followed by 4 three times, by 5 once (the most recent).
    prompt = [1, 2, 3, 4, 9, 1, 2, 3, 4, 8, 1, 2, 3, 4, 0, 1, 2, 3, 5, 6, 7, 6]
    d = _drafter(branch_length=12)
    d.on_request_start("a", prompt)
    tree = d.propose("a", [*prompt, 1, 2, 3], 6)
    assert tree.match == 3 and tree.tokens[:2] == (5, 6)  # the most recent copy first
    assert tree.scores[:2] == (pytest.approx(0.25), pytest.approx(0.25))  # 1 of the 4 occurrences
    assert 4 in tree.tokens  # the counts' continuation still drafted after it
    # A match of 2 is a guess: the counts order the tree (the common 4 first), not the copy.
    tree = d.propose("a", [*prompt, 7, 2, 3], 6)
    assert tree.match == 2 and tree.tokens[0] == 4
