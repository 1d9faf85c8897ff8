"""Seats per tenant on the tiny model: a tenant's long decodes give a seat to another tenant's
request at the next step, and the preempted request's output is still exactly greedy."""

from __future__ import annotations

import random

from batchserve import SamplingParams
from batchserve.admission import Submission
from tests.conftest import TINY_VOCAB, hf_greedy
from tests.engine.test_batching import _assert_pool_full, _core


def test_a_seat_hog_gives_a_seat_at_once_and_stays_lossless(tiny_model):
    core = _core(max_num_seqs=2, draft="lookahead")
    rng = random.Random(7)
    hog = [[rng.randrange(TINY_VOCAB) for _ in range(12)] for _ in range(2)]
    small = [rng.randrange(TINY_VOCAB) for _ in range(6)]
    long = SamplingParams(max_new_tokens=60, ignore_eos=True)
    reqs = [core.add_request(Submission(p, long, request_id=f"hog{i}", tenant="hog")) for i, p in enumerate(hog)]
    outputs: dict[str, list[int]] = {}
    steps_to_first = None
    for step in range(200):
        if step == 4:  # both seats decoding
            core.add_request(Submission(small, SamplingParams(max_new_tokens=3), request_id="small", tenant="b"))
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.request_id == "small" and out.new_token_ids and steps_to_first is None:
                steps_to_first = step - 4
        if not core.has_work():
            break
    assert steps_to_first == 0  # seated and sampled in the very step after it came
    assert reqs[1].stats.num_preemptions == 1 and reqs[0].stats.num_preemptions == 0
    assert outputs["small"] == hf_greedy(tiny_model, small, 3)
    for i, p in enumerate(hog):
        assert outputs[f"hog{i}"] == hf_greedy(tiny_model, p, 60, ignore_eos=True)
    _assert_pool_full(core)
