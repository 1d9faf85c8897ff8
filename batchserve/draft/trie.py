"""The Lookahead trie drafter: n-grams of prompts and outputs, retrieved as draft trees.

Two kinds of trie, one node type:
- one *output trie per scope*, shared by the requests of that scope: n-grams of their
  generated text (and of a warm-up corpus), inserted as tokens are accepted; frequencies
  decay and rare nodes are pruned when the tries together outgrow their capacity. A scope
  is a tenant key (or "" for everyone); a request with no scope reads and writes none, so
  one tenant's output can never become another tenant's draft;
- one *local trie* per live request: n-grams of its own prompt and output, weighted far
  above the global counts (branch weighting) and dropped whole when the request ends
  (branch elimination), so a finished request leaves no trace of its prompt.

A node's count is the number of times its path (from the root) occurred as a run of
consecutive tokens, for paths up to `branch_length` tokens. Counts never grow along a
path, so pruning a node prunes a subtree of nodes at least as rare.
"""

from __future__ import annotations

import heapq
import itertools
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from batchserve.config import DraftConfig
from batchserve.draft.tree import DraftTree, TreeBuilder


class TrieNode:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, TrieNode] = {}
        self.count = 0.0


class Trie:
    """A counted n-gram trie with a node budget."""

    def __init__(self) -> None:
        self.root = TrieNode()
        self.num_nodes = 0

    def insert_sequence(self, tokens: Sequence[int], branch_length: int) -> None:
        """Count every run of up to `branch_length` consecutive tokens of `tokens`."""
        for start in range(len(tokens)):
            node = self.root
            for tok in tokens[start : start + branch_length]:
                node = self._child(node, tok)
                node.count += 1

    def insert_last(self, window: Sequence[int], start: int = 0) -> None:
        """Count the runs ending at the last token of `window` and starting at `start` or later
        (the on-the-fly insertion of one new token; shorter runs were counted before)."""
        for i in range(start, len(window)):
            node = self.root
            for tok in window[i:]:
                node = self._child(node, tok)
            node.count += 1

    def find(self, key: Sequence[int]) -> TrieNode | None:
        node: TrieNode | None = self.root
        for tok in key:
            node = node.children.get(tok)  # type: ignore[union-attr]
            if node is None:
                return None
        return node

    def prune(self) -> None:
        """Halve every count and delete the nodes that fall below 1 (with their subtrees)."""
        removed = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for tok, child in list(node.children.items()):
                child.count /= 2
                if child.count < 1:
                    del node.children[tok]
                    removed += _subtree_size(child)
                else:
                    stack.append(child)
        self.num_nodes -= removed

    def _child(self, node: TrieNode, tok: int) -> TrieNode:
        child = node.children.get(tok)
        if child is None:
            child = node.children[tok] = TrieNode()
            self.num_nodes += 1
        return child


def _subtree_size(node: TrieNode) -> int:
    size, stack = 0, [node]
    while stack:
        n = stack.pop()
        size += 1
        stack.extend(n.children.values())
    return size


@dataclass(slots=True)
class _RequestState:
    local: Trie  # this request's prompt and output n-grams
    tokens: list[int]  # prompt + accepted output
    num_prompt: int
    layout: str | None = None  # per-request layout override
    scope: str | None = ""  # the output trie it reads and feeds; None: its own n-grams only


# A position in the merged view of a request's local trie and the global output trie.
_Pair = tuple[TrieNode | None, TrieNode | None]


