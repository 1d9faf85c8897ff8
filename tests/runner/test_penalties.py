"""Penalties, bias and logprobs: every draft node's penalised logits are those of plain decoding
at its position (its own ancestors counted), whole outputs and logprobs are the same with drafts
on and off (greedy and seeded), and bad values are refused naming the field."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from batchserve import SamplingParams
from batchserve.admission import Submission
from batchserve.records import ScheduledRequest
from batchserve.runner.penalties import penalize, token_logprobs, tree_paths
from tests.conftest import TINY_VOCAB, tiny_llm
from tests.engine.drafters import OracleDrafter, RandomTreeDrafter, random_prompts, random_tree

PENALTIES = dict(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3)
BIAS = ((3, 2.5), (7, -100.0), (11, 0.75), (40, 4.0))


def _request(output: list[int], prompt: list[int], tree=None, **params) -> ScheduledRequest:
    sp = SamplingParams(**params)
    return ScheduledRequest(
        "r", (output[-1],), 10, (0,), tree, True, sp, output_ids=tuple(output), prompt_ids=tuple(prompt)
    )


def _reference(row: torch.Tensor, history: list[int], prompt: list[int], p: SamplingParams) -> torch.Tensor:
    """The formulas, token by token in float64."""
    x = row.double().clone()
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(history) | set(prompt):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(history):
        x[t] -= history.count(t) * p.frequency_penalty + p.presence_penalty
    return x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_tree_node_gets_the_penalties_of_plain_decoding_at_its_position(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    prompt = [rng.randrange(50) for _ in range(30)]
    output = [rng.randrange(50) for _ in range(rng.randint(1, 40))]
    tree = random_tree(rng, rng.randint(3, 20), 50)
    params = dict(PENALTIES, logit_bias=BIAS)
    r = _request(output, prompt, tree, **params)
    logits = torch.randn(6 + len(tree) + 1, TINY_VOCAB, generator=gen)
    start = 6  # the request's root row among other rows
    before = logits.clone()
    penalize(logits, [(start, r)])
    assert torch.equal(logits[:start], before[:start])  # the other rows are untouched
    for k, path in enumerate(tree_paths(r)):
        history = output + list(path)
        alone = before[start + k : start + k + 1].clone()  # the same position decoded plainly
        penalize(alone, [(0, _request(history, prompt, None, **params))])
        assert torch.equal(logits[start + k], alone[0]), k
        want = _reference(before[start + k], history, prompt, r.params)
        torch.testing.assert_close(logits[start + k].double(), want, rtol=1e-6, atol=1e-5)


def test_logprobs_are_the_raw_rows_log_softmax_and_do_not_depend_on_their_company():
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(9, TINY_VOCAB, generator=gen) * 4
    got = token_logprobs(raw, [2, 5], [17, 3], top=4)
    want = torch.log_softmax(raw.double(), -1)
    assert [g.token_id for g in got] == [17, 3]
    assert got[0].logprob == pytest.approx(float(want[2, 17]), abs=1e-5)
    assert [t for t, _ in got[1].top] == want[5].topk(4).indices.tolist()
    assert got[1].top[0][1] >= got[1].top[1][1] >= got[1].top[3][1]
    alone = token_logprobs(raw[5:6].clone(), [0], [3], top=4)
    assert alone == got[1:]  # the same bits in a call of one row


def _truth(prompts, params):
    llm = tiny_llm(None, draft="none")
    return {tuple(p): r for p, r in zip(prompts, llm.generate(prompts, params))}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_outputs_and_logprobs_are_the_same_with_drafts_on_and_off(temperature):
    prompts = [p + p[:6] * 3 for p in random_prompts(6, seed=3)]  # repeats: the penalties bite
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=temperature, seed=11, logprobs=3,
                            logit_bias=dict(BIAS), **PENALTIES)  # fmt: skip
    plain = _truth(prompts, params)
    unpenalized = _truth(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=temperature, seed=11))
    assert any(plain[k].token_ids != unpenalized[k].token_ids for k in plain)  # they change the output
    assert all(7 not in r.token_ids for r in plain.values())  # a -100 bias bans a token
    truth = {k: r.token_ids for k, r in plain.items()}
    for drafter in (OracleDrafter(truth, seed=1, vocab=TINY_VOCAB), RandomTreeDrafter(2, vocab=TINY_VOCAB)):
        llm = tiny_llm(drafter, decoding_length=16, max_num_seqs=4)
        for p, r in zip(prompts, llm.generate(prompts, params)):
            want = plain[tuple(p)]
            assert r.token_ids == want.token_ids
            assert r.logprobs == want.logprobs and len(r.logprobs) == len(r.token_ids)
        if isinstance(drafter, OracleDrafter):
            assert sum(r.stats.draft_tokens_accepted for r in llm.generate(prompts, params)) > 50


def test_logprobs_of_a_greedy_token_are_its_rows_best():
    llm = tiny_llm(None, draft="none")
    r = llm.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2))[0]
    for token, lp in zip(r.token_ids, r.logprobs):
        assert lp.token_id == token and lp.top[0] == (token, lp.logprob) and len(lp.top) == 2
        assert np.isfinite(lp.logprob) and lp.logprob <= 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprobs", 21), ("logprobs", -1), ("frequency_penalty", 2.5), ("presence_penalty", -3),
        ("repetition_penalty", 0), ("repetition_penalty", 11), ("repetition_penalty", 0.09),
        ("repetition_penalty", 5e-324), ("logit_bias", {5: 101}),
        ("logit_bias", {i: 1.0 for i in range(301)}), ("logit_bias", {-1: 1.0}),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_bias_outside_the_vocabulary_is_refused_before_queueing():
    llm = tiny_llm(None, draft="none")
    with pytest.raises(ValueError, match="logit_bias"):
        llm.engine.add_request(Submission([1, 2, 3], SamplingParams(logit_bias={TINY_VOCAB: 1.0})))
    assert not llm.engine.has_work()
