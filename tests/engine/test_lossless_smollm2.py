"""The heart: with the real model, the engine's greedy output equals HF `generate` token for
token, whatever the drafts, the batch composition or the memory pressure."""

from __future__ import annotations

import asyncio

import pytest

from batchserve import LLM, AsyncEngine, SamplingParams
from batchserve.admission import Submission
from batchserve.config import CacheConfig, DraftConfig, EngineConfig, SchedulerConfig
from batchserve.engine import EngineCore
from tests.conftest import hf_greedy, smollm2_copy
from tests.prompts import all_prompt_ids

pytestmark = pytest.mark.slow
MAX_NEW = 32


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    ids = all_prompt_ids(smollm2[1])
    lengths = sorted(len(p) for p in ids)
    assert len(ids) >= 16 and lengths[0] >= 10 and 450 <= lengths[-1] <= 600, lengths
    return ids


@pytest.fixture(scope="module")
def reference(smollm2, prompts) -> list[list[int]]:
    model, _ = smollm2
    return [hf_greedy(model, p, MAX_NEW) for p in prompts]


@pytest.fixture(scope="module")
def engine_model(smollm2):
    """A second copy of SmolLM2 whose attention the engines replace (the reference keeps HF's)."""
    return smollm2_copy(smollm2)


def _config(method: str, layout: str = "hierarchical", **cache) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(block_size=16, kv_cache_memory_gb=0.25, **cache),
        # Prompts unpaced beside decodes: the batch grows by step count whatever this machine's
        # speed (where a step with prompt runs past half a second they would be: test_pacing.py).
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, prompt_stall=float("inf")),
        draft=DraftConfig(method=method, decoding_length=16, layout=layout, adaptive=False),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("method", "layout"),
    [
        ("lookahead", "hierarchical"),
        ("lookahead", "parallel"),
        ("lookahead", "single"),
        ("llma", "single"),
        ("jacobi", "hierarchical"),
        ("hybrid", "hierarchical"),
        ("none", "single"),
    ],
)
async def test_staggered_concurrent_greedy_equals_hf(engine_model, prompts, reference, method, layout):
    engine = AsyncEngine(EngineCore(_config(method, layout), *engine_model))
    batch_sizes: list[int] = []

    async def run(i: int, prompt: list[int]) -> list[int]:
        # Request i arrives once the engine has run (i + 2) // 3 steps: the batch grows from 1
        # to 16 within 5 steps, well before the first requests can finish (a drafter accepting
        # 3 tokens a step ends a 32-token request in about 10; on a busy machine an arrival can
        # slip a step or two behind its turn), then drains to 1.
        while engine.num_steps < (i + 2) // 3:
            await asyncio.sleep(0.002)
        tokens: list[int] = []
        async for out in engine.generate(Submission(prompt, SamplingParams(max_new_tokens=MAX_NEW))):
            tokens += out.new_token_ids
            if not out.finished:
                batch_sizes.append(engine.core.scheduler.num_running)
            else:
                finals.append(out)
        return tokens

    finals: list = []
    outputs = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
    await engine.stop()
    accepted = sum(o.stats.draft_tokens_accepted for o in finals)
    steps = sum(o.stats.steps for o in finals)
    if method == "none":
        assert accepted == 0 and steps == sum(map(len, outputs))  # one token per step
    else:  # a drafter that proposes nothing would pass the equality below as `none` does
        assert accepted > 0 and sum(map(len, outputs)) / steps > 1, (accepted, steps)
    assert min(batch_sizes) == 1 and max(batch_sizes) == 16
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        assert out == ref, f"prompt {i} diverged at token {next(j for j, (a, b) in enumerate(zip(out, ref)) if a != b)}"
    alloc = engine.core.scheduler.allocator
    assert alloc.num_free_blocks == alloc.num_blocks
    engine.core.scheduler.check_integrity()
    if method == "lookahead":  # every prompt's branches were eliminated; only outputs remain
        drafter = engine.core.speculation.drafter
        assert drafter.num_nodes == len(drafter.trie_counts("") or {}) and drafter.num_indexed_tokens == 0


def test_preempted_requests_still_equal_hf(engine_model, prompts, reference):
    # 48 blocks of 16 slots cannot hold 16 requests of 20-600 tokens: preemption must happen.
    llm = LLM(config=_config("lookahead", num_blocks=48), hf_model=engine_model[0], tokenizer=engine_model[1])
    results = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert sum(r.stats.num_preemptions for r in results) > 0
    assert [r.token_ids for r in results] == reference
    # The trie found something to draft in these prompts.
    assert sum(r.stats.draft_tokens_accepted for r in results) > 0


def test_trie_reuses_the_requests_own_output(engine_model, smollm2):
    """A prompt that makes the model repeat a phrase it was not given: the trie drafts the
    repeats from the request's own earlier output."""
    from tests.prompts import chat

    tokenizer = engine_model[1]
    prompt = chat(tokenizer, "Write the multiplication table of 7 from 7 x 1 to 7 x 12, one line each.")
    llm = LLM(config=_config("lookahead"), hf_model=engine_model[0], tokenizer=tokenizer)
    r = llm.generate([prompt], SamplingParams(max_new_tokens=96))[0]
    assert r.token_ids == hf_greedy(smollm2[0], prompt, 96)
    assert r.text.count(" × 1 = ") >= 4 and " × " not in tokenizer.decode(prompt)  # repeats of its own phrase
    assert r.tokens_per_step > 1.5, (r.tokens_per_step, r.text)
