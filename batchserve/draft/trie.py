"""The Lookahead trie drafter: n-grams of prompts and outputs, retrieved as draft trees.

The state and the retrieval live in native code (`csrc/`, built by `native.py`); this class is
the drafter interface over it, plus the request's references. What it keeps:
- one *output trie per scope*, shared by the requests of that scope: n-grams of their
  generated text (and of a warm-up corpus), inserted as tokens are accepted; frequencies
  decay and rare nodes are pruned when the scope outgrows its bounds. A scope is a tenant key
  (or "" for everyone); a request with no scope reads and writes none, so one tenant's output
  can never become another tenant's draft;
- one *indexed text* per running request: its own prompt and output as one array with, per
  token, the positions it occurs at (extended per token), searched when drafting as if it were
  a trie of all their runs of up to `own_branch_length` tokens, weighted far above the global
  counts (branch weighting) and dropped whole when the request ends (branch elimination), so a
  finished request leaves no trace of its prompt. A lookup costs the occurrences of the key's
  last token, not the text's length;
- per scope, its *recent outputs* (never a prompt), at most `recent_output_tokens` per scope.

A resumed request's earlier output (`resume_token_ids`: whatever a client sends) is its own text
and nothing more (`on_tokens_resumed`): no scope's trie or recent outputs learn it, nor n-grams
that reach into it, so no client can plant text in a scope others draft from.

A node's count in an output trie is the number of times its path (from the root) occurred as a
run of consecutive tokens, for paths up to `branch_length` tokens. Counts never grow along a
path, so pruning a node prunes a subtree of nodes at least as rare. Each scope is bounded on its
own, so no tenant's traffic ever trims another's state: over `trie_capacity` nodes, or
`trie_scope_bytes` bytes of trie and recent outputs, a scope decays its own trie (and its arrays
are rebuilt to size, so the memory goes back) or drops its own oldest outputs. Only the count of
scopes is shared: at most `trie_max_scopes`, counted 2Q's way. A new scope is on probation,
and the scopes on probation share a quarter of the count: past it, the least recently used idle
one of them goes. A scope is proven when a request that started after it was made ends (its
tenant came back; a corpus warm-up proves it at once); the proven hold the rest, and past that
the least recently used idle proven scope goes. So a flood of one-off tenants (fresh keys, one
request each) evicts only its own kind, never a tenant that came back, and the drafter holds at
most `trie_max_scopes` x `trie_scope_bytes`. Two requests per fresh key prove a scope, though:
where clients choose their keys (no API keys), about 3/4 x `trie_max_scopes` x 2 requests under
fresh strings evict an idle proven tenant's scope. With API keys the scopes are at most the keys.

A tree is built from, in order: a *copy chain* (what followed the most recent occurrence of
the longest run the request's text ends with, in its own text or its scope's recent outputs,
when long enough to be a copy; a request whose prompt repeats an earlier one of its scope
copies that output while it agrees), then the longest suffix match (up to `max_match` tokens)
expanded best first (`hierarchical`), as disjoint chains (`parallel`) or as one chain
(`single`), shorter matches filling what is left. A request's references (a client's predicted
output, `reference.py`) draft ahead of all of these and are never inserted into any trie.

Insertion can wait: under an engine (`defer_learning`), what accepted tokens teach the output
trie is applied by `learn()`, which the engine calls while the next forward runs; proposals then
see the scope's n-grams one step late (their own text never waits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from batchserve.config import DraftConfig
from batchserve.draft.native import library
from batchserve.draft.reference import ReferenceDrafts
from batchserve.draft.warmup import read_corpus
from batchserve.draft_config import DRAFT_LAYOUTS
from batchserve.trees import MATCH_CAP, DraftTree

# The native layout codes: a layout's index in DRAFT_LAYOUTS (the native module's own list is
# checked against it when it loads).
LAYOUTS = {name: code for code, name in enumerate(DRAFT_LAYOUTS)}


class TrieDrafter:
    """Lookahead drafts for many concurrent requests (see the module docstring)."""

    def __init__(self, config: DraftConfig | None = None) -> None:
        self.config = config = config or DraftConfig(method="lookahead")
        self._native: Any = library().Drafter(
            config.branch_length, config.own_branch_length, config.max_match, config.min_match,
            config.prompt_weight, config.trie_capacity, config.trie_scope_bytes, config.trie_max_scopes,
            config.recent_output_tokens, config.copy_chain, LAYOUTS[config.layout],
        )  # fmt: skip
        self.references = ReferenceDrafts(config.max_match, config.min_match)  # per request, never in a trie
        self._single: set[str] = set()  # requests drafting one branch (their references' included)
        # The text's last tokens a proposal reads: the copy chain's longest match, the trie's depth.
        self._key = max(MATCH_CAP, config.branch_length, config.max_match)

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
        self.references.finish(request_id)  # a restarted id starts clean (the native side does so itself)
        self._native.start(request_id, prompt_token_ids, scope, LAYOUTS[layout] if layout else -1)
        self.references.start(request_id, references)
        if (layout or self.config.layout) == "single":
            self._single.add(request_id)
        else:
            self._single.discard(request_id)

    def on_tokens_resumed(self, request_id: str, token_ids: Sequence[int]) -> None:
        """A resumed request's output so far (before any accepted token): its references move
        along it and its own text holds it; no scope learns it (see the module docstring)."""
        self.references.accepted(request_id, token_ids)
        if token_ids:
            self._native.resume(request_id, token_ids)

    def on_tokens_accepted(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.references.accepted(request_id, token_ids)
        if token_ids:
            self._native.accept(request_id, token_ids)

    def on_request_finish(self, request_id: str) -> None:
        self.references.finish(request_id)
        self._single.discard(request_id)
        self._native.finish(request_id)

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> DraftTree | None:
        """A tree continuing the request's text (`token_ids`: its prompt and accepted output)."""
        if max_tokens < 1 or not len(token_ids):
            return None
        found = self._native.propose(request_id, token_ids[-self._key :], len(token_ids), max_tokens)
        tree = None if found is None else DraftTree(found[0], found[1], found[2], match=found[3])
        return self.references.ahead(request_id, token_ids, max_tokens, tree, single=request_id in self._single)

    def match_length(self, request_id: str, token_ids: Sequence[int]) -> int:
        """The longest suffix of `token_ids` seen before with a token after it: in the request's
        own prompt and output (up to MATCH_CAP) or its scope's outputs (up to the trie's depth)."""
        return self._native.match_length(request_id, token_ids[-self._key :]) if len(token_ids) else 0

    # ---- deferred learning (the engine's) ------------------------------------------------

    def defer_learning(self) -> None:
        """From now on accepted tokens reach the output tries at `learn()` (or when their request ends)."""
        self._native.set_deferred(True)

    def learn(self) -> None:
        """Insert the accepted tokens `defer_learning` held back (the GIL released meanwhile)."""
        self._native.flush()

    # ---- warm-up -------------------------------------------------------------------------

    def warm_up(self, sequences: Iterable[Sequence[int]], scope: str = "") -> int:
        """Load earlier outputs into a scope's output trie; returns how many sequences."""
        n = 0
        for seq in sequences:
            self._native.warm(scope, seq, 0, len(seq))
            n += 1
        return n

    def warm_up_slices(
        self, sequences: Sequence[Sequence[int]], scope: str = "", slice_tokens: int = 128
    ) -> Iterator[None]:
        """`warm_up` a slice of at most `slice_tokens` run starts at a time, yielding after each,
        so that a caller on the event loop can serve others between slices."""
        reach = self.config.branch_length - 1  # the tokens past a slice's last start its runs read
        for seq in sequences:
            for first in range(0, len(seq), slice_tokens):
                part = seq[first : first + slice_tokens + reach]
                self._native.warm(scope, part, 0, min(slice_tokens, len(part)))
                yield

    def warm_up_file(
        self, path: str | Path, tokenize: Callable[[str], list[int]] | None = None, scope: str = ""
    ) -> int:
        """JSONL, one object per line with `token_ids` (list of ints) or `text` (needs `tokenize`)."""
        return self.warm_up(read_corpus(path, tokenize), scope)

    # ---- introspection -------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """nodes, indexed_tokens, requests, pending (requests with deferred tokens), recent_tokens,
        scopes and recent_scopes (least recently used first)."""
        stats: dict[str, Any] = self._native.stats()
        return stats

    def trie_counts(self, scope: str = "") -> dict[tuple[int, ...], float] | None:
        """Every path of `scope`'s output trie with its count (None: the scope has none)."""
        counts: dict[tuple[int, ...], float] | None = self._native.trie(scope)
        return counts

    def recent_text(self, scope: str = "") -> list[int] | None:
        """`scope`'s recent outputs as one list, -1 between two (None: it keeps none)."""
        text: list[int] | None = self._native.recent_text(scope)
        return text

    def scope_bytes(self, scope: str = "") -> int | None:
        """About the bytes `scope` holds, what `trie_scope_bytes` bounds: its output trie and
        recent outputs (None: it holds neither)."""
        size: int | None = self._native.scope_bytes(scope)
        return size

    def memory_bytes(self) -> int:
        """About the memory the native state holds (output tries, running texts, recent outputs)."""
        return int(self._native.memory())

    @property
    def num_nodes(self) -> int:
        """Nodes in every output trie."""
        return int(self._native.stats()["nodes"])

    @property
    def num_indexed_tokens(self) -> int:
        """Tokens in the running requests' own texts (prompt and output)."""
        return int(self._native.stats()["indexed_tokens"])
