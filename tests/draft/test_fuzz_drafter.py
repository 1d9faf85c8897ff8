"""Fuzzing the drafter's public API with hypothesis (issue 79): any sequence of the calls the
engine makes (requests starting with any ids, scopes, layouts and references; tokens accepted;
proposals; deferred learning; warm-ups; introspection), with token ids anywhere in [0, 2**31),
keeps the drafter's accounting and its trees well formed; the native module's calls, with any
arguments at all, raise TypeError, ValueError, OverflowError or RuntimeError (a C++ exception
turned into a Python one), and never crash the process.

A fixed seed and a few hundred examples here (part of `make test`); `make fuzz` runs more with the
seed it is given (README.md, "Fuzzing")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from batchserve.config import DraftConfig
from batchserve.draft.trie import TrieDrafter

SCALE = int(os.environ.get("BATCHSERVE_FUZZ_SCALE", "1"))  # make fuzz: 25
SEED = int(os.environ.get("BATCHSERVE_FUZZ_SEED", "79"))
FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))
ROOT = Path(__file__).resolve().parents[2]

# Small capacities, so that a few calls already decay, prune and evict scopes (and each scope's
# byte bound, where the drafter has one, at its least).
BYTES = {"trie_scope_bytes": 4096} if "trie_scope_bytes" in DraftConfig.__dataclass_fields__ else {}
CONFIG = DraftConfig(
    method="lookahead", branch_length=4, own_branch_length=6, trie_capacity=48, trie_max_scopes=3,
    recent_output_tokens=40, **BYTES,
)  # fmt: skip
# Mostly a few ids (so that n-grams repeat and trees grow), sometimes anywhere in the range.
TOKEN = st.integers(0, 5) | st.integers(0, 2**31 - 1)
TOKENS = st.lists(TOKEN, max_size=24)
IDS = st.sampled_from(["r0", "r1", "r2", "", "é", "r\x00x"])
SCOPES = st.sampled_from([None, "", "t1", "t2", "t3", "t4", "\U0001f600"])
LAYOUTS = st.sampled_from([None, "hierarchical", "parallel", "single"])
OPS = st.one_of(
    st.tuples(st.just("start"), IDS, TOKENS, LAYOUTS, SCOPES, st.lists(TOKENS, max_size=3), TOKENS),
    st.tuples(st.just("accept"), IDS, TOKENS),
    st.tuples(st.just("propose"), IDS, st.integers(-2, 40)),
    st.tuples(st.just("finish"), IDS),
    st.tuples(st.just("defer")),
    st.tuples(st.just("learn")),
    st.tuples(st.just("warm"), st.lists(TOKENS, max_size=3), SCOPES.filter(lambda s: s is not None)),
    st.tuples(st.just("inspect"), SCOPES.filter(lambda s: s is not None)),
)


def _check_tree(tree: Any, max_tokens: int) -> None:
    if tree is None:
        return
    assert len(tree.tokens) <= max_tokens, (len(tree.tokens), max_tokens)
    assert all(0 <= t < 2**31 for t in tree.tokens)
    assert all(p is None or 0 <= p < i for i, p in enumerate(tree.parents))  # DraftTree checks the rest


def _apply(d: TrieDrafter, texts: dict[str, list[int]], scopes: dict[str, str | None], op: tuple[Any, ...]) -> None:
    """One call, mirrored in `texts` (each running request's prompt and accepted output) and
    `scopes` (its scope)."""
    kind, args = op[0], op[1:]
    if kind == "start":
        rid, prompt, layout, scope, refs, resumed = args
        d.on_request_start(rid, prompt, layout=layout, scope=scope, references=refs)
        texts[rid], scopes[rid] = list(prompt), scope
        if hasattr(d, "on_tokens_resumed"):  # a resumed request: its earlier output, before any accepted
            d.on_tokens_resumed(rid, resumed)
            texts[rid] += resumed
    elif kind == "accept":
        rid, tokens = args
        d.on_tokens_accepted(rid, tokens)
        if rid in texts:
            texts[rid] += tokens
    elif kind == "propose":
        rid, max_tokens = args
        text = texts.get(rid, [1, 2, 3, 1, 2])
        _check_tree(d.propose(rid, text, max_tokens), max_tokens)
        assert 0 <= d.match_length(rid, text) <= len(text)
    elif kind == "finish":
        d.on_request_finish(args[0])
        texts.pop(args[0], None)
        scopes.pop(args[0], None)
    elif kind == "defer":
        d.defer_learning()
    elif kind == "learn":
        d.learn()
    elif kind == "warm":
        assert d.warm_up(args[0], scope=args[1]) == len(args[0])
    else:
        counts, recent = d.trie_counts(args[0]), d.recent_text(args[0])
        assert counts is None or all(c >= 0 and len(path) <= CONFIG.branch_length for path, c in counts.items())
        assert recent is None or all(t >= -1 for t in recent)
        size = d.scope_bytes(args[0]) if hasattr(d, "scope_bytes") else None
        assert size is None or 0 <= size


def _check_accounting(d: TrieDrafter, texts: dict[str, list[int]], scopes: dict[str, str | None]) -> None:
    stats = d.stats()
    assert stats["requests"] == len(texts)
    assert stats["indexed_tokens"] == sum(map(len, texts.values()))  # every running text, nothing more
    assert stats["nodes"] >= 0 and stats["recent_tokens"] >= 0 and d.memory_bytes() >= 0
    # Idle scopes go first; live ones (and the one being written) stay even past the cap.
    live = {s for s in scopes.values() if s is not None}
    assert len(stats["scopes"]) <= max(CONFIG.trie_max_scopes, len(live) + 1), (stats["scopes"], live)


@seed(SEED)
@settings(FUZZ, max_examples=200 * SCALE)
@given(ops=st.lists(OPS, max_size=40))
def test_any_sequence_of_calls_keeps_the_drafters_accounting(ops: list[tuple[Any, ...]]) -> None:
    d = TrieDrafter(CONFIG)
    texts: dict[str, list[int]] = {}
    scopes: dict[str, str | None] = {}
    for op in ops:
        _apply(d, texts, scopes, op)
        _check_accounting(d, texts, scopes)
    for rid in list(texts):
        d.on_request_finish(rid)
    d.learn()
    stats = d.stats()
    # A finished request leaves no trace of its own text; nothing waits to be learned.
    assert (stats["requests"], stats["indexed_tokens"], stats["pending"]) == (0, 0, 0)


@seed(SEED)
@settings(FUZZ, max_examples=100 * SCALE)
@given(
    rid=IDS,
    bad=st.one_of(
        st.lists(st.integers(-(2**70), -1) | st.integers(2**31, 2**70), min_size=1, max_size=3),
        st.lists(st.floats() | st.text(max_size=2) | st.none(), min_size=1, max_size=3),
    ),
)
def test_token_ids_outside_the_range_are_refused_and_change_nothing(rid: str, bad: list[Any]) -> None:
    d = TrieDrafter(CONFIG)
    d.on_request_start("known", [1, 2, 3], scope="t1")
    before = d.stats()
    for call in (
        lambda: d.on_request_start(rid, bad, scope="t1"),
        lambda: d.on_tokens_accepted("known", bad),
        lambda: d.warm_up([bad], scope="t2"),
        lambda: d.match_length("known", bad),
    ):
        try:
            call()
        except (TypeError, ValueError, OverflowError):
            pass
        else:
            raise AssertionError(f"{bad!r} was taken as token ids")
    assert d.stats() == before


# Arguments of any type and size for the native methods (the module behind TrieDrafter).
ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(-3, 2**31 + 3) | st.integers(0, 6), max_size=12),
    st.tuples(st.integers(0, 6), st.integers(0, 6)),
)
# Not fail_next: a test hook that makes the next insertion throw on purpose.
NATIVE = ["start", "resume", "accept", "finish", "flush", "set_deferred", "propose", "match_length", "warm", "stats"]
NATIVE_CALLS = st.lists(
    st.tuples(st.sampled_from([*NATIVE, "memory", "scope_bytes", "trie", "recent_text"]), st.lists(ANY, max_size=5)),
    max_size=30,
)


# Well-formed calls that build state for the others to meet (proposals with any total and budget).
GOOD_CALLS = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.tuples(IDS, TOKENS, SCOPES, st.integers(-1, 2)).map(list)),
        st.tuples(st.sampled_from(["accept", "resume"]), st.tuples(IDS, TOKENS).map(list)),
        st.tuples(st.just("propose"), st.tuples(IDS, TOKENS, st.integers(-2, 60), st.integers(-2, 60)).map(list)),
        st.tuples(st.just("warm"), st.tuples(SCOPES, TOKENS, st.integers(-2, 30), st.integers(-2, 30)).map(list)),
    ),
    max_size=12,
)


def native_fuzz(examples: int, seed_: int) -> None:
    """Every native method with any arguments, among well-formed calls; run in a child process,
    so that a crash is a failed test with its stack (faulthandler), not a dead test run."""

    @seed(seed_)
    @settings(FUZZ, max_examples=examples)
    @given(calls=st.lists(NATIVE_CALLS | GOOD_CALLS, max_size=4))
    def run(calls: list[list[tuple[str, list[Any]]]]) -> None:
        native = TrieDrafter(CONFIG)._native
        for name, args in (c for batch in calls for c in batch if hasattr(native, c[0])):
            try:
                getattr(native, name)(*args)
            except (TypeError, ValueError, OverflowError, RuntimeError):  # RuntimeError: a C++ exception, caught
                pass

    run()


def test_the_native_module_takes_any_arguments_without_crashing() -> None:
    code = f"from tests.draft.test_fuzz_drafter import native_fuzz; native_fuzz({400 * SCALE}, {SEED})"
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    child = [sys.executable, "-c", code]
    done = subprocess.run(child, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120 + 20 * SCALE)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