class TrieDrafter:
    """Lookahead drafts for many concurrent requests (see the module docstring)."""

    def __init__(self, config: DraftConfig | None = None) -> None:
        self.config = config = config or DraftConfig(method="lookahead")
        self.outputs: dict[str, Trie] = {}  # output trie per scope
        self._requests: dict[str, _RequestState] = {}
        self._tiebreak = itertools.count()

    @property
    def output(self) -> Trie:
        """The output trie of the shared scope "" (every request's under `trie_scope=global`)."""
        return self._output("")

    def _output(self, scope: str) -> Trie:
        trie = self.outputs.get(scope)
        if trie is None:
            trie = self.outputs[scope] = Trie()
        return trie

    # ---- Drafter interface ---------------------------------------------------------------

    def on_request_start(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        layout: str | None = None,
        scope: str | None = "",
        window: tuple[int | None, int | None, int | None] | None = None,
    ) -> None:
        local = Trie()
        local.insert_sequence(prompt_token_ids, self.config.branch_length)
        self._requests[request_id] = _RequestState(local, list(prompt_token_ids), len(prompt_token_ids), layout, scope)

    def on_tokens_accepted(self, request_id: str, token_ids: Sequence[int]) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return
        b = self.config.branch_length
        output = self._output(state.scope) if state.scope is not None else None
        for tok in token_ids:
            state.tokens.append(tok)
            window = state.tokens[-b:]
            state.local.insert_last(window)
            if output is not None:
                # The scope's trie learns output only: runs that start after the prompt.
                num_output = len(state.tokens) - state.num_prompt
                output.insert_last(window, start=max(0, len(window) - num_output))
        self._keep_capacity()

    def _keep_capacity(self) -> None:
        """Decay and prune the largest output tries until all of them fit the capacity."""
        total = sum(t.num_nodes for t in self.outputs.values())
        while total > self.config.trie_capacity:
            scope, largest = max(self.outputs.items(), key=lambda kv: kv[1].num_nodes)
            before = largest.num_nodes
            largest.prune()
            total -= before - largest.num_nodes
            if not largest.num_nodes:
                del self.outputs[scope]

    def on_request_finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

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
        # Multi-stage retrieval: the longest matching suffix first; shorter matches fill
        # whatever budget is left (their branches merge into the same tree by token path).
        longest = min(self.config.max_match, len(token_ids), self.config.branch_length - 1)
        for m in range(longest, self.config.min_match - 1, -1):
            key = token_ids[-m:]
            start = (local.find(key) if local is not None else None, output.find(key) if output is not None else None)
            if start[0] is None and start[1] is None:
                continue
            expand(start, builder)
            if builder.full or (layout == "single" and builder.tokens):
                break
        return builder.tree()

    # ---- warm-up -------------------------------------------------------------------------

    def warm_up(self, sequences: Iterable[Sequence[int]], scope: str = "") -> int:
        """Load earlier outputs into a scope's output trie; returns how many sequences."""
        n = 0
        output = self._output(scope)
        for seq in sequences:
            output.insert_sequence(seq, self.config.branch_length)
            n += 1
            self._keep_capacity()
        return n

    def warm_up_file(
        self, path: str | Path, tokenize: Callable[[str], list[int]] | None = None, scope: str = ""
    ) -> int:
        """JSONL, one object per line with `token_ids` (list of ints) or `text` (needs `tokenize`)."""
        seqs: list[list[int]] = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
                if isinstance(obj, dict) and isinstance(obj.get("token_ids"), list):
                    seqs.append([int(t) for t in obj["token_ids"]])
                elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
                    if tokenize is None:
                        raise ValueError(f"{path}:{lineno}: text entries need a tokenizer")
                    seqs.append(tokenize(obj["text"]))
                else:
                    raise ValueError(f'{path}:{lineno}: expected {{"token_ids": [...]}} or {{"text": "..."}}')
        return self.warm_up(seqs, scope)

    # ---- retrieval -----------------------------------------------------------------------

    def _weight(self, pair: _Pair) -> float:
        local, out = pair
        return (local.count * self.config.prompt_weight if local is not None else 0.0) + (
            out.count if out is not None else 0.0
        )

    @staticmethod
    def _children(pair: _Pair) -> dict[int, _Pair]:
        local, out = pair
        kids: dict[int, _Pair] = {}
        if out is not None:
            for tok, child in out.children.items():
                kids[tok] = (None, child)
        if local is not None:
            for tok, child in local.children.items():
                kids[tok] = (child, kids[tok][1] if tok in kids else None)
        return kids

    def _weighted_children(self, pair: _Pair) -> list[tuple[int, _Pair, float, float]]:
        """(token, child, weight, probability given `pair`) for each continuation: the
        probability is the child's share of all continuations' weight."""
        kids = [(tok, child, self._weight(child)) for tok, child in self._children(pair).items()]
        total = sum(w for _, _, w in kids)
        return [(tok, child, w, w / total if total > 0 else 0.0) for tok, child, w in kids]

    def _best_first(self, start: _Pair, builder: TreeBuilder) -> None:
        """Hierarchical: the heaviest nodes under the match, shared prefixes merged."""
        heap: list[tuple[float, int, int | None, int, _Pair, float]] = []
        self._push_children(heap, start, None)
        while heap and not builder.full:
            _, _, parent, tok, pair, prob = heapq.heappop(heap)
            idx = builder.add(parent, tok, prob)
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
        """Nodes in every output trie plus every live request's local trie."""
        return sum(t.num_nodes for t in self.outputs.values()) + sum(s.local.num_nodes for s in self._requests.values())
