"""Predicted outputs on the tiny model: never a different output, far fewer steps when right,
usage counts, privacy between requests, and the bounds on what a request may send."""

from __future__ import annotations

import random

import pytest

from batchserve import SamplingParams
from batchserve.admission import Submission
from batchserve.llm import as_references
from tests.conftest import tiny_llm

PROMPTS = ["def add(a, b):\n    return a + b\n", [7, 8, 9, 10, 11, 12]]
N = 64


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=N, ignore_eos=True, **kw)


@pytest.mark.parametrize("draft", ["lookahead", "llma", "jacobi", "hybrid", "none"])
def test_greedy_output_is_the_same_whatever_the_prediction(draft):
    llm = tiny_llm(draft=draft)
    base = [r.token_ids for r in llm.generate(PROMPTS, _params())]
    right = base[0]
    edited = [*right[:20], 3, 4, 5, *right[25:]]
    rng = random.Random(0)
    noise = [rng.randrange(256) for _ in range(N)]
    for refs in (
        [right, None],  # right for one, none for the other, in the same batch
        ["a prediction that is wrong", noise],
        ["", []],  # empty
        [[edited, noise], [right]],  # several, and the other prompt's output
    ):
        got = [r.token_ids for r in llm.generate(PROMPTS, _params(), references=refs)]
        assert got == base, (draft, refs)


def test_the_right_prediction_takes_far_fewer_steps_and_is_counted():
    llm = tiny_llm(trie_scope="request")  # the trie learns nothing from one run for the next
    base = llm.generate(PROMPTS[0], _params())[0]
    assert base.stats.steps == N  # random weights: nothing repeats, nothing to draft
    r = llm.generate(PROMPTS[0], _params(), references=base.token_ids)[0]
    assert r.token_ids == base.token_ids
    assert r.tokens_per_step >= 4  # decoding_length 16: up to 17 tokens a step
    s = r.stats
    assert s.prediction_tokens == N
    # Every step emits its accepted drafts plus one token of the model's own.
    assert s.accepted_prediction_tokens == N - s.steps and s.draft_tokens_accepted == N - s.steps
    assert s.rejected_prediction_tokens == s.steps

    wrong = llm.generate(PROMPTS[0], _params(), references="nothing like it")[0]
    assert wrong.token_ids == base.token_ids and wrong.stats.accepted_prediction_tokens == 0
    assert wrong.stats.rejected_prediction_tokens == wrong.stats.prediction_tokens > 0


def test_with_draft_none_a_prediction_is_taken_and_ignored():
    llm = tiny_llm(draft="none")
    base = llm.generate(PROMPTS[0], _params())[0]
    r = llm.generate(PROMPTS[0], _params(), references=base.token_ids)[0]
    assert r.token_ids == base.token_ids and r.stats.steps == N
    assert (r.stats.accepted_prediction_tokens, r.stats.rejected_prediction_tokens) == (0, N)


def test_seeded_sampling_is_the_same_with_a_prediction():
    llm = tiny_llm(trie_scope="request")
    params = _params(temperature=0.8, seed=3)
    base = llm.generate(PROMPTS, params)
    got = llm.generate(PROMPTS, params, references=[base[0].token_ids, "not it"])
    assert [r.token_ids for r in got] == [r.token_ids for r in base]
    assert got[0].stats.steps < N // 2


def test_a_prediction_is_freed_when_its_request_finishes_or_is_aborted():
    core = tiny_llm().engine
    drafter = core.speculation.drafter
    done = core.add_request(Submission([1, 2, 3], _params(), references=[[5, 6, 7, 8]]))
    kept = core.add_request(Submission([1, 2, 3], _params(), references=["abc"]))
    core.step()
    assert len(drafter.references) == 2 and done.reference_token_ids == [[5, 6, 7, 8]]
    core.abort(kept.request_id)
    assert len(drafter.references) == 1
    while core.has_work():
        core.step()
    assert len(drafter.references) == 0


def test_another_request_of_the_same_tenant_never_drafts_from_a_prediction():
    llm = tiny_llm(trie_scope="global")  # everything else is shared
    core = llm.engine
    base = llm.generate(PROMPTS[0], _params())[0]
    seen: list[tuple[str, frozenset[int]]] = []
    core.step_listeners.append(
        lambda out, _: seen.extend((r.request_id, r.draft.referenced) for r in out.requests if r.draft is not None)
    )
    a = core.add_request(Submission(PROMPTS[0], _params(), request_id="a", references=[base.token_ids]))
    b = core.add_request(Submission(PROMPTS[0], _params(), request_id="b"))
    while core.has_work():
        core.step()
    assert a.output_token_ids == b.output_token_ids == base.token_ids
    assert any(rid == "a" and marks for rid, marks in seen)
    assert not any(rid == "b" and marks for rid, marks in seen)


def test_references_are_bounded_and_checked_before_anything_is_queued():
    llm = tiny_llm(max_references=2)
    context = llm.engine.facts.max_model_len
    cases = [
        (["a", "b", "c"], "3 references, at most 2"),
        ([[1] * (context + 1)], f"over {context} tokens"),
        (["x" * (context + 1)], f"over {context} tokens"),  # one byte a token here
        (["x" * (32 * context + 1)], "characters cannot fit"),  # refused before tokenizing
        ([[1, 2, 256]], r"references\[0\]: token ids"),
        ([[1, True]], r"references\[0\]: token ids"),
    ]
    for refs, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(["ok", "fine"], _params(), references=[None, refs])
    with pytest.raises(ValueError, match="1 references for 2 prompts"):
        llm.generate(["ok", "fine"], _params(), references=["x"])
    assert not llm.engine.has_work()


def test_the_forms_a_prompt_s_references_take():
    assert as_references(None) == [] and as_references([]) == []
    assert as_references("text") == ["text"] and as_references([1, 2]) == [[1, 2]]
    assert as_references(["a", [1, 2]]) == ["a", [1, 2]]
