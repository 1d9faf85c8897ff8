"""Prompt logprobs (`SamplingParams.prompt_logprobs`, the OpenAI API's `echo` with `logprobs`):
each prompt token after the first scored once, as the model itself scores it, whatever the
chunking, the prefix cache, drafts or preemption; `max_new_tokens=0` scores without decoding."""

from __future__ import annotations

import pytest
import torch

from batchserve import SamplingParams
from batchserve.admission import Submission
from batchserve.request import FinishReason, Request, TokenLogprob
from batchserve.scheduler.chunks import score_span
from tests.conftest import TINY_VOCAB, make_tiny_model, tiny_llm
from tests.engine.drafters import OracleDrafter, random_prompts
from tests.rounding import assert_rounds_like, prompt_logprobs_reference

PROMPTS = [p + p[:5] for p in random_prompts(5, seed=7) if len(p) > 3]


def test_prompt_logprobs_are_the_models_scores_of_each_prompt_token():
    llm = tiny_llm(None, draft="none")
    results = llm.generate(PROMPTS, SamplingParams(max_new_tokens=0, prompt_logprobs=3))
    for prompt, r in zip(PROMPTS, results):
        assert r.token_ids == [] and r.finish_reason is FinishReason.LENGTH  # scored, nothing decoded
        assert [e.token_id for e in r.prompt_logprobs] == prompt[1:]
        for e in r.prompt_logprobs:  # the row's best three, best first; none less likely than the token
            assert len(e.top) == 3 and e.top[0][1] >= e.top[1][1] >= e.top[2][1]
            assert e.top[0][1] >= e.logprob and (e.logprob < e.top[2][1] or e.token_id in dict(e.top))
    # The model's scores: the engine's forward and transformers' sum in different orders, so each is
    # held to the exact scores (the model in float64) by what transformers' float32 is off here.
    got = torch.tensor([e.logprob for r in results for e in r.prompt_logprobs], dtype=torch.float64)
    assert_rounds_like(got, *prompt_logprobs_reference(make_tiny_model(), PROMPTS))


def test_the_same_bits_in_chunks_beside_other_requests_with_drafts_and_from_a_warm_prefix_cache():
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    alone = {tuple(p): tiny_llm(None, draft="none").generate([p], params)[0] for p in PROMPTS}
    truth = {k: r.token_ids for k, r in alone.items()}
    # Chunks of 16 tokens shared by 4 seats, oracle drafts, and every prompt seen before.
    llm = tiny_llm(OracleDrafter(truth, seed=3, vocab=TINY_VOCAB), decoding_length=8, max_num_seqs=4,
                   max_num_batched_tokens=16, block_size=4)  # fmt: skip
    llm.generate(PROMPTS, SamplingParams(max_new_tokens=2))  # caches the prompts' blocks
    for r in llm.generate(PROMPTS, params):
        want = alone[tuple(r.prompt_token_ids)]
        assert r.prompt_logprobs == want.prompt_logprobs and len(r.prompt_logprobs) == len(r.prompt_token_ids) - 1
        assert r.token_ids == want.token_ids and r.logprobs == want.logprobs
        assert r.stats.cached_prompt_tokens == 0  # a scoring request computes its whole prompt
    again = llm.generate(PROMPTS, SamplingParams(max_new_tokens=1))
    assert sum(r.stats.cached_prompt_tokens for r in again) > 0  # the cache was there to be (wrongly) used


def test_a_preempted_request_scores_each_prompt_token_once():
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=0)
    req = Request("r", list(range(10, 30)), params, frozenset(), 100)
    assert score_span(req, 0, 8) == (0, tuple(range(11, 19)))  # rows 0..7 score tokens 1..8
    req.prompt_logprobs.extend(TokenLogprob(t, -1.0) for t in range(11, 19))
    assert score_span(req, 8, 20) == (0, tuple(range(19, 30)))  # the rest; the last row predicts the output
    assert score_span(req, 0, 12) == (8, tuple(range(19, 23)))  # recomputed after preemption: rows 8.. only
    req.prompt_logprobs.extend(TokenLogprob(t, -1.0) for t in range(19, 30))
    assert not req.scoring and score_span(req, 0, 20) == (0, ())


def test_a_one_token_prompt_has_no_prompt_logprobs_and_none_are_sent_twice():
    llm = tiny_llm(None, draft="none")
    r = llm.generate([[9]], SamplingParams(max_new_tokens=3, prompt_logprobs=1, ignore_eos=True))[0]
    assert r.prompt_logprobs == [] and len(r.token_ids) == 3
    engine = llm.engine
    engine.add_request(Submission([4, 5, 6, 7], SamplingParams(max_new_tokens=4, prompt_logprobs=0, ignore_eos=True)))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    sent = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(sent) == 1 and [e.token_id for e in sent[0]] == [5, 6, 7]
    assert outputs[0].prompt_logprobs is not None  # with the first output


@pytest.mark.parametrize(("kwargs", "field"), [(dict(max_new_tokens=0), "max_new_tokens"),
                                               (dict(prompt_logprobs=21), "prompt_logprobs"),
                                               (dict(prompt_logprobs=-1), "prompt_logprobs")])  # fmt: skip
def test_bad_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
