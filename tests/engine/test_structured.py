"""Structured output end to end on the tiny model: valid documents, the same text with or without
drafts (greedy and seeded sampling), drafts the grammar forbids never verified, clean refusals."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from batchserve import LLM, SamplingParams
from batchserve.admission import Submission
from batchserve.grammar import allows
from batchserve.request import Constraint, FinishReason
from tests.conftest import TINY_VOCAB, make_ascii_model, make_tiny_tokenizer
from tests.engine.drafters import OracleDrafter, RandomTreeDrafter

PEOPLE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Alice, 30, lives in Paris", "bob the admin", "x"]


def _check_person(doc: Any) -> None:
    """What the schema asks, checked by hand (no validator dependency)."""
    assert set(doc) == set(PEOPLE["required"])
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 12
    assert isinstance(doc["age"], int) and 0 <= doc["age"] <= 150
    assert doc["role"] in ("admin", "user", "guest")
    assert set(doc["address"]) == {"city", "zip"} and re.fullmatch(r"[0-9]{5}", doc["address"]["zip"])
    assert isinstance(doc["tags"], list) and len(doc["tags"]) <= 3 and all(len(t) <= 6 for t in doc["tags"])


def _llm(drafter: Any = None, **kw: Any) -> LLM:
    kw.setdefault("adaptive", False)
    return LLM(hf_model=make_ascii_model(), tokenizer=make_tiny_tokenizer(), drafter=drafter, **kw)


def _generate(llm: LLM, params: SamplingParams) -> list[Any]:
    return llm.generate(PROMPTS, params, use_tqdm=False)


def test_schema_output_is_valid_and_identical_with_or_without_drafts():
    params = SamplingParams(max_new_tokens=300, constraint=Constraint("json_schema", json.dumps(PEOPLE)))
    plain = _generate(_llm(draft="none"), params)
    for out in plain:
        assert out.finish_reason is FinishReason.EOS, out.text
        _check_person(json.loads(out.text))
    truth = {tuple(make_tiny_tokenizer()(p).input_ids): o.token_ids for p, o in zip(PROMPTS, plain)}
    for drafter in (OracleDrafter(truth, seed=3, vocab=TINY_VOCAB, depth=10), RandomTreeDrafter(5, TINY_VOCAB)):
        llm = _llm(drafter, decoding_length=16)
        verified: list[tuple[Any, Any]] = []

        def record(out: Any, _: Any, verified: list[tuple[Any, Any]] = verified) -> None:
            verified.extend((r.draft, r.token_mask) for r in out.requests)

        llm.engine.step_listeners.append(record)
        drafted = _generate(llm, params)
        assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
        # Every verified node was allowed by the grammar at its parent's row: pruned before the forward.
        for tree, masks in verified:
            if tree is not None:
                assert masks is not None and len(masks) == 1 + len(tree)
                for i, (tok, parent) in enumerate(zip(tree.tokens, tree.parents)):
                    assert allows(masks[0 if parent is None else 1 + parent], tok), (i, tok)
        if isinstance(drafter, OracleDrafter):  # the true continuation was drafted, and it paid
            assert sum(o.stats.steps for o in drafted) < sum(o.stats.steps for o in plain)


def test_seeded_sampling_under_a_grammar_is_the_same_with_or_without_drafts():
    params = SamplingParams(
        max_new_tokens=300, temperature=0.8, seed=11, constraint=Constraint("json_schema", json.dumps(PEOPLE))
    )
    plain = _generate(_llm(draft="none"), params)
    for out in plain:
        _check_person(json.loads(out.text))
    truth = {tuple(make_tiny_tokenizer()(p).input_ids): o.token_ids for p, o in zip(PROMPTS, plain)}
    drafted = _generate(_llm(OracleDrafter(truth, seed=4, vocab=TINY_VOCAB), decoding_length=8), params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (Constraint("json_object"), lambda text: isinstance(json.loads(text), dict)),
        (Constraint("regex", r"[0-9]{3}-[a-z]{2,4}"), lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text)),
        (Constraint("grammar", 'start: "yes" | "no" | "it depends"'), lambda text: text in ("yes", "no", "it depends")),
    ],
)
def test_json_mode_regex_and_lark_grammars(constraint: Constraint, check):
    llm = _llm(draft="lookahead", decoding_length=8)
    # json_object bounds nothing: give it room, and check only the documents that closed.
    outs = _generate(llm, SamplingParams(max_new_tokens=400, constraint=constraint))
    closed = [o for o in outs if o.finish_reason is FinishReason.EOS]
    assert closed
    for out in closed:
        assert check(out.text), out.text


def test_a_bad_constraint_is_refused_before_the_request_is_queued():
    llm = _llm(draft="lookahead")
    bad = SamplingParams(constraint=Constraint("json_schema", '{"type": "objec"}'))
    with pytest.raises(ValueError, match="objec"):
        llm.engine.add_request(Submission("hi", bad))
    assert not llm.engine.scheduler.requests
    # Constrained and free requests share a batch; each gets what it asked for.
    free, boxed = llm.generate(
        ["hi", "hi"],
        [SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=20, constraint=Constraint("regex", "ok"))],
        use_tqdm=False,
    )
    assert boxed.text == "ok" and len(free.token_ids) == 20


def test_the_tokens_a_grammar_forces_are_drafted_even_where_the_drafter_has_nothing():
    from batchserve.draft import NoDrafter

    class Silent(NoDrafter):
        def propose(self, request_id, token_ids, max_tokens):
            return None

    params = SamplingParams(max_new_tokens=300, constraint=Constraint("json_schema", json.dumps(PEOPLE)))
    plain = _generate(_llm(draft="none"), params)
    forced = _generate(_llm(Silent(), draft="lookahead", decoding_length=16), params)
    assert [o.token_ids for o in forced] == [o.token_ids for o in plain]
    # The keys, quotes and separators the schema fixes came as accepted drafts: far fewer steps.
    for f, p in zip(forced, plain):
        assert p.stats.draft_tokens_proposed == 0  # `draft none` drafts nothing, forced tokens neither
        assert f.stats.draft_tokens_accepted > 20 and f.stats.steps < 0.8 * p.stats.steps
