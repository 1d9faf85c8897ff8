"""A list of prompts in one completions call (lm-eval's --batch_size, any client that batches):
one choice per prompt and sample, `index` in OpenAI's order (prompt by prompt, `n` each), all
admitted together and bounded like `n`; through the official `openai` client."""

from __future__ import annotations

import asyncio

import pytest

from batchserve import SamplingParams
from tests.conftest import make_tiny_tokenizer
from tests.server.test_openai_api import _client, _offline, _raw

PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22], [40, 41, 42, 43]]


async def test_each_prompt_gets_its_choices_in_order_with_usage_counting_each_prompt_once(api):
    expected = [_offline(p, SamplingParams(max_new_tokens=8, ignore_eos=True)).text for p in PROMPTS]
    done = await _client(api).completions.create(
        model="tiny", prompt=PROMPTS, n=2, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in done.choices] == list(range(6))
    assert [c.text for c in done.choices] == [t for t in expected for _ in range(2)]  # prompt 0's two, then 1's...
    assert done.usage.prompt_tokens == sum(map(len, PROMPTS)) and done.usage.completion_tokens == 6 * 8
    # Texts too, and a list of one prompt answers as the prompt alone does.
    texts = ["The quick", "brown fox"]
    both = await _client(api).completions.create(model="tiny", prompt=texts, max_tokens=6, temperature=0)
    for text, choice in zip(texts, both.choices):
        alone = await _client(api).completions.create(model="tiny", prompt=[text], max_tokens=6, temperature=0)
        assert choice.text == alone.choices[0].text


async def test_streamed_choices_carry_their_index_and_add_up_to_the_whole(api):
    kwargs = {"model": "tiny", "prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = await _client(api).completions.create(**kwargs)
    stream = await _client(api, strict=False).completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    texts: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in whole.choices}
    assert usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens


async def test_echo_with_logprobs_scores_each_prompt_as_lm_eval_batches_them(api):
    """lm-eval's loglikelihood at --batch_size 2: echo, max_tokens 0, logprobs 1, two prompts."""
    texts = ["The quick brown", "fox jumps over"]
    tokenizer = make_tiny_tokenizer()
    done = await _client(api, strict=False).completions.create(
        model="tiny", prompt=texts, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    assert [c.text for c in done.choices] == texts
    for text, choice in zip(texts, done.choices):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        scored = _offline(ids, SamplingParams(max_new_tokens=0, prompt_logprobs=1)).prompt_logprobs
        assert choice.logprobs.token_logprobs == [None] + [e.logprob for e in scored]


async def test_best_of_picks_within_each_prompt(api):
    done = await _client(api).completions.create(
        model="tiny", prompt=PROMPTS[:2], n=1, best_of=3, max_tokens=6, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in done.choices] == [0, 1]
    assert done.usage.completion_tokens == 2 * 3 * 6  # every sample ran
    for prompt, choice in zip(PROMPTS[:2], done.choices):  # each the best of its own prompt's three
        candidates = [
            _offline(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=3 + i, logprobs=0))
            for i in range(3)
        ]
        best = max(candidates, key=lambda o: sum(e.logprob for e in o.logprobs))
        assert choice.text == best.text


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": [[5, 6]] * 9}, "prompt"),  # nine requests, past --max-samples (8)
        ({"prompt": [[5, 6]] * 3, "n": 3}, "prompt"),
        ({"prompt": [[5, 6]] * 2, "best_of": 5}, "prompt"),
    ],
)
async def test_a_list_past_the_samples_bound_is_a_400_naming_the_prompt(api, body, field):
    status, reply = await _raw(api, "POST", "/v1/completions", {"model": "tiny", "max_tokens": 2} | body)
    assert status == 400 and reply["error"]["param"] == field and "--max-samples" in reply["error"]["message"]


async def test_one_refused_prompt_refuses_the_call_and_runs_none_of_it(api):
    context = api.core.facts.max_model_len
    status, reply = await _raw(
        api, "POST", "/v1/completions", {"model": "tiny", "prompt": [[5, 6], [7] * (context - 2)], "max_tokens": 8}
    )
    assert status == 400 and "exceed the model's context" in reply["error"]["message"]
    await asyncio.sleep(0.05)
    assert not api.core.has_work() and api.server.frontend._preparing == 0  # nothing admitted stays behind
