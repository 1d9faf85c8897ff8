"""logprobs, penalties and logit_bias through the official `openai` client, plain and streamed,
against the offline engine's own values; bad values are 400s naming the field."""

from __future__ import annotations

import pytest

from batchserve import SamplingParams
from tests.server.test_openai_api import _client, _offline, _raw

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9]
PENALTIES = {"frequency_penalty": 0.5, "presence_penalty": 0.3, "logit_bias": {"11": 3.0, "12": -100}}


async def test_completion_logprobs_plain_and_streamed_equal_the_engines(api):
    client = _client(api)
    expected = _offline(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3))
    done = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = done.choices[0].logprobs
    assert lp.token_logprobs == [e.logprob for e in expected.logprobs]
    assert len(lp.tokens) == 8 and all(len(top) <= 3 for top in lp.top_logprobs)
    # Offsets: each token's text after the ones before it (the tiny model's byte tokens decode alone to U+FFFD).
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    # The engine's top alternatives (as token text -> logprob: texts that decode alike share a key).
    assert all(set(top.values()) <= {v for _, v in e.top} for top, e in zip(lp.top_logprobs, expected.logprobs))
    stream = await _client(api, strict=False).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = [c.choices[0].logprobs async for c in stream if c.choices and c.choices[0].logprobs]
    assert [v for c in chunks for v in c.token_logprobs] == lp.token_logprobs
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset  # counted as the whole completion does


async def test_streamed_logprobs_are_rendered_beside_the_loop(api, monkeypatch):
    """A chunk with logprobs (up to 21 entries a token, n samples) is built in the render thread;
    plain text chunks stay on the loop (no thread hop for them)."""
    import threading

    from batchserve.server.openai.answers import Answer

    where: list[tuple[bool, str]] = []
    real = Answer._events

    def spy(self, i, out, state):
        where.append((bool(out.new_logprobs), threading.current_thread().name))
        return real(self, i, out, state)

    monkeypatch.setattr(Answer, "_events", spy)
    for logprobs in (3, None):
        stream = await _client(api, strict=False).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=logprobs, stream=True
        )
        assert [c async for c in stream]
    assert {name.startswith("batchserve-render") for lp, name in where if lp} == {True}
    assert {name for lp, name in where if not lp} == {threading.current_thread().name}


def test_a_samples_logprobs_are_appended_in_place_and_outputs_untouched():
    from batchserve.request import RequestOutput, RequestStats, TokenLogprob
    from batchserve.server.openai.answers import Sample

    outs = [
        RequestOutput("r", [t], "x", False, None, 1, 1, RequestStats(), new_logprobs=[TokenLogprob(t, -0.5)])
        for t in range(3)
    ]
    sample = Sample(0)
    for out in outs:
        sample.add(out)
    assert [e.token_id for e in sample.logprobs] == [0, 1, 2] and all(len(o.new_logprobs) == 1 for o in outs)


async def test_a_sampled_token_outside_the_top_is_among_its_alternatives(ascii_api):
    """As OpenAI and vLLM: `logprobs: k` gives up to k + 1 alternatives, the chosen token always one."""
    from batchserve.llm import LLM
    from tests.conftest import make_ascii_model, make_tiny_tokenizer
    from tests.server.conftest import tiny_core

    params = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=1, temperature=1.5, seed=7)
    expected = LLM.from_core(tiny_core(model=make_ascii_model())).generate([PROMPT], params)[0]
    text = make_tiny_tokenizer().decode
    # Where the draw left the top-1 for a token of other text (texts are the keys: alike ones merge).
    outside = [i for i, e in enumerate(expected.logprobs) if text([e.top[0][0]]) != text([e.token_id])]
    assert outside, "the seeded draw must leave the top-1 somewhere for this test to see it"
    done = await _client(ascii_api).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.5, seed=7, logprobs=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = done.choices[0].logprobs
    assert lp.token_logprobs == [e.logprob for e in expected.logprobs]
    assert all(len(top) <= 2 and chosen in top.values() for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    for i in outside:  # both the top-1 and the chosen token, with their own logprobs
        assert set(lp.top_logprobs[i].values()) == {expected.logprobs[i].top[0][1], expected.logprobs[i].logprob}


def test_completion_alternatives_add_the_chosen_token_only_where_it_is_missing():
    from batchserve.request import TokenLogprob
    from batchserve.server.openai.logprobs import completion_logprobs

    class Text:
        def __call__(self, token_id: int) -> str:
            return f"t{token_id}"

    entries = [TokenLogprob(5, -0.1, ((5, -0.1), (6, -2.0))), TokenLogprob(9, -3.0, ((5, -0.2), (6, -1.9)))]
    top = completion_logprobs(entries, Text())["top_logprobs"]  # type: ignore[arg-type]
    assert top == [{"t5": -0.1, "t6": -2.0}, {"t5": -0.2, "t6": -1.9, "t9": -3.0}]


async def test_chat_logprobs_and_top_logprobs_plain_and_streamed(api):
    client = _client(api)
    messages = [{"role": "user", "content": "hello there"}]
    chat = await client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob == t.logprob and bytes(t.bytes).decode() == t.token for t in content)
    stream = await client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
        stream=True,
    )  # fmt: skip
    streamed = [
        t.logprob async for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert streamed == [t.logprob for t in content]
    plain = await client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=6)
    assert plain.choices[0].logprobs is None


async def test_penalties_and_bias_reach_the_engine(api):
    client = _client(api)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, frequency_penalty=0.5, presence_penalty=0.3,
                            logit_bias={11: 3.0, 12: -100})  # fmt: skip
    expected = _offline(PROMPT, params)
    done = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}, **PENALTIES
    )
    assert done.choices[0].text == expected.text
    assert expected.token_ids != _offline(PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True)).token_ids
    rep = await client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.5},
    )
    assert (
        rep.choices[0].text
        == _offline(PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True, repetition_penalty=1.5)).text
    )


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
        ("/v1/completions", {"presence_penalty": -3}, "presence_penalty"),
        ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),  # outside the vocabulary: the engine's 400
        ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ("/v1/chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ],
)
async def test_bad_values_are_400s_naming_the_field_and_nothing_is_queued(api, path, extra, param):
    body = {"model": "tiny", "max_tokens": 2} | extra
    body |= {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    code, reply = await _raw(api, "POST", path, body)
    assert code == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["message"]
    assert not api.server.engine.core.scheduler.has_work()
