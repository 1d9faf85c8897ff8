"""Every family the native forward runs beyond Llama's own (sliding windows, Qwen3, Gemma 2 and 3,
Phi-3) held to the contract on 24 prompts, random weights in float32: greedy output token for token
transformers' `generate` with drafts on and off, seeded sampling the same with drafts on and off,
and on our kernels the start-up check passed and every request's logits alone and in a batch the
same bits at every thread count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchserve import LLM, SamplingParams
from tests.conftest import TINY_VOCAB, hf_greedy, make_tiny_tokenizer
from tests.engine.drafters import OracleDrafter
from tests.model.test_llama import _all_logits, _model

FAMILIES = [
    *("mistral-window", "qwen2-window", "qwen3", "gemma2", "gemma3", "phi3"),
    *("qwen3-moe", "qwen2-moe", "mixtral", "olmoe", "gpt-oss"),  # routed experts
]
NEW_TOKENS = 16


def _prompts() -> list[list[int]]:
    """24 prompts of 2 to 40 tokens (the phi3 kind's context is 64): half of them repeat a phrase,
    so the trie's drafts are accepted too."""
    rng = np.random.default_rng(7)
    prompts = []
    for i in range(24):
        n = int(rng.integers(2, 41))
        if i % 2:
            phrase = rng.integers(0, TINY_VOCAB, int(rng.integers(2, 6))).tolist()
            prompts.append((phrase * n)[:n])
        else:
            prompts.append(rng.integers(0, TINY_VOCAB, n).tolist())
    return prompts


def _llm(kind: str, **kw) -> LLM:
    kw.setdefault("adaptive", False)
    return LLM(hf_model=_model(kind), tokenizer=make_tiny_tokenizer(), model_impl="native", **kw)


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_output_is_transformers_generate_with_drafts_on_and_off(kind):
    prompts, model = _prompts(), _model(kind)
    expected = [hf_greedy(model, p, NEW_TOKENS, ignore_eos=True) for p in prompts]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    oracle = OracleDrafter({tuple(p): e for p, e in zip(prompts, expected)}, seed=1, vocab=TINY_VOCAB)
    drafted = _llm(kind, drafter=oracle, max_num_batched_tokens=1024).generate(prompts, params)
    assert [o.token_ids for o in drafted] == expected
    assert sum(o.stats.draft_tokens_accepted for o in drafted) > len(prompts)  # the trees were verified
    plain = _llm(kind, draft="none").generate(prompts, params)
    assert [o.token_ids for o in plain] == expected


@pytest.mark.parametrize("kind", FAMILIES)
def test_seeded_sampling_is_the_same_with_drafts_on_and_off(kind):
    prompts = _prompts()
    params = [
        SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    drafted = _llm(kind, decoding_length=8).generate(prompts, params)
    plain = _llm(kind, draft="none").generate(prompts, params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert sum(o.stats.draft_tokens_accepted for o in drafted) > 0  # the trie's drafts were taken


@pytest.mark.parametrize("kind", FAMILIES)
def test_on_our_kernels_the_check_passes_and_logits_are_the_same_bits_alone_and_batched(kind):
    llm = _llm(kind, cpu_weights="bfloat16", draft="none", block_size=4)  # `_all_logits` packs 4-slot blocks
    facts = llm.engine.facts
    assert facts.batch_invariant, facts.invariance_why  # the start-up check ran over every new layer
    prompts = _prompts()[:6]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            batched = _all_logits(llm.engine, prompts)
            start = 0
            for p in prompts:
                alone = _all_logits(llm.engine, [p])
                assert torch.equal(batched[start : start + len(p)], alone), (threads, len(p))
                start += len(p)
    finally:
        torch.set_num_threads(before)
