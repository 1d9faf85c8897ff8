"""Samples of one call (`group`, OpenAI's `n`): their prompt's full blocks are computed once between
them, with prefix caching off too and under any scope, and each sample's output is what it would
be on its own."""

from __future__ import annotations

import pytest

from batchserve import SamplingParams
from batchserve.admission import Submission
from tests.conftest import tiny_llm

BS = 4
PROMPT = [(7 * i) % 200 + 3 for i in range(10 * BS + 2)]  # 10 full blocks and 2 tokens


def _run(engine, requests) -> tuple[dict[str, list[int]], int]:
    """Each request's output and the prompt rows all steps computed."""
    computed = 0

    def count(out, phases) -> None:
        nonlocal computed
        p = len(PROMPT)
        computed += sum(min(p, r.num_computed_tokens + len(r.token_ids)) - r.num_computed_tokens
                        for r in out.requests if r.num_computed_tokens < p)  # fmt: skip

    engine.step_listeners.append(count)
    for rid, params, group in requests:
        engine.add_request(Submission(PROMPT, params, rid, group=group))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.scheduler.check_integrity()
    return out, computed


@pytest.mark.parametrize(("prefix_caching", "trie_scope"), [(False, "tenant"), (True, "request"), (True, "global")])
def test_samples_compute_the_prompt_once_and_decode_as_they_would_alone(prefix_caching, trie_scope):
    params = [SamplingParams(max_new_tokens=6, temperature=0.9, seed=40 + i, ignore_eos=True) for i in range(4)]
    engine = tiny_llm(None, block_size=BS, prefix_caching=prefix_caching, trie_scope=trie_scope).engine
    outputs, rows = _run(engine, [(f"s-{i}", p, "call-1") for i, p in enumerate(params)])
    # The first sample computes all 42 prompt tokens; each other one only what no full block holds.
    tail = len(PROMPT) - (len(PROMPT) - 1) // BS * BS
    assert rows == len(PROMPT) + 3 * tail and engine.scheduler.prefix.hit_tokens == 3 * (len(PROMPT) - tail)
    for i, p in enumerate(params):
        alone = tiny_llm(None, block_size=BS, prefix_caching=False).generate([PROMPT], p)[0].token_ids
        assert outputs[f"s-{i}"] == alone
    assert len({tuple(v) for v in outputs.values()}) > 1  # seeded differently
    assert engine.scheduler.allocator.num_free_blocks + engine.scheduler.allocator.num_cached_blocks >= (
        engine.scheduler.allocator.num_blocks
    )  # every block back (cached ones are free to take)


def test_without_a_group_and_caching_off_each_request_computes_its_prompt():
    engine = tiny_llm(None, block_size=BS, prefix_caching=False).engine
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    _, rows = _run(engine, [(f"s-{i}", params, "") for i in range(3)])
    assert rows == 3 * len(PROMPT) and engine.scheduler.prefix.hit_tokens == 0


def test_groups_of_different_tenants_never_share_under_request_scope():
    engine = tiny_llm(None, block_size=BS, trie_scope="request").engine
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine.add_request(Submission(PROMPT, params, "a", tenant="t1", group="g"))
    engine.add_request(Submission(PROMPT, params, "b", tenant="t2", group="g"))  # the same group key, another tenant
    while engine.has_work():
        engine.step()
    assert engine.scheduler.prefix.hit_tokens == 0
