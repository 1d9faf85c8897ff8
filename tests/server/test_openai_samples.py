"""n, best_of and echo through the official `openai` client, plain and streamed: each sample is what
the engine gives its seed alone, the prompt is computed and counted once, best_of picks by
cumulative logprob, and echo with logprobs=1 and max_tokens=0 (lm-evaluation-harness's
log-likelihood request) scores the prompt as the model does."""

from __future__ import annotations

import asyncio

from batchserve import SamplingParams
from tests.conftest import make_tiny_tokenizer
from tests.server.test_openai_api import _client, _offline

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # 4 full blocks of 4 and 2
SAMPLING = dict(max_new_tokens=8, ignore_eos=True, temperature=0.9, top_p=1.0)


async def test_n_samples_are_each_seeds_output_and_share_one_prefill(api):
    before = api.core.scheduler.prefix.hit_tokens
    done = await _client(api).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.9, seed=5, n=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in done.choices] == [0, 1, 2]
    for i, choice in enumerate(done.choices):
        assert choice.text == _offline(PROMPT, SamplingParams(seed=5 + i, **SAMPLING)).text
    assert len({c.text for c in done.choices}) > 1
    # The prompt once: the second and third sample found its 4 full blocks cached by the first.
    assert api.core.scheduler.prefix.hit_tokens - before == 2 * 16
    assert done.usage.prompt_tokens == len(PROMPT) and done.usage.completion_tokens == 3 * 8
    assert done.usage.total_tokens == len(PROMPT) + 24


async def test_n_streamed_chat_chunks_carry_each_choices_index(api):
    client = _client(api)
    messages = [{"role": "user", "content": "hello there, twice"}]
    kwargs = dict(model="tiny", messages=messages, max_completion_tokens=6, temperature=0.8, seed=3, n=2)
    whole = await client.chat.completions.create(**kwargs)
    stream = await client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    texts, roles, finishes, usage = {0: "", 1: ""}, [], {}, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles += [c.index] if c.delta.role else []
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert sorted(roles) == [0, 1] and finishes == {0: "length", 1: "length"}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == 12


async def test_best_of_returns_the_samples_of_highest_cumulative_logprob(api):
    done = await _client(api).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.9, seed=9, n=2, best_of=4,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    samples = [_offline(PROMPT, SamplingParams(seed=9 + i, logprobs=0, **SAMPLING)) for i in range(4)]
    ranked = sorted(samples, key=lambda r: -sum(e.logprob for e in r.logprobs))
    assert [c.text for c in done.choices] == [r.text for r in ranked[:2]]
    assert all(c.logprobs is None for c in done.choices)  # ranked by them, not asked to show them
    assert done.usage.completion_tokens == 4 * 8  # every sample ran


async def test_lm_eval_loglikelihood_request_scores_the_prompt_as_the_model_does(api):
    text = "The quick brown fox jumps"
    ids = make_tiny_tokenizer()(text, add_special_tokens=False)["input_ids"]
    # Not strict: the client types token_logprobs as floats, while OpenAI's API (and ours) sends
    # null for an echoed prompt's first token, which nothing predicts.
    for prompt in (text, ids):
        done = await _client(api, strict=False).completions.create(
            model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
        )
        choice = done.choices[0]
        assert choice.text == text and choice.finish_reason == "length"
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        # The engine's own scores of the prompt, bit for bit (which are the model's up to float32
        # rounding: tests/engine/test_prompt_logprobs.py holds them to the model in float64).
        scored = _offline(ids, SamplingParams(max_new_tokens=0, prompt_logprobs=1)).prompt_logprobs
        assert lp.token_logprobs[1:] == [e.logprob for e in scored]
        # lm-eval's is_greedy reads these: the model's top-1 and, where it is not that, the prompt's
        # own token (up to logprobs + 1 entries, as OpenAI and vLLM send them).
        for top, e, token in zip(lp.top_logprobs[1:], scored, lp.tokens[1:]):
            assert len(top) == (1 if e.top[0][0] == e.token_id else 2) and top[token] == e.logprob
            assert (max(top, key=top.__getitem__) == token) == (e.top[0][0] == e.token_id)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
        assert done.usage.completion_tokens == 0 and done.usage.prompt_tokens == len(ids)
    plain = await _client(api).completions.create(model="tiny", prompt=text, max_tokens=0, echo=True)
    assert plain.choices[0].text == text and plain.choices[0].logprobs is None


async def test_echo_with_a_completion_plain_and_streamed(api):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=2,
                  extra_body={"ignore_eos": True})  # fmt: skip
    whole = (await _client(api, strict=False).completions.create(**kwargs)).choices[0]
    expected = _offline(PROMPT, SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=2))
    prompt_text = make_tiny_tokenizer().decode(PROMPT)
    assert whole.text == prompt_text + expected.text
    lp = whole.logprobs
    want = [None] + [e.logprob for e in expected.prompt_logprobs] + [e.logprob for e in expected.logprobs]
    assert lp.token_logprobs == want and len(lp.tokens) == len(PROMPT) + 5
    stream = await _client(api, strict=False).completions.create(**kwargs, stream=True)
    chunks = [c.choices[0] async for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [c.logprobs for c in chunks if c.logprobs]
    assert [v for c in streamed for v in c.token_logprobs] == lp.token_logprobs
    assert [o for c in streamed for o in c.text_offset] == lp.text_offset


async def test_n_samples_with_echo_score_the_prompt_once_and_each_shows_it(api):
    """Samples 1.. of a prompt score nothing: they reuse sample 0's blocks (the prefix cache's
    hits) and show its prompt logprobs, which are what the prompt alone scores."""
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0.9, seed=2, n=3, echo=True, logprobs=2,
                  extra_body={"ignore_eos": True})  # fmt: skip
    scored = _offline(PROMPT, SamplingParams(max_new_tokens=1, prompt_logprobs=2))
    want = [None] + [e.logprob for e in scored.prompt_logprobs]
    before = api.core.scheduler.prefix.hit_tokens
    whole = await _client(api, strict=False).completions.create(**kwargs)
    assert api.core.scheduler.prefix.hit_tokens - before == 2 * 16  # samples 1 and 2 computed no full block
    for i, choice in enumerate(whole.choices):
        assert choice.logprobs.token_logprobs[: len(PROMPT)] == want, i
        sample = _offline(PROMPT, SamplingParams(seed=2 + i, logprobs=2, **(SAMPLING | {"max_new_tokens": 4})))
        assert choice.text == make_tiny_tokenizer().decode(PROMPT) + sample.text
    stream = await _client(api, strict=False).completions.create(**kwargs, stream=True)
    echoed: dict[int, list] = {}
    async for chunk in stream:
        for c in chunk.choices:
            if c.logprobs and c.index not in echoed:
                echoed[c.index] = c.logprobs.token_logprobs
    assert echoed == {i: want for i in range(3)}


async def test_leaving_a_stream_of_n_samples_aborts_every_one(api):
    stream = await _client(api, strict=False).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=400, temperature=0.9, n=3, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for _ in stream:
        break
    await stream.close()
    core = api.core
    for _ in range(200):
        if not core.scheduler.has_work():
            break
        await asyncio.sleep(0.05)
    assert not core.scheduler.has_work()
    alloc = core.scheduler.allocator
    assert alloc.num_free_blocks == alloc.num_blocks
