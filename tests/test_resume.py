"""Resumed generations (`batchserve/resume.py`): a generation cut after any step and resumed from
the tokens delivered so far, on a fresh engine, continues the uninterrupted one token for token and
character for character, greedy and seeded, with drafts on; stop strings, penalties and grammars
across the cut; resumes that could not be are refused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batchserve.admission import Submission
from batchserve.config import CacheConfig, DraftConfig, EngineConfig, SchedulerConfig
from batchserve.engine import EngineCore
from batchserve.request import Constraint, FinishReason, SamplingParams
from tests.conftest import make_ascii_model, make_tiny_tokenizer

PROMPT = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]  # "Hello world"


def _core() -> EngineCore:
    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128),
        draft=DraftConfig(decoding_length=8, adaptive=False),
    )
    return EngineCore(config, make_ascii_model(), make_tiny_tokenizer())


def _steps(core: EngineCore, params: SamplingParams, neighbours: int = 1) -> list[Any]:
    """Each step's output of one request (beside `neighbours` others, so batches differ)."""
    req = core.add_request(Submission(PROMPT, params))
    for i in range(neighbours):
        core.add_request(Submission([65 + i, 66, 67], SamplingParams(max_new_tokens=40, ignore_eos=True)))
    outs = []
    while core.has_work():
        outs += [o for o in core.step() if o.request_id == req.request_id]
    return outs


def _joined(outs: list[Any]) -> tuple[list[int], str]:
    return [t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs)


CASES = {
    "greedy": SamplingParams(max_new_tokens=40, ignore_eos=True),
    "seeded": SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.9, seed=11),
    "penalties": SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.8, seed=3,
                                frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3),
    "stop string": SamplingParams(max_new_tokens=40, ignore_eos=True, stop=("e ", "xyz")),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_resume_after_any_step_continues_the_uninterrupted_generation(case):
    params = CASES[case]
    whole = _steps(_core(), params)
    tokens, text = _joined(whole)
    assert len(whole) > 3  # drafts on: several steps, some of several tokens
    for cut in range(1, len(whole) - 1):
        delivered_tokens, delivered_text = _joined(whole[:cut])
        resumed = _steps(_core(), SamplingParams(**{**_fields(params), "resume_token_ids": delivered_tokens}), 2)
        rest_tokens, rest_text = _joined(resumed)
        assert delivered_tokens + rest_tokens == tokens, cut
        assert delivered_text + rest_text == text, cut
        assert resumed[-1].finish_reason == whole[-1].finish_reason and resumed[-1].num_output_tokens == len(tokens)


def _fields(params: SamplingParams) -> dict[str, Any]:
    names = ("max_new_tokens", "temperature", "seed", "stop", "ignore_eos", "frequency_penalty", "presence_penalty",
             "repetition_penalty", "constraint", "logprobs")  # fmt: skip
    return {n: getattr(params, n) for n in names}


def test_a_grammar_is_advanced_through_the_resumed_tokens():
    schema = {"type": "object", "properties": {"word": {"enum": ["alpha", "beta", "gamma"]}}, "required": ["word"],
              "additionalProperties": False}  # fmt: skip
    params = SamplingParams(max_new_tokens=40, constraint=Constraint("json_schema", json.dumps(schema)))
    whole = _steps(_core(), params)
    tokens, text = _joined(whole)
    assert json.loads(text) and whole[-1].finish_reason is FinishReason.EOS
    for cut in (3, 8):
        resumed = _steps(_core(), SamplingParams(**{**_fields(params), "resume_token_ids": tokens[:cut]}))
        assert tokens[:cut] + _joined(resumed)[0] == tokens
    forbidden = [*b'{"word": "al', ord("x")]  # no word of the enum goes on so
    with pytest.raises(ValueError, match=r"resume_token_ids\[12\].*forbids"):
        _core().add_request(Submission(PROMPT, SamplingParams(**{**_fields(params), "resume_token_ids": forbidden})))


