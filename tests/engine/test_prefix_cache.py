"""Prefix caching end to end: reused KV blocks change nothing but the work, within a scope only."""

from __future__ import annotations

import random

import pytest

from batchserve import SamplingParams
from batchserve.admission import Submission
from batchserve.engine import EngineCore
from tests.conftest import TINY_VOCAB, hf_greedy, tiny_llm
from tests.engine.drafters import OracleDrafter

BS = 16
NEW = 24
PARAMS = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TINY_VOCAB) for _ in range(n)]


def _checked(core: EngineCore) -> None:
    """Reference counts equal owners after every step (the allocator's own integrity check)."""
    core.step_listeners.append(lambda out, phases: core.scheduler.check_integrity())


@pytest.mark.parametrize(
    ("shared", "cached"),
    [(BS - 5, 0), (BS, BS), (BS + 1, BS), (40, 2 * BS)],  # less than a block, one, one plus a token, all
    ids=["part-block", "one-block", "block-plus-one", "whole-prompt"],
)
def test_a_later_request_reuses_the_full_blocks_it_shares(tiny_model, shared, cached):
    first = _tokens(1, 40)
    second = first[:shared] + _tokens(2, 40 - shared)
    llm = tiny_llm(None, block_size=BS)
    _checked(llm.engine)
    a = llm.generate([first], PARAMS)[0]
    b = llm.generate([second], PARAMS)[0]
    assert a.stats.cached_prompt_tokens == 0
    # Whole blocks only, and never the last prompt token (the step needs its logits).
    assert b.stats.cached_prompt_tokens == cached
    assert a.token_ids == hf_greedy(tiny_model, first, NEW, ignore_eos=True)
    assert b.token_ids == hf_greedy(tiny_model, second, NEW, ignore_eos=True)
    off = tiny_llm(None, block_size=BS, prefix_caching=False).generate([first, second], PARAMS)
    assert [r.token_ids for r in off] == [a.token_ids, b.token_ids]
    assert all(r.stats.cached_prompt_tokens == 0 for r in off)


def test_requests_arriving_together_wait_for_the_shared_blocks_being_computed(tiny_model):
    """Cache-aware admission: the first of four requests with one system prompt computes it;
    the other three wait one step and reuse it. A request that shares nothing is not held back."""
    system = _tokens(3, 2 * BS)
    prompts = [system + _tokens(10 + i, 9) for i in range(4)]
    other = _tokens(99, 41)
    core = tiny_llm(None, block_size=BS).engine
    _checked(core)
    first_step: dict[str, int] = {}  # request id -> the step that first scheduled it
    steps = 0
    reqs = [core.add_request(Submission(p, PARAMS, request_id=f"s{i}")) for i, p in enumerate(prompts)]
    reqs.append(core.add_request(Submission(other, PARAMS, request_id="other")))
    while core.has_work():
        step = core.schedule()
        for item in step.out.requests:
            first_step.setdefault(item.request_id, steps)
        core.execute(step)
        core.commit(step)
        steps += 1
    assert [r.stats.cached_prompt_tokens for r in reqs] == [0, 2 * BS, 2 * BS, 2 * BS, 0]
    assert first_step == {"s0": 0, "other": 0, "s1": 1, "s2": 1, "s3": 1}
    for p, r in zip([*prompts, other], reqs):
        assert r.output_token_ids == hf_greedy(tiny_model, p, NEW, ignore_eos=True)
    prefix = core.scheduler.prefix
    assert prefix.hit_tokens == 3 * 2 * BS
    # The same five again: each finds its whole prompt's full blocks, and nobody waits.
    again = [core.add_request(Submission(p, PARAMS)) for p in [*prompts, other]]
    while core.has_work():
        core.step()
    assert [r.stats.cached_prompt_tokens for r in again] == [2 * BS] * 4 + [2 * BS]
    assert [r.output_token_ids for r in again] == [r.output_token_ids for r in reqs]


def test_tenants_do_not_wait_for_each_others_prefill():
    """The wait follows the cache's scope: another tenant's identical prompt is computed at once."""
    prompt = _tokens(4, 40)
    core = tiny_llm(None, block_size=BS).engine
    a = core.add_request(Submission(prompt, PARAMS, tenant="a"))
    b = core.add_request(Submission(prompt, PARAMS, tenant="b"))
    a2 = core.add_request(Submission(prompt, PARAMS, tenant="a"))
    core.step()
    assert a.num_computed_tokens == b.num_computed_tokens == 40
    assert a2.num_computed_tokens == 0  # waits for tenant a's blocks
    while core.has_work():
        core.step()
    assert (a.stats.cached_prompt_tokens, b.stats.cached_prompt_tokens, a2.stats.cached_prompt_tokens) == (0, 0, 32)


