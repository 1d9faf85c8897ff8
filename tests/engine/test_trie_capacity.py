"""The lookahead trie's capacity in a real run: output tries are decayed and pruned as they
grow, their node counts stay true, frequent n-grams outlive rare ones, and the output stays
HF's greedy one."""

from __future__ import annotations

import itertools
import random

from batchserve import SamplingParams
from batchserve.admission import Submission
from batchserve.config import CacheConfig, DraftConfig, EngineConfig, SchedulerConfig
from batchserve.engine import EngineCore
from tests.conftest import TINY_VOCAB, hf_greedy, make_tiny_model, make_tiny_tokenizer

# 48 output tokens in 4-token n-grams make under 200 nodes: one request's output fits, two
# distinct ones do not.
CAPACITY = 300
PARAMS = SamplingParams(max_new_tokens=48, ignore_eos=True)


def _core() -> EngineCore:
    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
        draft=DraftConfig(
            method="lookahead", decoding_length=16, branch_length=4, trie_capacity=CAPACITY, adaptive=False
        ),
    )
    return EngineCore(config, make_tiny_model(), make_tiny_tokenizer())


def _run(core: EngineCore, prompts: list[list[int]]) -> list:
    reqs = [core.add_request(Submission(p, PARAMS)) for p in prompts]
    while core.has_work():
        core.step()
    return reqs


def _real_size(core: EngineCore) -> int:
    """Nodes in every output trie, counted from their paths (not from the bookkeeping)."""
    return sum(len(core.speculation.drafter.trie_counts(s) or {}) for s in core.speculation.drafter.stats()["scopes"])


def test_output_trie_is_pruned_to_capacity_during_a_run(tiny_model):
    rng = random.Random(11)
    popular = [rng.randrange(TINY_VOCAB) for _ in range(12)]
    rare = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(5, 30))] for _ in range(2)]
    fresh = _run(_core(), [popular])[0]  # what the popular prompt drafts with an empty output trie

    core = _core()
    sizes = []  # after every step: (the output tries' node count, the nodes really in them)
    core.step_listeners.append(lambda out, phases: sizes.append((core.speculation.drafter.num_nodes, _real_size(core))))
    # The popular prompt four times at once (its n-grams counted 4 times), then two rare ones
    # that overflow the capacity, then the popular prompt again.
    reqs = _run(core, [popular] * 4)
    assert sizes[-1][0] <= CAPACITY and all(a <= b for (a, _), (b, _) in itertools.pairwise(sizes))  # it fits alone
    assert all(c == int(c) for c in (core.speculation.drafter.trie_counts("") or {}).values())  # never halved
    grown = len(sizes)
    reqs += _run(core, [rare[0]]) + _run(core, [rare[1]])
    again = _run(core, [popular])[0]

    # Pruning ran (a step's node count fell, and counts were halved) and kept the tries in bounds.
    assert any(b < a for (a, _), (b, _) in zip(sizes[grown - 1 :], sizes[grown:])), sizes
    assert any(c != int(c) for c in (core.speculation.drafter.trie_counts("") or {}).values())
    # After every step the output tries fit, and their bookkeeping is the nodes really there.
    assert all(total <= CAPACITY for total, _ in sizes), sizes
    assert all(total == real for total, real in sizes), sizes
    # Decay dropped the rare n-grams and kept the popular ones: the popular prompt now drafts
    # its whole answer from them, which it could not from an empty trie.
    assert fresh.stats.draft_tokens_accepted <= 4
    assert again.stats.draft_tokens_accepted >= 24
    for r in [*reqs, fresh, again]:
        assert r.output_token_ids == hf_greedy(tiny_model, r.prompt_token_ids, 48, ignore_eos=True)
