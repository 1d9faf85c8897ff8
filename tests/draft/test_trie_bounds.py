"""The trie drafter's bounds: a request's own index is an array (small, built fast, the same
counts as a dict trie), and tenant scopes are capped, counted incrementally, and evicted by
recency so that many small tenants never cost a busy one its n-grams."""

from __future__ import annotations

import random
import sys
import tracemalloc

import pytest

from batchserve.config import DraftConfig
from batchserve.draft import token_index
from batchserve.draft.token_index import MAX_OCCURRENCES, TokenIndex
from batchserve.draft.trie import Trie, TrieDrafter


def _same_subtree(index_node, trie_node, depth_left: int) -> None:
    assert index_node.count == trie_node.count
    if depth_left == 0:
        return
    assert list(index_node.children) == list(trie_node.children)  # same tokens, same (creation) order
    for tok, child in trie_node.children.items():
        _same_subtree(index_node.children[tok], child, depth_left - 1)


# "few-symbols": keys with dozens of occurrences and several next tokens each. "arrays": every
# node's children grouped by array operations (the path for nodes of many occurrences).
@pytest.mark.parametrize("kind", ["random", "repetitive", "few-symbols", "few-symbols-arrays"])
def test_the_index_reads_as_the_dict_trie_of_every_run(kind, monkeypatch):
    if kind.endswith("-arrays"):
        monkeypatch.setattr(token_index, "_FEW_ENDS", 0)
    rng = random.Random(3)
    b = 6
    for _ in range(20):
        if kind != "repetitive":
            symbols = 12 if kind == "random" else 4
            tokens = [rng.randrange(symbols) for _ in range(rng.randint(1, 120))]
        else:
            unit = [rng.randrange(50) for _ in range(rng.randint(2, 6))]
            tokens = (unit * 40)[: rng.randint(1, 150)]
        split = rng.randint(0, len(tokens))
        trie = Trie()
        trie.insert_sequence(tokens[:split], b)
        index = TokenIndex(tokens[:split], b)
        for i in range(split, len(tokens)):  # output tokens arrive one step at a time
            for start in range(max(0, i + 1 - b), i + 1):  # every run ending at token i
                trie.path(tokens[start : i + 1]).count += 1
        index.extend(tokens[split:])
        assert index.tokens.tolist() == tokens
        for m in range(1, 5):
            for start in range(len(tokens) - m + 1):
                key = tokens[start : start + m]
                expected = trie.find(key)
                got = index.find(key)
                assert (got is None) == (expected is None), key
                if got is not None:
                    _same_subtree(got, expected, b - m)
        assert index.find([99]) is None and index.find([]) is None


def test_a_common_key_reads_only_its_most_recent_occurrences():
    index = TokenIndex([7, 1] * 1000 + [7, 2], branch_length=4)
    node = index.find([7])
    assert node.count == MAX_OCCURRENCES
    assert node.children[2].count == 1 and node.children[1].count == MAX_OCCURRENCES - 1


def test_an_8k_prompt_costs_under_a_mebibyte():
    d = TrieDrafter(DraftConfig(method="lookahead"))
    rng = random.Random(0)
    prompt = [rng.randrange(49152) for _ in range(8191)]
    tracemalloc.start()
    d.on_request_start("r", prompt)
    size, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert size < 2**20, size
    assert d.num_indexed_tokens == 8191


def _calls(fn) -> int:
    """Python function calls (generator steps included) made by `fn()`."""
    n = 0

    def profile(frame, event, arg):
        nonlocal n
        if event == "call":
            n += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def test_100k_scopes_stay_capped_counted_and_cost_nothing_per_token():
    d = TrieDrafter(DraftConfig(method="lookahead", branch_length=4, trie_max_scopes=1000, trie_capacity=10**9))
    d.on_request_start("busy", [1, 2, 3], scope="busy")

    def step() -> None:
        d.on_tokens_accepted("busy", [5, 6, 7])

    step()
    step()  # from here on every step walks the same nodes and creates none
    for i in range(100):
        d.warm_up([[i, i + 1, i + 2]], scope=f"t{i}")
    few = _calls(step)
    for i in range(100, 100_000):
        d.warm_up([[i % 997, 1, 2]], scope=f"t{i}")
    many = _calls(step)
    assert len(d.outputs) <= 1000 and "busy" in d.outputs
    assert few == many  # nothing per token walks the scopes
    assert d.num_output_nodes == sum(t.num_nodes for t in d.outputs.values())


