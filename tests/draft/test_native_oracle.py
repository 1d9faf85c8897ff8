"""The randomized oracle over every proposal layout: the native drafter, through TrieDrafter's
API, against a pure-Python model written from its rules (model_drafter.py, model_texts.py).

Random token streams (a small vocabulary, so n-grams repeat; echoes of a request's own text, so
copies run long; prompts from a small pool, so a scope sees the same prompt again) go through
requests that start with any layout (the drafter's, or one of their own), any scope or none,
references and resumed tokens; tokens are accepted at once or deferred and flushed; scopes warm up,
decay and are evicted. Every proposal (any budget) must equal the model's tree in tokens, parents,
scores (exactly) and match, every match length the model's, and after every call the drafter's
counts, scopes (in recency order), tries (paths, counts and creation order) and recent outputs.
One run per drafter layout, with and without the copy chain; each checks that its trees drew on
every source the layout has (own text, output trie, copy chain, recent outputs, a repeated prompt).

A fixed seed and 200 examples a run here (part of `make test`, about 10 s); BATCHSERVE_FUZZ_SCALE
and BATCHSERVE_FUZZ_SEED run more, as `make fuzz` does for the other fuzzers."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from batchserve.config import DraftConfig
from batchserve.draft.reference import ReferenceDrafts
from batchserve.draft.trie import TrieDrafter
from batchserve.trees import DraftTree
from tests.draft.model_drafter import Model
from tests.draft.model_texts import LIB

SCALE = int(os.environ.get("BATCHSERVE_FUZZ_SCALE", "1"))
SEED = int(os.environ.get("BATCHSERVE_FUZZ_SEED", "79"))
FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))
NO_BYTE_BOUND = 1 << 40  # the byte quota's rules follow the allocator's capacities: tested elsewhere

TOKENS = st.lists(st.integers(0, 3) | st.integers(0, 3) | st.integers(0, 40), max_size=12)
PROMPTS = st.sampled_from([[1, 2, 3], [1, 2, 3, 1, 2], [4, 0, 4, 0], [7], []]) | TOKENS
IDS = st.sampled_from(["r0", "r1", "r2", "r3"])
SCOPES = st.sampled_from([None, "", "a", "b", "c"])
START = st.tuples(
    st.just("start"), IDS, PROMPTS, st.sampled_from([None, "hierarchical", "parallel", "single"]), SCOPES,
    st.lists(TOKENS, max_size=2) | st.just([]), st.just([]) | TOKENS,
)  # fmt: skip
OPS = st.one_of(  # hypothesis leans to the first: texts to draft from, then the rest
    st.tuples(st.just("accept"), IDS, TOKENS),
    st.tuples(st.just("echo"), IDS, st.integers(1, 30), st.integers(1, 12)),  # a slice of its own text again
    st.tuples(st.just("again"), IDS),  # it ends, and the same prompt comes again in its scope
    st.tuples(st.just("match"), IDS),
    st.tuples(st.just("finish"), IDS),
    st.tuples(st.sampled_from(["defer", "learn", "undefer"])),
    st.tuples(st.just("warm"), st.lists(TOKENS, max_size=2), st.sampled_from(["", "a", "b", "c"])),
    START,
)
# Requests running first; then calls, each followed by a proposal for a running request (by index).
STEPS = st.lists(st.tuples(OPS, st.integers(0, 3), st.integers(1, 40)), min_size=10, max_size=50)
CALLS = st.tuples(st.lists(START, min_size=1, max_size=4), STEPS)


def configs(layout: str, copy_chain: bool) -> st.SearchStrategy[DraftConfig]:
    def make(branch: int, own: int, match: tuple[int, int], weight: float, capacity: int, scopes: int, recent: int):
        return DraftConfig(
            method="lookahead", layout=layout, copy_chain=copy_chain, branch_length=branch, own_branch_length=own,
            max_match=max(match), min_match=min(match), prompt_weight=weight, trie_capacity=capacity,
            trie_max_scopes=scopes, recent_output_tokens=recent, trie_scope_bytes=NO_BYTE_BOUND,
        )  # fmt: skip

    return st.builds(
        make, st.integers(2, 6), st.integers(2, 10), st.tuples(st.integers(1, 5), st.integers(1, 5)),
        st.sampled_from([0.5, 1.0, 3.0, 100.0]), st.sampled_from([6, 25, 10**6]), st.integers(1, 3),
        st.sampled_from([0, 1, 3, 12, 60, 500]),
    )  # fmt: skip


class Pair:
    """The drafter and the model, driven alike; references mirrored through their own class."""

    def __init__(self, config: DraftConfig) -> None:
        self.config = config
        self.d, self.m = TrieDrafter(config), Model(config)
        self.refs = ReferenceDrafts(config.max_match, config.min_match)
        self.single: set[str] = set()
        self.started: dict[str, tuple[list[int], str | None]] = {}  # each id's last prompt and scope
        self.trees = 0  # non-empty trees compared

    def text(self, rid: str) -> list[int]:
        r = self.m.requests.get(rid)
        return list(r.local) if r is not None else [1, 2, 3]

    def then_propose(self, op: tuple[Any, ...], which: int, budget: int) -> Iterator[tuple[Any, ...]]:
        """`op`, then a proposal for the running request `which` picks once `op` has run."""
        yield op
        running = sorted(self.m.requests)
        yield ("propose", running[which % len(running)] if running else "r0", budget)

    def apply(self, op: tuple[Any, ...]) -> None:
        kind, args = op[0], op[1:]
        getattr(self, "op_" + kind)(*args)
        self.check_state()

    def op_start(self, rid: str, prompt: list[int], layout: str | None, scope: str | None, refs, resumed) -> None:
        self.d.on_request_start(rid, prompt, layout=layout, scope=scope, references=refs)
        self.d.on_tokens_resumed(rid, resumed)
        self.m.start(rid, prompt, scope, -1 if layout is None else LIB.LAYOUTS[layout])
        self.refs.finish(rid)
        self.refs.start(rid, refs)
        self.refs.accepted(rid, resumed)
        self.m.resume(rid, resumed)
        (self.single.add if (layout or self.config.layout) == "single" else self.single.discard)(rid)
        self.started[rid] = (prompt, scope)

    def op_accept(self, rid: str, tokens: list[int]) -> None:
        self.d.on_tokens_accepted(rid, tokens)
        self.refs.accepted(rid, tokens)
        self.m.accept(rid, tokens)

    def op_echo(self, rid: str, back: int, length: int) -> None:
        text = self.text(rid)
        self.op_accept(rid, text[max(0, len(text) - back) :][:length])

    def op_propose(self, rid: str, budget: int) -> None:
        text = self.text(rid)
        got = self.d.propose(rid, text, budget)
        found = self.m.propose(rid, text, budget)
        own = None if found is None else DraftTree(found[0], found[1], found[2], match=found[3])
        want = self.refs.ahead(rid, text, budget, own, single=rid in self.single) if text else None  # nothing to key on
        assert _fields(got) == _fields(want), (rid, text, budget)
        self.trees += got is not None

    def op_match(self, rid: str) -> None:
        text = self.text(rid)
        assert self.d.match_length(rid, text) == self.m.match_length(rid, text), (rid, text)

    def op_finish(self, rid: str) -> None:
        self.d.on_request_finish(rid)
        self.refs.finish(rid)
        self.single.discard(rid)
        self.m.finish(rid)

    def op_again(self, rid: str) -> None:
        if rid in self.started:
            self.op_finish(rid)
            prompt, scope = self.started[rid]
            self.op_start(rid, prompt, None, scope, [], [])

    def op_defer(self) -> None:
        self.d.defer_learning()
        self.m.set_deferred(True)

    def op_learn(self) -> None:
        self.d.learn()
        self.m.flush()

    def op_undefer(self) -> None:
        self.d._native.set_deferred(False)  # the native call beneath (TrieDrafter never turns it off)
        self.m.set_deferred(False)

    def op_warm(self, seqs: list[list[int]], scope: str) -> None:
        assert self.d.warm_up(seqs, scope=scope) == len(seqs)
        for seq in seqs:
            self.m.warm(scope, seq)

    def check_state(self) -> None:
        stats = self.d.stats()
        assert stats == self.m.stats()
        for scope in {"", "a", "b", "c"}:
            trie = self.m.tries.get(scope)
            counts = self.d.trie_counts(scope)
            assert (None if counts is None else list(counts.items())) == (None if trie is None else trie.counts())
            kept = self.m.recent.scopes.get(scope)
            assert self.d.recent_text(scope) == (None if kept is None else kept.text), scope


def _fields(tree: DraftTree | None) -> tuple[Any, ...] | None:
    return None if tree is None else (tree.tokens, tree.parents, tree.scores, tree.match, tree.referenced)


SOURCES = {"own text", "output trie"}  # what any layout's trees drew on
COPY_SOURCES = {"copy chain", "recent outputs"}


@pytest.mark.parametrize("copy_chain", [True, False], ids=["copy-chain", "counts-only"])
@pytest.mark.parametrize("layout", ["hierarchical", "parallel", "single"])
def test_every_proposal_equals_the_models(layout: str, copy_chain: bool) -> None:
    seen: set[str] = set()
    counts = {"trees": 0, "repeats": 0, "layouts": set()}

    @seed(SEED)
    @settings(FUZZ, max_examples=200 * SCALE)
    @given(config=configs(layout, copy_chain), calls=CALLS)
    def run(config: DraftConfig, calls: tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]) -> None:
        pair = Pair(config)
        starts, steps = calls
        for op in itertools.chain(starts, (step for call in steps for step in pair.then_propose(*call))):
            pair.apply(op)
            if op[0] == "start":
                counts["layouts"].add(op[3] or layout)
        for rid in list(pair.m.requests):
            pair.op_finish(rid)
            pair.check_state()
        seen.update(pair.m.sources)
        counts["trees"] += pair.trees
        counts["repeats"] += pair.m.recent.repeats

    run()
    assert counts["trees"] > 500 and counts["layouts"] == {"hierarchical", "parallel", "single"}
    assert SOURCES <= seen, seen
    if copy_chain:
        assert COPY_SOURCES <= seen and counts["repeats"] > 0, (seen, counts)


def test_the_model_sees_what_it_checks() -> None:
    """A hand-made case of each source, so that a model that found nothing could not pass."""
    config = DraftConfig(method="lookahead", branch_length=4, own_branch_length=8, trie_scope_bytes=NO_BYTE_BOUND)
    pair = Pair(dataclasses.replace(config, recent_output_tokens=100))
    ops = [
        ("start", "r0", [1, 2, 3], None, "a", [], []),
        ("accept", "r0", [5, 6, 7, 8, 5, 6]),
        ("finish", "r0"),
        ("start", "r1", [1, 2, 3], "parallel", "a", [[9, 9, 9]], []),  # a repeat of r0's prompt
        ("propose", "r1", 12),
        ("accept", "r1", [5, 6]),
        ("propose", "r1", 12),
        ("match", "r1"),
    ]
    for op in ops:
        pair.apply(op)
    assert pair.trees == 2 and pair.m.recent.repeats == 2 and {"recent outputs", "output trie"} <= pair.m.sources
