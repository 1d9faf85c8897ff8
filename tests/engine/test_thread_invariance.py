"""The batch-invariance contract at any thread count: a request's logits, bit for bit, are the same
alone (drafts off, its own engine) and batched with drafts, at 1, 3 and 8 torch threads, greedy and
seeded sampling, on a model wider than SmolLM2 (head dim 128, intermediate 4864, GQA)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from batchserve import LLM, SamplingParams
from batchserve.attention import INVARIANT_BACKENDS
from batchserve.config import CacheConfig, DraftConfig, EngineConfig, ModelConfig, SchedulerConfig
from tests.engine.drafters import OracleDrafter
from tests.engine.test_batch_invariance import LogitsRecorder

pytestmark = pytest.mark.slow
VOCAB = 2048
MAX_NEW = 14


def wide_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=4864,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=1024,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from tests.conftest import make_tiny_tokenizer

    return wide_model(), make_tiny_tokenizer()


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    out = []
    for i in range(12):
        phrase = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 9))]
        out.append((phrase * 8)[: 12 + 5 * i])  # repeats: drafts copy them and are accepted
    return out


def _llm(model: Any, tokenizer: Any, batched: bool, truth: dict[tuple[int, ...], list[int]] | None = None) -> LLM:
    """Alone: one seat, no drafts, no prefix cache. Batched: 12 seats, and trees of up to 12 nodes
    around each request's true continuation (so drafts are accepted, and steps pass 64 rows)."""
    config = EngineConfig(
        model=ModelConfig(),
        cache=CacheConfig(block_size=16, kv_cache_memory_gb=0.25, prefix_caching=batched),
        scheduler=SchedulerConfig(max_num_seqs=12 if batched else 1, max_num_batched_tokens=256 if batched else 64),
        draft=DraftConfig(method="lookahead" if batched else "none", adaptive=False, decoding_length=12),
    )
    drafter = OracleDrafter(truth or {}, seed=1, vocab=VOCAB, depth=8) if batched else None
    return LLM(config=config, hf_model=model, tokenizer=tokenizer, drafter=drafter)


@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("sampling", [False, True])
def test_logits_are_the_same_alone_and_batched_at_any_thread_count(model_and_tokenizer, threads, sampling):
    model, tokenizer = model_and_tokenizer
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone_llm = _llm(model, tokenizer, batched=False)
        if alone_llm.engine.facts.attention_backend not in INVARIANT_BACKENDS:
            pytest.skip("this CPU's kernels fail the batch-invariance check (see attention/invariant.py)")
        prompts = _prompts()

        def params(i: int) -> SamplingParams:
            if sampling:
                return SamplingParams(
                    max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True
                )
            return SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)

        alone = LogitsRecorder(alone_llm)
        alone_out = [alone_llm.generate([p], params(i))[0] for i, p in enumerate(prompts)]
        truth = {tuple(p): list(o.token_ids) for p, o in zip(prompts, alone_out)}
        batch_llm = _llm(model, tokenizer, batched=True, truth=truth)
        batch = LogitsRecorder(batch_llm)
        rows: list[int] = []
        batch_llm.engine.step_listeners.append(lambda out, phases: rows.append(out.num_tokens))
        batch_out = batch_llm.generate(prompts, [params(i) for i in range(len(prompts))])
    finally:
        torch.set_num_threads(before)
    assert max(rows) > 64  # steps past 64 rows: trees of many requests at once
    assert sum(r.stats.draft_tokens_accepted for r in batch_out) > 0
    differ = [i for i, (a, b) in enumerate(zip(alone_out, batch_out)) if a.token_ids != b.token_ids]
    rows_differ = [p for p, digest in alone.rows.items() if batch.rows.get(p, digest) != digest]
    missing = [p for p in alone.rows if p not in batch.rows]
    assert not differ and not rows_differ and not missing, (differ, len(rows_differ), len(missing))
    assert not alone.conflicts and not batch.conflicts
