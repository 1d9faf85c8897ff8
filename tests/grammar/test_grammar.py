"""Constraints compiled by llguidance: refusals, the cache, and draft trees pruned to what a grammar allows."""

from __future__ import annotations

import gc
import json
import threading

import numpy as np
import pytest

from batchserve.grammar import ConstraintError, GrammarCompiler, GrammarError, allows
from batchserve.request import Constraint, SamplingParams
from batchserve.trees import DraftTree
from tests.conftest import TINY_VOCAB, make_tiny_tokenizer


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(make_tiny_tokenizer(), TINY_VOCAB, max_chars=2000)


def ids(text: str) -> list[int]:
    return list(text.encode())  # the tiny tokenizer's ids are the bytes


def test_constraints_name_their_kind_and_need_a_spec():
    with pytest.raises(ValueError, match="kind"):
        Constraint("xml", "<a/>")
    with pytest.raises(ValueError, match="non-empty"):
        Constraint("regex", "")
    with pytest.raises(ValueError, match="Constraint"):
        SamplingParams(constraint="json")  # type: ignore[arg-type]
    assert SamplingParams(constraint=Constraint("json_object")).constraint.kind == "json_object"


@pytest.mark.parametrize(
    ("constraint", "problem"),
    [
        (Constraint("json_schema", "{not json"), "invalid json_schema"),
        (Constraint("json_schema", "[1, 2]"), "JSON object"),
        (Constraint("json_schema", json.dumps({"type": "strin"})), "strin"),
        (Constraint("regex", "[0-9"), "unclosed character class"),
        (Constraint("grammar", "start: missing_rule"), "missing_rule"),
        (Constraint("regex", "a" * 2001), "limit is 2000"),
    ],
)
def test_bad_constraints_are_refused_naming_the_problem(compiler: GrammarCompiler, constraint, problem):
    with pytest.raises(ConstraintError, match=problem):
        compiler.compile(constraint)
    assert isinstance(ConstraintError("x"), ValueError)  # every front end maps it to a 400


def test_compiled_grammars_are_cached_by_their_text(compiler: GrammarCompiler):
    c = Constraint("regex", "[a-c]{2}")
    assert compiler.compile(c) is compiler.compile(Constraint("regex", "[a-c]{2}"))
    small = GrammarCompiler(make_tiny_tokenizer(), TINY_VOCAB, max_chars=100, cache_size=2)
    small.compile(Constraint("regex", "a"))  # held by no one: only the cache keeps it
    small.compile(Constraint("regex", "b"))
    small.compile(Constraint("regex", "c"))  # evicts the least recently used
    gc.collect()
    small.compile(Constraint("regex", "a"))
    assert small.num_builds == 4


def test_the_cache_is_bounded_by_the_characters_it_holds_too(builds: _CountingMatcher):
    # A cached matcher holds its parser (a large schema's: most of a MB): many large ones must not
    # fit where many small ones do.
    small = GrammarCompiler(make_tiny_tokenizer(), TINY_VOCAB, max_chars=100, cache_chars=12)
    first = small.compile(Constraint("regex", "a{1,3}"))
    assert small.compile(Constraint("regex", "b{1,3}")) is small.compile(Constraint("regex", "b{1,3}"))
    assert small.compile(Constraint("regex", "a{1,3}")) is first and len(builds.threads) == 2  # 12 characters fit
    small.compile(Constraint("regex", "c{1,3}"))  # 18 do not: the least recently used goes
    assert small.compile(Constraint("regex", "b{1,3}")) is not None and len(builds.threads) == 4


def _state_mask(compiler: GrammarCompiler, constraint: Constraint, prefix: list[int]) -> np.ndarray:
    g = compiler.matcher(compiler.compile(constraint))
    g.commit(prefix)
    return g.prune(None)[1][0]


def test_pruning_keeps_allowed_branches_and_gives_each_row_its_state_mask(compiler: GrammarCompiler):
    c = Constraint("regex", "(yes|no|maybe)!")
    g = compiler.matcher(compiler.compile(c))
    y, e, s, n, o, x, bang = (ord(ch) for ch in "yesnox!")
    # root -> y -> e -> s -> !     (allowed all the way)
    #      -> n -> o -> x          (x is not allowed after "no": cut, with nothing below it)
    #      -> x -> e               (x is not allowed first: cut with its subtree)
    tree = DraftTree((y, n, x, e, o, s, x, e, bang), (None, None, None, 0, 1, 3, 4, 2, 5))
    pruned, masks = g.prune(tree)
    assert pruned is not None
    assert pruned.tokens == (y, n, e, o, s, bang) and pruned.parents == (None, None, 0, 1, 2, 4)
    assert masks.shape[0] == 1 + len(pruned) and masks.shape[1] * 32 >= TINY_VOCAB
    for row, path in enumerate([[], [y], [n], [y, e], [n, o], [y, e, s], [y, e, s, bang]]):
        assert np.array_equal(masks[row], _state_mask(compiler, c, path)), path
    assert allows(masks[0], y) and allows(masks[0], n) and not allows(masks[0], x)
    # Pruning left the request's own state where it was: the root's row is the start again.
    assert np.array_equal(g.prune(None)[1][0], masks[0])
    # Any prefix of the pruned tree is a tree with the same prefix of masks (what the policy keeps).
    head = pruned.prefix(3)
    assert head.parents == (None, None, 0)


