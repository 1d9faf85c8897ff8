"""Bad input is refused before it reaches the scheduler; every stop condition holds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from batchserve import FinishReason, SamplingParams
from batchserve.admission import Submission
from tests.conftest import TINY_VOCAB, hf_greedy, tiny_llm


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -3}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"decoding_length": -1}, "decoding_length"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm():
    return tiny_llm(None, block_size=4, num_blocks=64)  # 256 KV slots


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([1, TINY_VOCAB], SamplingParams(), "prompt_token_ids"),
        ([1, -1], SamplingParams(), "prompt_token_ids"),
        ([1, 2.5], SamplingParams(), "prompt_token_ids"),
        ([1] * 1024, SamplingParams(), "context"),  # the tiny model's context is 1024
        ([1, 2], SamplingParams(stop_token_ids=[TINY_VOCAB]), "stop_token_ids"),
        ([1] * 200, SamplingParams(max_new_tokens=100), "KV cache"),  # can never fit 256 slots
    ],
)
def test_bad_input_is_refused_before_the_scheduler(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], params)
    sched = llm.engine.scheduler
    assert not sched.requests and not sched.waiting and not sched.running
    sched.check_integrity()


def test_one_bad_prompt_submits_nothing(llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[1, 2, 3], [4, 9999]])
    assert not llm.engine.scheduler.requests


def test_stop_token_ids_and_eos(llm, tiny_model):
    ref = hf_greedy(tiny_model, [7, 8, 9], 30)
    stop_at = ref[10]
    first = ref.index(stop_at)
    r = llm.generate([[7, 8, 9]], SamplingParams(max_new_tokens=30, stop_token_ids=[stop_at]))[0]
    assert r.finish_reason is FinishReason.STOP_SEQUENCE
    assert r.token_ids == ref[: first + 1]

    # The same token as the model's EOS: EOS, unless ignore_eos.
    before = llm.engine.facts
    llm.engine.facts = replace(before, eos_token_ids=frozenset([stop_at]))
    try:
        r = llm.generate([[7, 8, 9]], SamplingParams(max_new_tokens=30))[0]
        assert r.finish_reason is FinishReason.EOS and r.token_ids == ref[: first + 1]
        r = llm.generate([[7, 8, 9]], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
        assert r.finish_reason is FinishReason.LENGTH and r.token_ids == ref
    finally:
        llm.engine.facts = before


def test_stop_inside_an_accepted_draft_truncates(tiny_model):
    """An oracle draft runs past the stop token; everything after it is dropped."""
    from tests.engine.drafters import OracleDrafter

    prompt = [3, 1, 4, 1, 5]
    ref = hf_greedy(tiny_model, prompt, 40)
    stop_at = ref[12]
    llm = tiny_llm(OracleDrafter({tuple(prompt): ref}, 0, TINY_VOCAB, depth=30), decoding_length=30)
    r = llm.generate([prompt], SamplingParams(max_new_tokens=40, stop_token_ids=[stop_at]))[0]
    assert r.token_ids == ref[: ref.index(stop_at) + 1]
    assert r.stats.steps == 1  # the whole answer came in one step, then was cut
    # Only the drafts that reached the output count as accepted (the stop token is one of
    # them: the oracle drafted it), never the 30 the verifier walked through.
    assert r.stats.draft_tokens_proposed == 30 and r.stats.draft_tokens_accepted == len(r.token_ids)


def test_accepted_drafts_are_the_output_beyond_one_token_per_step(tiny_model):
    """Without a stop inside a draft, every step emits its accepted drafts plus one token."""
    from tests.engine.drafters import OracleDrafter

    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8]]
    refs = {tuple(p): hf_greedy(tiny_model, p, 40, ignore_eos=True) for p in prompts}
    llm = tiny_llm(OracleDrafter(refs, 0, TINY_VOCAB, depth=6), decoding_length=6)
    for r in llm.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True)):
        assert r.finish_reason is FinishReason.LENGTH and r.token_ids == refs[tuple(r.prompt_token_ids)]
        assert r.stats.draft_tokens_accepted == len(r.token_ids) - r.stats.steps > 0
    llm.engine.scheduler.check_integrity()
    assert llm.engine.scheduler.allocator.num_free_blocks == llm.engine.scheduler.allocator.num_blocks


def test_stop_string_across_steps_cuts_text_and_tokens(llm, tiny_model, tiny_tokenizer):
    prompt = [10, 20, 30]
    ref = hf_greedy(tiny_model, prompt, 40)
    full = tiny_tokenizer.decode(ref)
    # A stop string made of the bytes of output tokens 8 and 9 (two tokens, so two steps
    # with drafts off); it must be found across the step boundary.
    stop = tiny_tokenizer.decode(ref[8:10])
    cut = full.index(stop)
    nodraft = tiny_llm(None, draft="none")
    for engine in (llm, nodraft):
        r = engine.generate([prompt], SamplingParams(max_new_tokens=40, stop=[stop]))[0]
        assert r.finish_reason is FinishReason.STOP_SEQUENCE
        assert r.text == full[:cut]
        assert stop not in r.text
        assert r.token_ids == ref[: len(r.token_ids)] and 9 <= len(r.token_ids) <= 10


def test_max_new_tokens_and_context_limit(tiny_model):
    llm = tiny_llm(None)
    r = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=7))[0]
    assert r.finish_reason is FinishReason.LENGTH and len(r.token_ids) == 7
    # 1020 prompt tokens in a 1024 context: stops at the context, not at max_new_tokens.
    r = llm.generate([[5] * 1020], SamplingParams(max_new_tokens=50))[0]
    assert r.finish_reason is FinishReason.LENGTH and len(r.token_ids) == 4


def test_streamed_text_equals_final_text_with_multibyte(tiny_tokenizer):
    """Byte tokens split UTF-8 characters; deltas must never carry half a character."""
    llm = tiny_llm(None)
    prompt = tiny_tokenizer("ünïcödé ✓ 漢字").input_ids
    r = llm.generate([prompt], SamplingParams(max_new_tokens=60, temperature=1.0, seed=1))[0]
    deltas, token_ids = [], []
    core = llm.engine
    core.add_request(Submission(prompt, SamplingParams(max_new_tokens=60, temperature=1.0, seed=1), request_id="s"))
    while core.has_work():
        for o in core.step():
            deltas.append(o.new_text)
            token_ids += o.new_token_ids
    assert token_ids == r.token_ids  # the same seeded draw
    # The streamed text is the tokenizer's own decoding of the tokens streamed, not just the
    # engine's deltas agreeing with its own final text.
    expected = tiny_tokenizer.decode(token_ids, skip_special_tokens=True)
    assert len(expected) > 20 and any(ord(c) > 127 for c in expected)  # multi-byte characters decoded
    assert "".join(deltas) == expected
    assert r.text == expected

    # Feed the bytes of a multi-byte string one token at a time through the engine's
    # detokenizer: no delta may carry a broken character.
    text = "ünïcödé ✓ 漢字 🙂"
    req = core.add_request(Submission([1], SamplingParams(max_new_tokens=100), request_id="bytes"))
    pieces = []
    for tok in tiny_tokenizer(text).input_ids:
        assert not core.detok.on_token(req.request_id, tok)
        pieces.append(core.detok.take(req.request_id, finished=False))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some tokens were held back until their character completed
    core.abort("bytes")
