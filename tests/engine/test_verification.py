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


def test_random_trees_with_chunked_prefill(reference):
    """A small token budget splits prompts into chunks that share steps with draft trees."""
    prompts = [list(p) for p in reference]
    llm = tiny_llm(
        RandomTreeDrafter(7, vocab=TINY_VOCAB), decoding_length=24, max_num_batched_tokens=32, max_num_seqs=4
    )
    results = llm.generate(prompts, SamplingParams(max_new_tokens=40))
    for p, r in zip(prompts, results):
        assert r.token_ids == reference[tuple(p)]
