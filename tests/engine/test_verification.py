"""Draft verification torture on the tiny model: any draft tree, output == HF greedy."""

from __future__ import annotations

import math

import pytest

from batchserve import SamplingParams
from tests.conftest import TINY_VOCAB, hf_greedy, tiny_llm
from tests.engine.drafters import OracleDrafter, RandomTreeDrafter, random_prompts


@pytest.fixture(scope="module")
def reference(tiny_model) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): hf_greedy(tiny_model, p, 40) for p in random_prompts(12)}


@pytest.mark.parametrize("depth", [1, 5, 16])
def test_oracle_draft_fully_accepted(reference, depth):
    prompts = [list(p) for p in reference]
    llm = tiny_llm(OracleDrafter(reference, seed=depth, vocab=TINY_VOCAB, depth=depth), decoding_length=64)
    results = llm.generate(prompts, SamplingParams(max_new_tokens=40))
    for p, r in zip(prompts, results):
        assert r.token_ids == reference[tuple(p)]
        # Every step accepts the whole true branch: depth drafted tokens plus the bonus.
        assert r.stats.steps == math.ceil(40 / (depth + 1))
        assert r.stats.draft_tokens_accepted == 40 - r.stats.steps
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("block_size", [1, 16])
def test_random_trees_never_change_output(reference, seed, block_size):
    prompts = [list(p) for p in reference]
    drafter = RandomTreeDrafter(seed, vocab=TINY_VOCAB, max_nodes=64)
    llm = tiny_llm(drafter, decoding_length=64, block_size=block_size, max_num_seqs=8)
    results = llm.generate(prompts, SamplingParams(max_new_tokens=40))
    for p, r in zip(prompts, results):
        assert r.token_ids == reference[tuple(p)]
    assert drafter.proposed > 1000  # the trees really were verified, many of them
    assert llm.engine.scheduler.allocator.num_free_blocks == llm.engine.scheduler.allocator.num_blocks
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize("oracle", [False, True])
def test_random_trees_with_chunked_prefill(reference, oracle):
    """A small token budget splits prompts into chunks that share steps with draft trees
    (random trees, mostly rejected; or the oracle's, whose true branch is accepted)."""
    prompts = [list(p) for p in reference]
    drafter = OracleDrafter(reference, seed=7, vocab=TINY_VOCAB) if oracle else RandomTreeDrafter(7, vocab=TINY_VOCAB)
    llm = tiny_llm(drafter, decoding_length=24, max_num_batched_tokens=32, max_num_seqs=4)
    mixed = []  # steps with the later chunk of one request's split prompt and another's tree

    def listen(out, phases):
        # (A chunk that stops short of the prompt's end takes the whole rest of the budget, so
        # trees only ever share a step with a prompt's last chunk.)
        chunks = {i.request_id for i in out.requests if len(i.token_ids) > 1 and i.num_computed_tokens > 0}
        trees = {i.request_id for i in out.requests if i.draft is not None and len(i.draft)}
        if chunks and trees - chunks:
            mixed.append(out)

    llm.engine.step_listeners.append(listen)
    results = llm.generate(prompts, SamplingParams(max_new_tokens=40))
    for p, r in zip(prompts, results):
        assert r.token_ids == reference[tuple(p)]
    assert mixed  # such steps really ran (and were lossless)
    if oracle:
        assert all(r.stats.draft_tokens_accepted > 0 for r in results)


def test_a_split_prompts_last_chunk_carries_its_own_accepted_tree(reference):
    """One request at a time, prompts longer than the budget: the step that ends a prompt's
    chunks also verifies a tree hanging off its last token, and the oracle's is accepted."""
    prompts = [list(p) for p in reference if len(p) > 40]
    assert len(prompts) >= 3
    llm = tiny_llm(
        OracleDrafter(reference, seed=8, vocab=TINY_VOCAB),
        decoding_length=16,
        max_num_batched_tokens=32,
        max_num_seqs=1,
    )
    last_chunks = []  # (chunk length, tree size) of steps ending a split prompt with a tree

    def listen(out, phases):
        for i in out.requests:
            if i.num_computed_tokens > 0 and len(i.token_ids) > 1 and i.sample and i.draft is not None:
                last_chunks.append((len(i.token_ids), len(i.draft)))

    llm.engine.step_listeners.append(listen)
    results = llm.generate(prompts, SamplingParams(max_new_tokens=40))
    for p, r in zip(prompts, results):
        assert r.token_ids == reference[tuple(p)]
        assert r.stats.draft_tokens_accepted > 0
    assert len(last_chunks) == len(prompts), last_chunks


@pytest.mark.parametrize("block_size", [1, 4, 7])
def test_accepted_drafts_with_block_sizes_other_than_16(reference, block_size):
    """Accepted tree nodes are compacted to the sequence's next slots, across block boundaries."""
    prompts = [list(p) for p in reference]
    drafter = OracleDrafter(reference, seed=10 + block_size, vocab=TINY_VOCAB, depth=6)
    llm = tiny_llm(drafter, decoding_length=24, block_size=block_size, max_num_seqs=8)
    results = llm.generate(prompts, SamplingParams(max_new_tokens=40))
    for p, r in zip(prompts, results):
        assert r.token_ids == reference[tuple(p)]
        # The true branch is in every tree: each step accepts all 6 of its drafts (or the rest).
        assert r.stats.draft_tokens_accepted == 40 - r.stats.steps > 0
        assert r.stats.steps == math.ceil(40 / 7)
    alloc = llm.engine.scheduler.allocator
    assert alloc.block_size == block_size and alloc.num_free_blocks == alloc.num_blocks
    llm.engine.scheduler.check_integrity()