def test_a_follower_of_a_chunked_prefill_reuses_every_chunk(tiny_model):
    """A shared prompt longer than the step's token budget, computed in chunks: the follower
    computes only its own tail, with output equal to HF greedy."""
    system = _tokens(5, 6 * BS)
    prompts = [system + _tokens(20, 5), system + _tokens(21, 7)]
    core = tiny_llm(None, block_size=BS, max_num_batched_tokens=2 * BS).engine
    _checked(core)
    reqs = [core.add_request(Submission(p, PARAMS)) for p in prompts]
    while core.has_work():
        core.step()
    assert reqs[1].stats.cached_prompt_tokens == 6 * BS
    for p, r in zip(prompts, reqs):
        assert r.output_token_ids == hf_greedy(tiny_model, p, NEW, ignore_eos=True)


def test_one_seat_serves_a_shared_system_prompt_from_the_cache(tiny_model):
    system = _tokens(4, 3 * BS)
    prompts = [system + _tokens(20 + i, 5) for i in range(3)]
    llm = tiny_llm(None, block_size=BS, max_num_seqs=1)  # staggered: each waits for the last
    _checked(llm.engine)
    results = llm.generate(prompts, PARAMS)
    assert [r.stats.cached_prompt_tokens for r in results] == [0, 3 * BS, 3 * BS]
    for p, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(tiny_model, p, NEW, ignore_eos=True)


def test_accepted_drafts_on_top_of_cached_blocks_stay_lossless(tiny_model):
    system = _tokens(5, 2 * BS + 3)
    prompts = [system + _tokens(30 + i, 6) for i in range(3)]
    refs = {tuple(p): hf_greedy(tiny_model, p, 48, ignore_eos=True) for p in prompts}
    llm = tiny_llm(OracleDrafter(refs, 0, TINY_VOCAB, depth=8), block_size=BS, decoding_length=12, max_num_seqs=1)
    _checked(llm.engine)
    results = llm.generate(prompts, SamplingParams(max_new_tokens=48, ignore_eos=True))
    assert [r.stats.cached_prompt_tokens for r in results] == [0, 2 * BS, 2 * BS]
    for p, r in zip(prompts, results):
        assert r.token_ids == refs[tuple(p)]
        assert r.stats.draft_tokens_accepted > 0


def test_seeded_sampling_is_the_same_with_and_without_the_cache():
    system = _tokens(6, 2 * BS)
    prompts = [system + _tokens(40 + i, 7) for i in range(4)]
    params = [SamplingParams(max_new_tokens=NEW, temperature=0.9, top_p=0.9, seed=i) for i in range(4)]
    on = tiny_llm(None, block_size=BS, max_num_seqs=2)
    on.generate(prompts, params)  # fill the cache
    cached = on.generate(prompts, params)
    assert all(r.stats.cached_prompt_tokens == 2 * BS for r in cached)
    off = tiny_llm(None, block_size=BS, prefix_caching=False).generate(prompts, params)
    assert [r.token_ids for r in cached] == [r.token_ids for r in off]


def test_preemption_under_a_tight_pool_drops_references_not_shared_blocks(tiny_model):
    system = _tokens(7, 24)
    prompts = [system + _tokens(50 + i, 10) for i in range(6)]
    # 4-token blocks; 20 blocks cannot hold six requests of up to 34 + 40 tokens.
    llm = tiny_llm(None, draft="llma", block_size=4, num_blocks=20, max_num_seqs=6)
    _checked(llm.engine)
    results = llm.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0
    # Readmissions found blocks in the cache (their own or the shared system prompt's).
    first_admissions = sum(r.stats.cached_prompt_tokens for r in results)
    assert sched.prefix.hit_tokens > first_admissions
    for p, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(tiny_model, p, 40, ignore_eos=True)
    alloc = sched.allocator
    assert alloc.num_free_blocks == alloc.num_blocks and alloc.num_cached_blocks > 0


def test_tenants_never_reuse_each_others_blocks():
    prompt = _tokens(8, 40)
    llm = tiny_llm(None, block_size=BS)
    core = llm.engine

    def run(tenant: str) -> int:
        req = core.add_request(Submission(prompt, PARAMS, tenant=tenant))
        while core.has_work():
            core.step()
        return req.stats.cached_prompt_tokens

    assert run("a") == 0
    assert run("b") == 0  # the same prompt, another tenant: computed again
    assert run("a") == 2 * BS
    assert run("") == 0  # requests without a key share their own scope, not a tenant's


