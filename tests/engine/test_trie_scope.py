"""Tenant isolation of drafts: one tenant's output never becomes another tenant's draft."""

from __future__ import annotations

import random

import pytest

from batchserve import SamplingParams
from batchserve.admission import Submission
from batchserve.config import CacheConfig, DraftConfig, EngineConfig, SchedulerConfig
from batchserve.engine import EngineCore
from tests.conftest import TINY_VOCAB, hf_greedy, make_tiny_model, make_tiny_tokenizer

PROMPT = [random.Random(9).randrange(TINY_VOCAB) for _ in range(24)]
PARAMS = SamplingParams(max_new_tokens=48, ignore_eos=True)


def _core(scope: str) -> EngineCore:
    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
        draft=DraftConfig(method="lookahead", decoding_length=16, trie_scope=scope, adaptive=False),
    )
    return EngineCore(config, make_tiny_model(), make_tiny_tokenizer())


def _generate(core: EngineCore, tenant: str, params: SamplingParams = PARAMS):
    req = core.add_request(Submission(PROMPT, params, tenant=tenant))
    while core.has_work():
        core.step()
    return req


def test_tenant_scope_keeps_one_tenants_output_from_anothers_drafts(tiny_model):
    expected = hf_greedy(tiny_model, PROMPT, 48, ignore_eos=True)
    fresh = _generate(_core("tenant"), "b")  # what B drafts when nobody ran before it

    shared = _core("tenant")
    first_a = _generate(shared, "a")
    b = _generate(shared, "b")
    second_a = _generate(shared, "a")
    for r in (fresh, first_a, b, second_a):
        assert r.output_token_ids == expected
    # B drafts exactly as if A had never run: nothing of A's output reaches it.
    assert (b.stats.draft_tokens_proposed, b.stats.draft_tokens_accepted) == (
        fresh.stats.draft_tokens_proposed,
        fresh.stats.draft_tokens_accepted,
    )
    # A keeps its speedup from its own earlier output.
    assert second_a.stats.draft_tokens_accepted >= 0.8 * len(expected)
    assert second_a.stats.steps < b.stats.steps / 2

    # The same sequence under the global scope: B does draft from A's output (the check above
    # would notice a leak).
    leaky = _core("global")
    _generate(leaky, "a")
    assert _generate(leaky, "b").stats.draft_tokens_accepted >= 0.8 * len(expected)


def test_request_scope_shares_nothing_and_disabled_lookahead_inserts_nothing():
    solo = _core("request")
    _generate(solo, "a")
    again = _generate(solo, "a")
    fresh = _generate(_core("request"), "a")
    assert again.stats.draft_tokens_accepted == fresh.stats.draft_tokens_accepted
    assert not solo.speculation.drafter.num_nodes  # no output trie, and no live request's local trie

    core = _core("global")
    _generate(core, "a", SamplingParams(max_new_tokens=48, ignore_eos=True, decoding_length=0))
    assert core.speculation.drafter.num_nodes == 0  # a request without speculation leaves no n-grams


@pytest.mark.parametrize("tenant", ["a" * 129, "line\nbreak"])
def test_tenant_keys_are_bounded(tenant):
    with pytest.raises(ValueError, match="tenant"):
        _core("tenant").add_request(Submission(PROMPT, PARAMS, tenant=tenant))
