"""Test drafters: an oracle that knows the true continuation, and random trees."""

from __future__ import annotations

import random
from collections.abc import Sequence

from batchserve.draft import NoDrafter
from batchserve.trees import DraftTree


def token_path(tree: DraftTree, i: int) -> tuple[int, ...]:
    """The tokens from the root's first child down to node i."""
    path: list[int] = []
    node: int | None = i
    while node is not None:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return tuple(path[::-1])


def random_tree(rng: random.Random, size: int, vocab: int, first: list[int] | None = None) -> DraftTree:
    """A random tree of `size` nodes; `first`, if given, is planted as a chain from the root."""
    tokens: list[int] = []
    parents: list[int | None] = []
    children: dict[int | None, set[int]] = {}
    for i, tok in enumerate(first or []):
        parent = i - 1 if i else None
        tokens.append(tok)
        parents.append(parent)
        children.setdefault(parent, set()).add(tok)
    while len(tokens) < size:
        parent = rng.choice([None, *range(len(tokens))])
        used = children.setdefault(parent, set())
        if len(used) >= vocab:
            continue
        tok = rng.randrange(vocab)
        while tok in used:
            tok = rng.randrange(vocab)
        used.add(tok)
        tokens.append(tok)
        parents.append(parent)
    # Shuffle into another topological order so indices do not follow insertion.
    order = _random_topological_order(rng, parents)
    index = {old: new for new, old in enumerate(order)}
    return DraftTree(
        tuple(tokens[o] for o in order),
        tuple(None if parents[o] is None else index[parents[o]] for o in order),  # type: ignore[index]
    )


def _random_topological_order(rng: random.Random, parents: list[int | None]) -> list[int]:
    ready = [i for i, p in enumerate(parents) if p is None]
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p is not None:
            kids.setdefault(p, []).append(i)
    order: list[int] = []
    while ready:
        node = ready.pop(rng.randrange(len(ready)))
        order.append(node)
        ready.extend(kids.get(node, []))
    return order


class RandomTreeDrafter(NoDrafter):
    """Random trees of random shapes, up to `max_nodes` nodes."""

    def __init__(self, seed: int, vocab: int, max_nodes: int = 64) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.max_nodes = max_nodes
        self.proposed = 0

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> DraftTree | None:
        size = self.rng.randint(0, min(self.max_nodes, max_tokens))
        if size == 0:
            return None
        self.proposed += size
        return random_tree(self.rng, size, self.vocab)


class _KnowsTheTruth(NoDrafter):
    """A drafter that knows each request's true output (by prompt)."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.truth = truth  # prompt -> full true output
        self.vocab = vocab
        self.prompts: dict[str, tuple[int, ...]] = {}

    def on_request_start(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        layout: str | None = None,
        scope: str | None = "",
        window: tuple[int | None, int | None, int | None] | None = None,
        references: Sequence[Sequence[int]] = (),
    ) -> None:
        self.prompts[request_id] = tuple(prompt_token_ids)

    def _rest(self, request_id: str, token_ids: Sequence[int]) -> list[int]:
        """The true output still to come after `token_ids`."""
        prompt = self.prompts[request_id]
        return self.truth[prompt][len(token_ids) - len(prompt) :]


class OracleDrafter(_KnowsTheTruth):
    """Knows each request's true output: proposes its next `depth` tokens as one branch,
    with random siblings and random subtrees around it."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], seed: int, vocab: int, depth: int = 6) -> None:
        super().__init__(truth, vocab)
        self.rng = random.Random(seed)
        self.depth = depth

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> DraftTree | None:
        branch = self._rest(request_id, token_ids)[: min(self.depth, max_tokens)]
        if not branch:
            return None
        size = self.rng.randint(len(branch), max(len(branch), max_tokens))
        return random_tree(self.rng, size, self.vocab, first=branch)


def random_prompts(n: int, seed: int = 1, vocab: int = 256) -> list[list[int]]:
    """`n` random prompts of 1 to 80 token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 80))] for _ in range(n)]


class WrongChainDrafter(_KnowsTheTruth):
    """Knows each request's true output and proposes a chain of `max_tokens` nodes whose first
    token is never the true next one: every tree is rejected whole. `proposed` logs each
    proposal as (request id, tree size); tests read and clear it between steps."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        super().__init__(truth, vocab)
        self.proposed: list[tuple[str, int]] = []

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> DraftTree | None:
        rest = self._rest(request_id, token_ids)
        if max_tokens <= 0 or not rest:
            return None
        wrong = (rest[0] + 1) % self.vocab
        self.proposed.append((request_id, max_tokens))
        return DraftTree.chain([wrong] * max_tokens)


class MatchTellingDrafter(_KnowsTheTruth):
    """Knows each request's true output; every other proposal is the true next tokens with a long
    match (`DraftTree.match` 24), the others a chain whose first token is wrong with a match of 1.
    Every node scores the same: only the match tells the two apart."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        super().__init__(truth, vocab)
        self.calls = 0

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> DraftTree | None:
        rest = self._rest(request_id, token_ids)[:max_tokens]
        if not rest:
            return None
        self.calls += 1
        good = self.calls % 2 == 0
        tokens = rest if good else [(rest[0] + 1) % self.vocab] * len(rest)
        tree = DraftTree.chain(tokens)
        return DraftTree(tree.tokens, tree.parents, (0.8,) * len(tokens), match=24 if good else 1)