def test_logprobs_come_for_the_new_tokens_only():
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=2)
    whole = _steps(_core(), params)
    entries = [e for o in whole for e in o.new_logprobs or []]
    tokens, _ = _joined(whole)
    resumed = _steps(_core(), SamplingParams(**{**_fields(params), "resume_token_ids": tokens[:5]}))
    assert [e for o in resumed for e in o.new_logprobs or []] == entries[5:]


@pytest.mark.parametrize(
    ("params", "says"),
    [
        (SamplingParams(max_new_tokens=8, resume_token_ids=[300]), r"\[0\]: 300 is not a token id"),
        (SamplingParams(max_new_tokens=8, stop_token_ids=[66], resume_token_ids=[65, 66]), r"\[1\].*stop token"),
        (SamplingParams(max_new_tokens=8, stop=("BC",), resume_token_ids=[65, 66, 67]), r"\[2\].*stop string"),
    ],
)
def test_a_resume_the_generation_could_not_have_reached_is_refused_and_leaves_nothing(params, says):
    core = _core()
    with pytest.raises(ValueError, match="resume_token_ids" + says):
        core.add_request(Submission(PROMPT, params))
    core.step()  # the withdrawn request leaves nothing behind
    assert not core.has_work() and core.detok.num_active == 0
    core.scheduler.check_integrity()


def test_resume_bounds_are_checked_where_the_params_are_made():
    with pytest.raises(ValueError, match="nothing of max_new_tokens"):
        SamplingParams(max_new_tokens=3, resume_token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="token ids"):
        SamplingParams(resume_token_ids=[-1])
    core = _core()
    with pytest.raises(ValueError, match="fill the model's context"):
        core.add_request(
            Submission(
                PROMPT, SamplingParams(max_new_tokens=5000, resume_token_ids=[65] * (core.facts.max_model_len - 5))
            )
        )


def test_the_grammar_refuses_an_end_of_sequence_in_the_resumed_tokens_even_with_ignore_eos():
    # Generated, the grammar's end of sequence ends the text (ignore_eos or not): a resume with one
    # inside could not have come from this request, and the grammar's state would part from the output.
    core = _core()
    eos = core.grammars.eos_token_id
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, constraint=Constraint("regex", "[a-z]+"))
    with pytest.raises(ValueError, match=r"resume_token_ids\[1\].*end of sequence"):
        core.add_request(Submission(PROMPT, SamplingParams(**{**_fields(params), "resume_token_ids": [97, eos, 98]})))
    core.step()
    assert not core.has_work() and core.detok.num_active == 0
    # Without a grammar, ignore_eos makes the model's end of sequence an ordinary token, resumed or not.
    plain = SamplingParams(
        max_new_tokens=20, ignore_eos=True, resume_token_ids=[97, *sorted(core.facts.eos_token_ids), 98]
    )
    req = core.add_request(Submission(PROMPT, plain))
    assert req.output_token_ids == list(plain.resume_token_ids)
    core.abort(req.request_id)


def test_resumed_tokens_are_counted_on_their_own():
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    tokens, _ = _joined(_steps(_core(), params))
    resumed = _steps(_core(), SamplingParams(**{**_fields(params), "resume_token_ids": tokens[:5]}))
    last = resumed[-1]
    assert last.stats.resumed_tokens == 5 and last.num_output_tokens == 12 and last.num_prompt_tokens == len(PROMPT)
    assert last.tokens_per_step == 7 / last.stats.steps  # the speculation stat: tokens generated here


class _Unreadable(list):
    """Token ids whose count is known but which fail when read or copied."""

    def __iter__(self):
        raise AssertionError("the resumed tokens were read before their count was checked")


def test_the_resume_count_is_checked_before_any_token_is_read():
    with pytest.raises(ValueError, match="nothing of max_new_tokens"):
        SamplingParams(max_new_tokens=4, resume_token_ids=_Unreadable([1] * 10))
