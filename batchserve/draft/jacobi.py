"""Jacobi lookahead (Lookahead Decoding, Fu et al. 2024) as a drafter, alone or with the trie.

Each request keeps a *window*: N-1 levels of W guessed future tokens, each level one Jacobi
iteration further than the one before. Every step the window's rows run through the model
beside the request's draft tree, under a mask that lets row (level i, column j) see the
committed text, level 0 up to column j and column j of levels 1..i. That is a causal chain
of consecutive positions, so the row's argmax is the model's guess for the next position of
that chain. The last level's guesses become the newest level; the oldest level drops out.

Read down a column, the levels and the new guess form an n-gram: a trajectory the model
considers plausible. N-grams go into a pool keyed by their first token. The pool's n-grams
that start with the request's last token are this step's *verification candidates*, merged
by token path into an ordinary `DraftTree`, so verification (and with it losslessness) is
the same as for every other drafter. The window's rows are computed, never verified, and
their K/V is scratch (never committed, never compacted).

Pools follow the trie's isolation: a scope shares one pool; a request without a scope (or
under `trie_scope=request`) has its own, dropped when it finishes. Pure Python and numpy.
"""

from __future__ import annotations

import random
import zlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from batchserve.config import DraftConfig
from batchserve.draft.reference import ReferenceDrafts
from batchserve.draft.trie import TrieDrafter
from batchserve.trees import DraftTree, TreeBuilder, WindowRows, merge_trees, window_rows


@dataclass(frozen=True, slots=True)
class JacobiShape:
    """(W, N, G): window width, n-gram length (the window keeps N-1 levels), candidates per step."""

    window: int
    ngram: int
    guesses: int

    def __post_init__(self) -> None:
        if self.window < 1 or self.ngram < 2 or self.guesses < 0:
            raise ValueError(f"need window >= 1, ngram >= 2, guesses >= 0; got {self.window, self.ngram, self.guesses}")

    def asked(self, asked: Sequence[int | None] | None) -> JacobiShape:
        """The shape a request asks for, each value at most this one's (None: this one's)."""
        if asked is None:
            return self
        mine = (self.window, self.ngram, self.guesses)
        return JacobiShape(*(m if a is None else min(a, m) for a, m in zip(asked, mine)))


class NgramPool:
    """N-grams by (scope, first token), most recent first, at most `capacity` in all.

    When the pool is full, the scope holding the most n-grams gives up its least recently
    produced one: a scope that floods the pool evicts its own n-grams, never those of a scope
    that holds fewer. Scopes not `proven` (no request of theirs that started once they held
    n-grams has ended: one-off tenants) give up theirs first, so a flood of fresh keys, each
    small, evicts only its own kind, never a tenant that came back. Each first token keeps at
    most `per_key` continuations.
    """

    def __init__(self, capacity: int, per_key: int) -> None:
        self.capacity = capacity
        self.per_key = per_key
        self._lists: dict[tuple[Hashable, int], OrderedDict[tuple[int, ...], int]] = {}  # -> {rest: times seen}
        self._lru: dict[
            Hashable, OrderedDict[tuple[int, tuple[int, ...]], None]
        ] = {}  # scope -> its n-grams, oldest first
        self._size = 0
        self.proven: set[Hashable] = set()  # scopes holding n-grams that a returning request proved

    def __len__(self) -> int:
        return self._size

    def add(self, scope: Hashable, ngram: Sequence[int]) -> None:
        first, rest = ngram[0], tuple(ngram[1:])
        entries = self._lists.setdefault((scope, first), OrderedDict())
        entries[rest] = entries.pop(rest, 0) + 1  # now the most recent
        lru = self._lru.setdefault(scope, OrderedDict())
        if (first, rest) in lru:
            lru.move_to_end((first, rest))
        else:
            lru[(first, rest)] = None
            self._size += 1
        if len(entries) > self.per_key:
            self._remove(scope, first, next(iter(entries)))
        while self._size > self.capacity:
            unproven = [s for s in self._lru if s not in self.proven]
            largest = max(unproven or self._lru, key=lambda s: len(self._lru[s]))
            self._remove(largest, *next(iter(self._lru[largest])))

    def holds(self, scope: Hashable) -> bool:
        return scope in self._lru

    def prove(self, scope: Hashable) -> None:
        """A request of `scope` that started while it held n-grams ended: it came back."""
        if scope in self._lru:
            self.proven.add(scope)

    def candidates(self, scope: Hashable, first: int, limit: int) -> list[tuple[tuple[int, ...], int]]:
        """Up to `limit` (continuation, times seen) after `first`, most recent first."""
        entries = self._lists.get((scope, first))
        if not entries or limit < 1:
            return []
        out = []
        for rest in reversed(entries):
            out.append((rest, entries[rest]))
            if len(out) == limit:
                break
        return out

    def drop_scope(self, scope: Hashable) -> None:
        for first, rest in list(self._lru.get(scope, ())):
            self._remove(scope, first, rest)

    def _remove(self, scope: Hashable, first: int, rest: tuple[int, ...]) -> None:
        lru = self._lru.get(scope)
        if lru is None or (first, rest) not in lru:
            return
        del lru[(first, rest)]
        self._size -= 1
        if not lru:
            del self._lru[scope]
            self.proven.discard(scope)  # bounded by the scopes holding n-grams
        entries = self._lists[(scope, first)]
        entries.pop(rest, None)
        if not entries:
            del self._lists[(scope, first)]


@dataclass(slots=True)
class _Window:
    shape: JacobiShape
    pool_scope: Hashable
    proves: bool = False  # its scope held n-grams when it started: its ending proves the scope
    levels: list[list[int]] = field(default_factory=list)  # oldest first; grows to N-1 levels