def test_aborting_or_failing_a_request_on_shared_blocks_drops_only_its_references():
    prompt = _tokens(9, 40)
    core = tiny_llm(None, block_size=BS).engine
    _checked(core)
    core.add_request(Submission(prompt, PARAMS, request_id="first"))
    while core.has_work():
        core.step()
    cached = core.scheduler.allocator.num_cached_blocks
    a = core.add_request(Submission(prompt, PARAMS, request_id="a"))
    b = core.add_request(Submission(prompt, PARAMS, request_id="b"))
    core.step()  # both start on the same two cached blocks
    shared = a.block_ids[:2]
    assert b.block_ids[:2] == shared and all(core.scheduler.allocator.ref_count(x) == 2 for x in shared)
    core.abort("a")
    assert all(core.scheduler.allocator.ref_count(x) == 1 for x in shared)
    core.fail(["b"], RuntimeError("injected"))
    core.scheduler.check_integrity()
    alloc = core.scheduler.allocator
    assert alloc.num_free_blocks == alloc.num_blocks and alloc.num_cached_blocks >= cached
    assert alloc.lookup(core.scheduler.prefix.keys(a, 2)[:2]) == shared  # still cached for the next one
    alloc.free(shared)


@pytest.mark.parametrize(
    ("length", "cached"),
    [(BS, 0), (2 * BS, BS), (3 * BS, 2 * BS), (2 * BS + 1, 2 * BS)],
    ids=["one-block", "aligned", "three-blocks", "plus-one"],
)
def test_a_fully_cached_block_aligned_prompt_still_computes_its_last_token(tiny_model, length, cached):
    prompt = _tokens(7, length)
    llm = tiny_llm(None, block_size=BS)
    _checked(llm.engine)
    a = llm.generate([prompt], PARAMS)[0]
    b = llm.generate([prompt], PARAMS)[0]  # every block of it is cached now
    # The block holding the last prompt token is never reused: its logits pick the first token.
    assert b.stats.cached_prompt_tokens == cached
    assert a.token_ids == b.token_ids == hf_greedy(tiny_model, prompt, NEW, ignore_eos=True)
    off = tiny_llm(None, block_size=BS, prefix_caching=False).generate([prompt], PARAMS)[0]
    assert off.token_ids == b.token_ids and off.stats.cached_prompt_tokens == 0


def test_a_follow_up_reuses_the_blocks_its_reply_was_decoded_into(tiny_model):
    """A chat's next turn holds the model's own reply: the blocks written by decode steps (draft
    K/V compacted into place) are reused, and the output is the uncached one."""
    prompt = _tokens(8, 20)
    llm = tiny_llm(None, block_size=BS)
    _checked(llm.engine)
    first = llm.generate([prompt], PARAMS)[0]
    follow_up = prompt + first.token_ids + _tokens(9, 10)
    second = llm.generate([follow_up], PARAMS)[0]
    # 20 prompt + 23 computed reply tokens: two full blocks, the second mostly written by decode.
    assert second.stats.cached_prompt_tokens == 2 * BS > (len(prompt) // BS) * BS
    assert second.token_ids == hf_greedy(tiny_model, follow_up, NEW, ignore_eos=True)
    off = tiny_llm(None, block_size=BS, prefix_caching=False).generate([follow_up], PARAMS)[0]
    assert off.token_ids == second.token_ids and off.stats.cached_prompt_tokens == 0


def test_a_follow_up_reuses_blocks_filled_by_accepted_drafts_but_not_the_unwritten_last_slot(tiny_model):
    """Decode blocks whose K/V came from accepted drafts (compacted into place) are reused by the
    next turn. The reply ends on a block boundary (24 + 40 = 4 blocks): its last token was emitted
    but never run through the model, so that block holds no K/V there and must not be reused."""
    prompt = _tokens(10, 24)
    reply = hf_greedy(tiny_model, prompt, 40, ignore_eos=True)
    follow_up = prompt + reply + _tokens(11, 10)
    refs = {tuple(prompt): reply, tuple(follow_up): hf_greedy(tiny_model, follow_up, NEW, ignore_eos=True)}
    llm = tiny_llm(OracleDrafter(refs, 1, TINY_VOCAB, depth=8), block_size=BS, decoding_length=12, max_num_seqs=1)
    _checked(llm.engine)
    first = llm.generate([prompt], SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    assert first.token_ids == reply and first.stats.draft_tokens_accepted > 0
    second = llm.generate([follow_up], PARAMS)[0]
    # Blocks 1-2 hold reply tokens; block 3 ends on the reply's last token, whose K/V was never computed.
    assert second.stats.cached_prompt_tokens == 3 * BS > (len(prompt) // BS) * BS
    assert second.token_ids == refs[tuple(follow_up)]
    off = tiny_llm(None, block_size=BS, prefix_caching=False).generate([follow_up], PARAMS)[0]
    assert off.token_ids == second.token_ids and off.stats.cached_prompt_tokens == 0