def test_many_one_off_tenants_never_evict_a_busy_tenant():
    d = TrieDrafter(DraftConfig(method="lookahead", branch_length=4, trie_capacity=2000))
    phrase = [40, 41, 42, 43]
    d.on_request_start("busy", [1], scope="acme")
    for i in range(5000):  # one-off tenants, each with a request that comes and goes
        rid = f"r{i}"
        d.on_request_start(rid, [2], scope=f"user{i}")
        d.on_tokens_accepted(rid, [i % 250, (i * 7) % 250, (i * 13) % 250])
        d.on_request_finish(rid)
        if i % 50 == 0:
            d.on_tokens_accepted("busy", phrase)
        assert d.num_output_nodes <= 2000 + 20
    assert d.outputs["acme"].find(phrase) is not None and d.outputs["acme"].find(phrase).count >= 100
    assert d.num_output_nodes == sum(t.num_nodes for t in d.outputs.values())


def test_a_live_scope_alone_over_capacity_decays_as_before():
    d = TrieDrafter(DraftConfig(method="lookahead", trie_capacity=500))
    d.on_request_start("a", [1])
    rng = random.Random(0)
    for _ in range(200):
        d.on_tokens_accepted("a", [rng.randrange(1000) for _ in range(5)])
        assert d.num_output_nodes <= 500 + 6 * 12
    assert "" in d.outputs and d.num_output_nodes == d.output.num_nodes


def test_a_corpus_inserted_in_slices_counts_as_one_insert():
    rng = random.Random(5)
    seq = [rng.randrange(20) for _ in range(1000)]
    whole, sliced = Trie(), Trie()
    whole.insert_sequence(seq, 6)
    for first in range(0, len(seq), 128):
        sliced.insert_sequence(seq, 6, first, first + 128)
    assert whole.num_nodes == sliced.num_nodes
    for start in range(0, 990, 7):
        key = seq[start : start + 5]
        assert whole.find(key).count == sliced.find(key).count
    d = TrieDrafter(DraftConfig(method="lookahead", branch_length=6))
    steps = list(d.warm_up_slices([seq, seq[:10]], scope="acme", slice_tokens=128))
    assert len(steps) == 8 + 1 and d.outputs["acme"].num_nodes == whole.num_nodes


class _FromTheRoot(TrieDrafter):
    """Output runs counted as the drafter once did: each run ending at a new token walked from the root."""

    def on_tokens_accepted(self, request_id, token_ids):
        state = self._requests[request_id]
        b = self.config.branch_length
        state.local.extend(token_ids)
        output = self._output(state.scope)
        before = output.num_nodes
        tokens = state.local.tokens.tolist()
        for i in range(state.local.size - len(token_ids), state.local.size):
            for start in range(max(i + 1 - b, state.num_prompt), i + 1):  # runs inside the output
                output.path(tokens[start : i + 1]).count += 1
        self.num_output_nodes += output.num_nodes - before
        self._keep_capacity(state.scope)


def _same_trie(a, b) -> None:
    assert a.count == b.count and list(a.children) == list(b.children)  # creation order too
    for tok, child in a.children.items():
        _same_trie(child, b.children[tok])


def test_runs_extended_node_by_node_count_what_walks_from_the_root_count():
    rng = random.Random(7)
    config = DraftConfig(method="lookahead", branch_length=5, trie_capacity=300, trie_max_scopes=2)
    ours, reference = TrieDrafter(config), _FromTheRoot(config)
    live: list[str] = []
    for event in range(3000):
        if (len(live) < 4 and rng.random() < 0.05) or not live:  # requests come and go in three scopes
            rid, scope = f"r{event}", rng.choice(["a", "b", "c"])
            prompt = [rng.randrange(8) for _ in range(rng.randint(1, 6))]
            for d in (ours, reference):
                d.on_request_start(rid, prompt, scope=scope)
            live.append(rid)
        elif rng.random() < 0.02:
            rid = live.pop(rng.randrange(len(live)))
            for d in (ours, reference):
                d.on_request_finish(rid)
        else:  # a step's accepted tokens, repetitive enough that runs recur and prunes come
            rid, tokens = rng.choice(live), [rng.randrange(8) for _ in range(rng.randint(1, 4))]
            for d in (ours, reference):
                d.on_tokens_accepted(rid, tokens)
        assert list(ours.outputs) == list(reference.outputs)
        assert ours.num_output_nodes == reference.num_output_nodes
    assert sum(t.epoch for t in ours.outputs.values()) > 5  # prunes happened on the way
    for scope, trie in ours.outputs.items():
        _same_trie(trie.root, reference.outputs[scope].root)