def _seeded_guesses(prompt: Sequence[int], n: int) -> list[int]:
    """`n` tokens drawn from the prompt, the same for the same prompt (as the paper starts)."""
    rng = random.Random(zlib.crc32(np.asarray(prompt, np.int64).tobytes()))
    return [prompt[rng.randrange(len(prompt))] for _ in range(n)] if prompt else [0] * n


def _count_prob(count: int) -> float:
    """How sure a pooled n-gram's token is, from how often the window produced it: 1/2, 2/3, ..."""
    return count / (count + 1)


class JacobiDrafter:
    """Verification candidates from the n-gram pool; a Jacobi window per request to fill it."""

    def __init__(self, config: DraftConfig | None = None) -> None:
        config = config or DraftConfig(method="jacobi")
        self.shape = JacobiShape(config.window_size, config.ngram_size, config.guesses)
        self.pool = NgramPool(config.pool_capacity, per_key=max(1, 2 * config.guesses))
        self._windows: dict[str, _Window] = {}
        self.references = ReferenceDrafts(config.max_match, config.min_match)  # per request, never pooled

    # ---- Drafter interface ---------------------------------------------------------------

    def on_request_start(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        layout: str | None = None,
        scope: str | None = "",
        window: tuple[int | None, int | None, int | None] | None = None,
        references: Sequence[Sequence[int]] = (),
    ) -> None:
        shape = self.shape.asked(window)
        self.references.start(request_id, references)
        pool_scope: Hashable = ("scope", scope) if scope is not None else ("request", request_id)
        state = _Window(shape, pool_scope, proves=self.pool.holds(pool_scope))
        state.levels.append(_seeded_guesses(prompt_token_ids, shape.window))
        self._windows[request_id] = state

    def on_tokens_accepted(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.references.accepted(request_id, token_ids)  # the pool learns from the window's outputs

    def on_request_finish(self, request_id: str) -> None:
        self.references.finish(request_id)
        state = self._windows.pop(request_id, None)
        if state is not None and state.pool_scope == ("request", request_id):
            self.pool.drop_scope(state.pool_scope)
        elif state is not None and state.proves:
            self.pool.prove(state.pool_scope)

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> DraftTree | None:
        state = self._windows.get(request_id)
        if state is None or not token_ids or max_tokens < 1:
            return None
        builder = TreeBuilder(max_tokens)
        for rest, count in self.pool.candidates(state.pool_scope, token_ids[-1], state.shape.guesses):
            _add_path(builder, rest, _count_prob(count))
            if builder.full:
                break
        tree = builder.tree()
        pooled = None if tree is None else tree.with_pooled(range(len(tree)))
        return self.references.ahead(request_id, token_ids, max_tokens, pooled)

    # ---- the window ----------------------------------------------------------------------

    def window(self, request_id: str, max_rows: int) -> WindowRows | None:
        """This step's window rows for the request, or None if they do not fit `max_rows`."""
        state = self._windows.get(request_id)
        if state is None:
            return None
        rows = window_rows(state.levels)
        return rows if len(rows) <= max_rows else None

    def on_window_outputs(self, request_id: str, rows: WindowRows, outputs: Sequence[int]) -> None:
        """The model's next token after each of the last level's rows: pool the n-grams read
        down each column, then slide the window one level on."""
        state = self._windows.get(request_id)
        if (
            state is None
            or len(outputs) != state.shape.window
            or rows.tokens[-len(outputs) :] != tuple(state.levels[-1])
        ):
            return  # not this window (the request restarted): nothing to learn
        levels = state.levels
        if len(levels) == state.shape.ngram - 1:
            for j, out in enumerate(outputs):
                self.pool.add(state.pool_scope, [*(level[j] for level in levels), out])
            del levels[0]
        levels.append(list(outputs))


class HybridDrafter(TrieDrafter):
    """The trie's tree and the pool's candidates merged into one tree by token path: the trie's
    nodes first (best first), the pool's fill what the trie leaves. A `TrieDrafter` in every
    other respect (warm-up, scopes, capacity)."""

    def __init__(self, config: DraftConfig | None = None) -> None:
        config = config or DraftConfig(method="hybrid")
        super().__init__(config)
        self.jacobi = JacobiDrafter(config)

    def on_request_start(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        layout: str | None = None,
        scope: str | None = "",
        window: tuple[int | None, int | None, int | None] | None = None,
        references: Sequence[Sequence[int]] = (),
    ) -> None:
        # The trie's side drafts the references (ahead of both); the pool's gets none.
        super().on_request_start(request_id, prompt_token_ids, layout, scope, references=references)
        self.jacobi.on_request_start(request_id, prompt_token_ids, layout, scope, window)

    def on_request_finish(self, request_id: str) -> None:
        super().on_request_finish(request_id)
        self.jacobi.on_request_finish(request_id)

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> DraftTree | None:
        trie = super().propose(request_id, token_ids, max_tokens)
        return merge_trees(trie, self.jacobi.propose(request_id, token_ids, max_tokens), max_tokens)

    def window(self, request_id: str, max_rows: int) -> WindowRows | None:
        return self.jacobi.window(request_id, max_rows)

    def on_window_outputs(self, request_id: str, rows: WindowRows, outputs: Sequence[int]) -> None:
        self.jacobi.on_window_outputs(request_id, rows, outputs)


def _add_path(builder: TreeBuilder, tokens: Sequence[int], prob: float) -> None:
    """Add a chain from the root, merging with what is there, while the builder has room."""
    parent: int | None = None
    for tok in tokens:
        if builder.full and (parent, tok) not in builder.index:
            break
        parent = builder.add(parent, tok, prob)