def test_nothing_allowed_leaves_no_tree_and_the_end_of_sequence_is_never_drafted(compiler: GrammarCompiler):
    g = compiler.matcher(compiler.compile(Constraint("regex", "ab")))
    pruned, masks = g.prune(DraftTree.chain(ids("xy")))
    assert pruned is None and masks.shape[0] == 1
    g.commit(ids("ab"))
    assert g.done
    eos = g.eos_token_id
    pruned, _ = g.prune(DraftTree.chain([eos]))
    assert pruned is None


def test_json_schema_grammar_allows_a_valid_document_token_by_token(compiler: GrammarCompiler):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    g = compiler.matcher(compiler.compile(Constraint("json_schema", json.dumps(schema))))
    doc = json.dumps({"name": "x", "tags": ["a", "b"]})  # ", " and ": ": the shape the grammar asks for
    pruned, _ = g.prune(DraftTree.chain(ids(doc)))
    assert pruned is not None and len(pruned) == len(doc)
    g.commit(ids(doc))
    assert g.done
    wrong = compiler.matcher(compiler.compile(Constraint("json_schema", json.dumps(schema))))
    pruned, _ = wrong.prune(DraftTree.chain(ids('{"name": "x", "tags": ["c"]}')))
    assert pruned is not None and bytes(pruned.tokens).decode() == '{"name": "x", "tags": ["'


class _CountingMatcher:
    """llguidance.LLMatcher, counting the matchers built from a grammar (the parser construction
    that costs tens of ms for a large schema) and the threads that built them."""

    def __init__(self, real: type) -> None:
        self.real, self.threads = real, []

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.current_thread())
        return self.real(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> _CountingMatcher:
    import llguidance

    spy = _CountingMatcher(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", spy)
    return spy


def test_a_cached_grammar_gives_each_request_a_copy_never_a_new_parser(builds: _CountingMatcher):
    compiler = GrammarCompiler(make_tiny_tokenizer(), TINY_VOCAB, max_chars=2000)
    c = Constraint("regex", "(yes|no)!")
    first, second = (compiler.matcher(compiler.compile(c)) for _ in range(2))
    third = compiler.matcher(compiler.compile(Constraint("regex", "(yes|no)!")))
    assert len(builds.threads) == 1 and compiler.num_builds == 1  # one parser for the three requests
    first.commit(ids("yes"))  # each copy has a state of its own
    assert np.array_equal(second.prune(None)[1][0], third.prune(None)[1][0])
    assert not allows(second.prune(None)[1][0], ord("!")) and allows(first.prune(None)[1][0], ord("!"))
    first.commit([ord("!")])
    assert first.done and not second.done


def test_the_end_of_sequence_is_refused_as_an_output_token_never_skipped(compiler: GrammarCompiler):
    # The scheduler ends a request at the grammar's end of sequence, ignore_eos or not: a list of
    # output tokens that holds one (a resume) is one the grammar could not have given.
    g = compiler.matcher(compiler.compile(Constraint("regex", "[a-z]+")))
    g.commit(ids("ab"))
    with pytest.raises(GrammarError, match="end of sequence"):
        g.commit([g.eos_token_id, ord("c")])


def test_a_compiled_grammar_still_held_is_found_after_the_cache_let_it_go(builds: _CountingMatcher):
    # A front end compiles off the loop and holds the result until its requests are in: however
    # many others compile meanwhile, the engine (on the loop) copies it and never builds it again.
    small = GrammarCompiler(make_tiny_tokenizer(), TINY_VOCAB, max_chars=100, cache_size=1)
    held = small.compile(Constraint("regex", "a+"))
    small.compile(Constraint("regex", "b+"))  # the cache's one place: "a+" is out of it
    assert small.compile(Constraint("regex", "a+")) is held and len(builds.threads) == 2
    del held
    small.compile(Constraint("regex", "b+"))  # built again (3): "a+" is out of the cache again,
    gc.collect()  # and held by no one now
    small.compile(Constraint("regex", "a+"))
    assert len(builds.threads) == 4


def test_a_tenant_finds_only_what_its_own_scope_compiled(compiler: GrammarCompiler):
    """A hit would tell a tenant (by its call's speed) that another sent the same schema lately."""
    c = Constraint("regex", "[d-f]{3}")
    builds = compiler.num_builds
    mine = compiler.compile(c, "alice")
    assert compiler.compile(c, "alice") is mine and compiler.num_builds == builds + 1
    theirs = compiler.compile(c, "bob")
    assert theirs is not mine and compiler.num_builds == builds + 2
