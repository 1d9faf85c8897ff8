"""The Lookahead trie drafter: n-grams of prompts and outputs, retrieved as draft trees.

Two kinds of trie, one node type:
- one *output trie per scope*, shared by the requests of that scope: n-grams of their
  generated text (and of a warm-up corpus), inserted as tokens are accepted; frequencies
  decay and rare nodes are pruned when the tries together outgrow their capacity. A scope
  is a tenant key (or "" for everyone); a request with no scope reads and writes none, so
  one tenant's output can never become another tenant's draft;
- one *token index* per running request: its own prompt and output as one array, searched
  when drafting as if it were a trie of all their runs of up to `own_branch_length` tokens
  (a depth of its own: it costs an array nothing to index), weighted far above the global
  counts (branch weighting) and dropped whole when the request ends (branch elimination), so
  a finished request leaves no trace of its prompt. An array instead of dict nodes: an
  8k-token prompt costs 64 KiB and well under a millisecond to index, not 27 MiB and 0.4 s,
  and it is built when the request is admitted to run, never while it only waits.

Before the counts, a *copy chain*: what followed the most recent occurrence of the longest run
that the request's text ends with, in its own text (a code edit's source, a quoted passage) or in
its scope's recent outputs (a repeated answer, `recent.py`), when long enough to be a copy.

A request's references (a client's predicted output, `reference.py`) draft ahead of all of
these, and stay the request's own: they are never inserted into any trie.

A node's count is the number of times its path (from the root) occurred as a run of
consecutive tokens, for paths up to `branch_length` tokens. Counts never grow along a
path, so pruning a node prunes a subtree of nodes at least as rare.

Scopes are bounded: at most `trie_max_scopes` output tries, least recently used first out,
and a running node total (no sum over scopes per token). Over `trie_capacity`, idle scopes
(no running request) go whole, least recently used first, before any live scope is decayed,
so many one-off tenants never cost a busy tenant its n-grams.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from batchserve.config import DraftConfig
from batchserve.draft.counted_trie import Trie, TrieNode
from batchserve.draft.recent import RecentOutputs, copy_chain
from batchserve.draft.reference import ReferenceDrafts
from batchserve.draft.token_index import IndexNode, TokenIndex
from batchserve.draft.tree import MATCH_CAP, DraftTree, TreeBuilder
from batchserve.draft.warmup import read_corpus


@dataclass(slots=True)
class _RequestState:
    local: TokenIndex  # this request's prompt + accepted output
    num_prompt: int
    layout: str | None = None  # per-request layout override
    scope: str | None = ""  # the output trie it reads and feeds; None: its own n-grams only
    # The output trie's nodes of the runs of its output that end at its last token (longest
    # first, each shorter than branch_length): a new token extends each by one node. Valid for
    # `runs_of` as it stood at `runs_epoch` prunes.
    runs: list[TrieNode] = field(default_factory=list)
    runs_of: Trie | None = None
    runs_epoch: int = 0


# A position in the merged view of a request's token index and its scope's output trie.
_Node = TrieNode | IndexNode
_Pair = tuple[_Node | None, TrieNode | None]


class TrieDrafter:
    """Lookahead drafts for many concurrent requests (see the module docstring)."""

    def __init__(self, config: DraftConfig | None = None) -> None:
        self.config = config = config or DraftConfig(method="lookahead")
        self.outputs: OrderedDict[str, Trie] = OrderedDict()  # output trie per scope, least recently used first
        self.num_output_nodes = 0  # nodes in all output tries, kept as they change (never summed)
        self._live: Counter[str] = Counter()  # running requests per scope
        self._requests: dict[str, _RequestState] = {}
        self.references = ReferenceDrafts(config.max_match, config.min_match)  # per request, never in a trie
        self.recent = RecentOutputs(config.recent_output_tokens, config.own_branch_length)  # copy sources
        self._tiebreak = itertools.count()

    @property
    def output(self) -> Trie:
        """The output trie of the shared scope "" (every request's under `trie_scope=global`)."""
        return self._output("")

    def _output(self, scope: str) -> Trie:
        """`scope`'s output trie, created if needed, and marked as the most recently used."""
        trie = self.outputs.get(scope)
        if trie is None:
            trie = self.outputs[scope] = Trie()
            if len(self.outputs) > self.config.trie_max_scopes:
                self._evict_idle(keep=scope)
        else:
            self.outputs.move_to_end(scope)
        return trie

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
        self.on_request_finish(request_id)  # a restarted id starts clean
        index = TokenIndex(prompt_token_ids, self.config.own_branch_length)
        self._requests[request_id] = _RequestState(index, len(prompt_token_ids), layout, scope)
        self.references.start(request_id, references)
        self.recent.begin(request_id, scope, prompt_token_ids)
        if scope is not None:
            self._live[scope] += 1

    def on_tokens_accepted(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.references.accepted(request_id, token_ids)
        state = self._requests.get(request_id)
        if state is None or not token_ids:
            return
        b = self.config.branch_length
        state.local.extend(token_ids)
        if state.scope is None:
            return
        # The scope's trie learns output only: runs that start after the prompt.
        output = self._output(state.scope)
        before = output.num_nodes
        if state.runs_of is not output or state.runs_epoch != output.epoch:
            state.runs = self._run_ends(state, output, len(token_ids))
        runs = state.runs
        for tok in token_ids:
            runs = output.extend_runs(runs, tok)[-(b - 1) :]  # a run of b tokens extends no further
        state.runs, state.runs_of, state.runs_epoch = runs, output, output.epoch
        self.num_output_nodes += output.num_nodes - before
        self._keep_capacity(state.scope)

    def _run_ends(self, state: _RequestState, output: Trie, num_new: int) -> list[TrieNode]:
        """The nodes of the output runs that end before the `num_new` newest tokens (longest
        first, each shorter than branch_length), found from the root: for a request new to
        `output`, or after a prune."""
        end = state.local.size - num_new  # the runs end at token end - 1
        longest = min(self.config.branch_length - 1, end - state.num_prompt)
        tokens = state.local.tokens[end - max(0, longest) : end].tolist()
        return [output.path(tokens[i:]) for i in range(len(tokens))]

    def _keep_capacity(self, current: str) -> None:
        """Over `trie_capacity` nodes in all: idle scopes go whole (least recently used first),
        then the largest live scope decays; `current` (being written) goes last of all."""
        while self.num_output_nodes > self.config.trie_capacity:
            if self._evict_idle(keep=current):
                continue
            live = [s for s in self._live if s in self.outputs and s != current] or [current]
            scope = max(live, key=lambda s: self.outputs[s].num_nodes)  # live scopes: at most the running requests
            trie = self.outputs[scope]
            before = trie.num_nodes
            trie.prune()
            self.num_output_nodes -= before - trie.num_nodes
            if not trie.num_nodes:
                self._drop_scope(scope)

    def _evict_idle(self, keep: str) -> bool:
        """Drop the least recently used scope that no running request uses (never `keep`)."""
        for scope in self.outputs:  # oldest first; live scopes are few (running requests)
            if scope != keep and not self._live[scope]:
                self._drop_scope(scope)
                return True
        return False

    def _drop_scope(self, scope: str) -> None:
        self.num_output_nodes -= self.outputs.pop(scope).num_nodes
        self.recent.drop(scope)

    def on_request_finish(self, request_id: str) -> None:
        self.references.finish(request_id)
        state = self._requests.pop(request_id, None)
        if state is not None and state.scope is not None:
            self.recent.end(request_id, state.local.tokens[state.num_prompt :].tolist())
            self._live[state.scope] -= 1
            if not self._live[state.scope]:
                del self._live[state.scope]

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> DraftTree | None:
        if max_tokens < 1 or not token_ids:
            return None
        state = self._requests.get(request_id)
        local = state.local if state is not None else None
        scope = state.scope if state is not None else None
        output = self.outputs.get(scope) if scope is not None else None
        layout = (state.layout if state is not None else None) or self.config.layout
        builder = TreeBuilder(max_tokens)
        expand = {"hierarchical": self._best_first, "parallel": self._parallel, "single": self._single}[layout]
        own = None  # the match in the request's own text, when already measured
        if local is not None and self.config.copy_chain:
            # What followed the longest earlier match, first: where the request is copying from.
            # Counts alone would weigh every occurrence of a short key alike; the longest
            # agreement (its own text's, or a recent output's if longer), most recent, is the copy.
            own, chain = copy_chain(local, token_ids, MATCH_CAP)
            seen, theirs = self.recent.copy(request_id, token_ids, MATCH_CAP)
            if seen > own:
                own, chain = seen, theirs
            self._add_chain(builder, chain)
        # Multi-stage retrieval: the longest matching suffix first; shorter matches fill
        # whatever budget is left (their branches merge into the same tree by token path).
        longest = min(self.config.max_match, len(token_ids), self.config.branch_length - 1)
        for m in range(longest, self.config.min_match - 1, -1):
            if builder.full or (layout == "single" and builder.tokens):  # a copy chain may be the one branch
                break
            key = token_ids[-m:]
            start = (local.find(key) if local is not None else None, output.find(key) if output is not None else None)
            if start[0] is None and start[1] is None:
                continue
            expand(start, builder)
        tree = builder.tree()
        if tree is not None:  # how good the match is: the policy's evidence before the forward
            tree = tree.with_match(self.match_length(request_id, token_ids, own))
        return self.references.ahead(request_id, token_ids, max_tokens, tree, single=layout == "single")

    def match_length(self, request_id: str, token_ids: Sequence[int], own: int | None = None) -> int:
        """The longest suffix of `token_ids` seen before with a token after it: in the request's
        own prompt and output (up to MATCH_CAP; `own` if already measured) or its scope's
        outputs (up to the trie's depth)."""
        state = self._requests.get(request_id)
        if state is None:
            return 0
        match = state.local.suffix_match(token_ids, MATCH_CAP) if own is None else own
        output = self.outputs.get(state.scope) if state.scope is not None else None
        if output is not None and match < self.config.branch_length - 1:
            match = max(match, output.suffix_match(token_ids, self.config.branch_length - 1))
        return match

    # ---- warm-up -------------------------------------------------------------------------

    def warm_up(self, sequences: Iterable[Sequence[int]], scope: str = "") -> int:
        """Load earlier outputs into a scope's output trie; returns how many sequences."""
        n = 0
        for seq in sequences:
            for _ in self.warm_up_slices([seq], scope, slice_tokens=max(1, len(seq))):
                pass
            n += 1
        return n

    def warm_up_slices(
        self, sequences: Sequence[Sequence[int]], scope: str = "", slice_tokens: int = 128
    ) -> Iterator[None]:
        """`warm_up` a slice of at most `slice_tokens` run starts at a time, yielding after each,
        so that a caller on the event loop can serve others between slices."""
        for seq in sequences:
            for first in range(0, len(seq), slice_tokens):
                output = self._output(scope)  # again each time: a capacity check may have dropped it
                before = output.num_nodes
                output.insert_sequence(seq, self.config.branch_length, first, first + slice_tokens)
                self.num_output_nodes += output.num_nodes - before
                self._keep_capacity(scope)
                yield

    def warm_up_file(
        self, path: str | Path, tokenize: Callable[[str], list[int]] | None = None, scope: str = ""
    ) -> int:
        """JSONL, one object per line with `token_ids` (list of ints) or `text` (needs `tokenize`)."""
        return self.warm_up(read_corpus(path, tokenize), scope)

    # ---- retrieval -----------------------------------------------------------------------

    def _weight(self, pair: _Pair) -> float:
        local, out = pair
        return (local.count * self.config.prompt_weight if local is not None else 0.0) + (
            out.count if out is not None else 0.0
        )

    def _weighted_children(self, pair: _Pair) -> list[tuple[int, _Pair, float, float]]:
        """(token, child, weight, share of all continuations' weight) for each continuation: the
        scope's first, then the request's own new ones (the order ties are broken in)."""
        local, out = pair
        pw = self.config.prompt_weight
        kids: list[tuple[int, _Pair, float]]
        if local is None:
            kids = [(tok, (None, c), c.count) for tok, c in out.children.items()] if out is not None else []
        elif out is None:
            kids = [(tok, (c, None), c.count * pw) for tok, c in local.children.items()]
        else:
            theirs, own = out.children, local.children
            kids = [(tok, both := (own.get(tok), c), self._weight(both)) for tok, c in theirs.items()]
            kids += [(tok, (c, None), c.count * pw) for tok, c in own.items() if tok not in theirs]
        total = sum(w for _, _, w in kids)
        if total > 0:
            return [(tok, child, w, w / total) for tok, child, w in kids]
        return [(tok, child, w, 0.0) for tok, child, w in kids]

    def _best_first(self, start: _Pair, builder: TreeBuilder) -> None:
        """Hierarchical: the heaviest nodes under the match, shared prefixes merged."""
        heap: list[tuple[float, int, int | None, int, _Pair, float]] = []
        self._push_children(heap, start, None)
        while heap and not builder.full:
            _, _, parent, tok, pair, prob = heapq.heappop(heap)
            idx = builder.add(parent, tok, prob)
            if not builder.full:  # else the loop ends: the node's children would never be popped
                self._push_children(heap, pair, idx)

    def _push_children(self, heap: list, pair: _Pair, parent: int | None) -> None:
        for tok, child, w, prob in self._weighted_children(pair):
            heapq.heappush(heap, (-w, next(self._tiebreak), parent, tok, child, prob))

    def _heaviest_chain(self, pair: _Pair, limit: int) -> list[tuple[int, float]]:
        """The heaviest path under `pair`: (token, probability given the previous) per step."""
        chain: list[tuple[int, float]] = []
        while len(chain) < limit:
            kids = self._weighted_children(pair)
            if not kids:
                break
            tok, pair, _, prob = max(kids, key=lambda k: k[2])
            chain.append((tok, prob))
        return chain

    def _add_chain(self, builder: TreeBuilder, chain: list[tuple[int, float]]) -> None:
        parent: int | None = None
        for tok, prob in chain:
            if builder.full:
                return
            parent = builder.add(parent, tok, prob)

    def _single(self, start: _Pair, builder: TreeBuilder) -> None:
        """Single branch (LLMA-like): the heaviest path under the match."""
        self._add_chain(builder, self._heaviest_chain(start, builder.budget))

    def _parallel(self, start: _Pair, builder: TreeBuilder) -> None:
        """Parallel: disjoint chains, the heaviest path under each of the heaviest first
        tokens, each up to `branch_length`; no prefix sharing below the root."""
        kids = sorted(self._weighted_children(start), key=lambda k: -k[2])
        for tok, pair, _, prob in kids:
            if builder.full:
                return
            if builder.has_root_child(tok):
                continue  # an earlier (longer) match already has a branch starting with tok
            room = min(self.config.branch_length, builder.budget - len(builder.tokens))
            self._add_chain(builder, [(tok, prob), *self._heaviest_chain(pair, room - 1)])

    # ---- introspection -------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Nodes in every output trie."""
        return self.num_output_nodes

    @property
    def num_indexed_tokens(self) -> int:
        """Tokens in the running requests' own indexes (prompt and output)."""
        return sum(s.local.size for s in self._requests.values())
