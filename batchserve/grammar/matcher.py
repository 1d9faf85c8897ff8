"""One request's grammar state: the draft nodes it allows and the token mask of every verified row.

A step's verified rows are the root (the request's next token) and one per draft node (the
token after that node). The grammar state at a node is the state after the node's path, so
one depth-first walk of the tree, consuming a node's token on the way down and rolling it back
on the way up, gives every row's mask and drops every node the grammar forbids after its
parent (with its subtree) before the forward. Verification then takes, at every kept row, the
model's choice among the tokens the mask allows: the emitted text is what plain constrained
decoding emits, token for token, with or without drafts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from batchserve.trees import DraftTree


class GrammarError(RuntimeError):
    """The matcher refused a token its own mask allowed (an llguidance fault): the request ends."""


def matcher_error(matcher: Any) -> str:
    """The first line of a failed matcher's error, bounded: llguidance appends its parser's state,
    which is internals, not a reason a client can act on."""
    lines = (matcher.get_error() or "").strip().splitlines()
    first = lines[0].strip() if lines else ""
    return f"the grammar admits no continuation here ({first[:160] or 'no reason given'})"


def allows(mask: np.ndarray, token: int) -> bool:
    """Whether one row's bitmask ([W] int32, bit t % 32 of word t // 32) allows `token`."""
    word = token >> 5
    return word < len(mask) and bool((int(mask[word]) >> (token & 31)) & 1)


class RequestGrammar:
    """An llguidance matcher advanced by the request's emitted tokens (module docstring)."""

    def __init__(self, matcher: Any, eos_token_id: int, vocab_size: int) -> None:
        self._m = matcher
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self._check()

    def _mask(self) -> np.ndarray:
        return np.frombuffer(self._m.compute_bitmask(), dtype=np.int32)

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(matcher_error(self._m))

    def prune(self, tree: DraftTree | None) -> tuple[DraftTree | None, np.ndarray]:
        """(the nodes of `tree` the grammar allows, in their order; the masks of the root's row
        and of each kept node's row, [1 + kept, W] int32). A kept node's ancestors are kept,
        so any prefix of the result is a tree whose masks are the same prefix of the rows."""
        root = self._mask()
        if tree is None or not len(tree):
            return None, root[None]
        masks: dict[int | None, np.ndarray] = {None: root}
        kept: list[int] = []

        def visit(node: int | None) -> None:
            mask = masks[node]
            for token, child in sorted(tree.children.get(node, {}).items(), key=lambda kv: kv[1]):
                # End of sequence ends the request at its row: nothing is drafted past it.
                if token == self.eos_token_id or not allows(mask, token):
                    continue
                if not self._m.consume_token(token):
                    self._check()
                kept.append(child)
                masks[child] = self._mask()
                visit(child)
                self._m.rollback(1)

        visit(None)
        if not kept:
            return None, root[None]
        kept.sort()  # parents precede children, as in the proposal: the best nodes stay first
        return _subtree(tree, kept), np.stack([root] + [masks[i] for i in kept])

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (a key's name and punctuation after `{"`, say): a
        draft whose only doubt is how the model splits those bytes into tokens."""
        return [t for t in self._m.compute_ff_tokens() if t != self.eos_token_id]

    def commit(self, tokens: list[int]) -> None:
        """Advance past tokens of the request's output. The end of sequence is never one: it
        ends the text (the scheduler ends the request there, `ignore_eos` or not), so it is
        refused here like a token the grammar forbids, never skipped (a resume carrying it)."""
        for token in tokens:
            if token == self.eos_token_id:
                raise GrammarError(f"the end of sequence (token {token}) ends the structured output")
            if not self._m.consume_token(token):
                self._check()
                raise GrammarError(f"the grammar refused token {token}")

    @property
    def done(self) -> bool:
        """The text is complete: the grammar allows nothing more but the end of sequence."""
        return bool(self._m.is_stopped())


def _subtree(tree: DraftTree, kept: list[int]) -> DraftTree:
    """The nodes `kept` (ascending, closed under parents) as a tree of their own."""
    index = {old: new for new, old in enumerate(kept)}
    parents = tuple(None if tree.parents[i] is None else index[tree.parents[i]] for i in kept)  # type: ignore[index]
    return DraftTree(
        tuple(tree.tokens[i] for i in kept),
        parents,
        tuple(tree.scores[i] for i in kept) if tree.scores else (),
        frozenset(index[i] for i in tree.pooled if i in index),
        frozenset(index[i] for i in tree.referenced if i in index),
        tree.match,
    )
