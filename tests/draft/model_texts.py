"""The randomized oracle's model of the native drafter's texts, tries and recent outputs
(batchserve/draft/csrc/text.h, trie.h, recent.h), restated from their rules by brute force: no
index, no node ids, no hashes. The constants are the module's own (csrc/constants.h)."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchserve.draft.native import library

LIB = library()
SEP, MAX_OCC, MATCH_CAP = LIB.SEPARATOR, LIB.MAX_OCCURRENCES, LIB.MATCH_CAP
Chain = list[tuple[int, float]]  # (token, share among the occurrences still agreeing)


def agreement(text: list[int], p: int, key: list[int], limit: int) -> int:
    """How many tokens back from text[p] agree with key back from its end (at most `limit`)."""
    k = 0
    while k < limit and p - k >= 0 and text[p - k] == key[-1 - k]:
        k += 1
    return k


def find(text: list[int], key: list[int]) -> list[int]:
    """Where the most recent MAX_OCCURRENCES occurrences of `key` end (the position after each)."""
    m = len(key)
    return [p + 1 for p in range(m - 1, len(text)) if text[p + 1 - m : p + 1] == key][-MAX_OCC:]


def copy_source(text: list[int], key: list[int], limit: int) -> tuple[int, list[int]]:
    """The longest suffix of `key` (<= limit) said with a token after it, and where each of its
    most recent MAX_OCCURRENCES occurrences ends."""
    limit = min(limit, len(key))
    if limit < 1 or len(text) < 2:
        return 0, []
    agree = {p: agreement(text, p, key, limit) for p in range(len(text) - 1) if text[p] == key[-1]}
    best = max(agree.values(), default=0)
    return best, [p + 1 for p, a in agree.items() if a == best][-MAX_OCC:]


def continuation(text: list[int], after: list[int], length: int, depth: int) -> Chain:
    """What followed the most recent of `after`, each token with its share of those still agreeing."""
    if not after:
        return []
    chain: Chain = []
    start = after[-1]
    for i in range(start, min(len(text), start + min(length, depth))):
        if len(after) == 1:
            return chain + [(t, 1.0) for t in text[i : min(len(text), start + min(length, depth))]]
        alive = [a for a in after if a < len(text)]
        agreeing = [a for a in alive if text[a] == text[i]]
        chain.append((text[i], len(agreeing) / len(alive)))
        after = [a + 1 for a in agreeing]
    return chain


def copy_chain(text: list[int], key: list[int], limit: int, depth: int) -> tuple[int, Chain]:
    """(m, chain): a copy of what followed the longest match, where the match is long enough."""
    m, after = copy_source(text, key, limit)
    if m < LIB.COPY_MIN_MATCH:
        return m, []
    chain = continuation(text, after, LIB.COPY_PER_MATCH * m, depth)
    cut = next((i for i, (t, _) in enumerate(chain) if t == SEP), len(chain))
    return m, chain[:cut]


class Node:
    __slots__ = ("count", "kids")

    def __init__(self) -> None:
        self.count = 0.0
        self.kids: dict[int, Node] = {}  # creation order


class Trie:
    """A scope's counted runs: nodes made uncounted where missing, pruned by halving."""

    def __init__(self) -> None:
        self.root = Node()

    def walk(self, path: list[int], count_each: bool) -> Node:
        node = self.root
        for tok in path:
            node = node.kids.setdefault(tok, Node())
            node.count += count_each
        return node

    def find(self, key: list[int]) -> Node | None:
        node: Node | None = self.root
        for tok in key:
            node = node.kids.get(tok) if node is not None else None
        return node

    def size(self, node: Node | None = None) -> int:
        return sum(1 + self.size(kid) for kid in (node or self.root).kids.values())

    def counts(self, node: Node | None = None, path: tuple[int, ...] = ()) -> list[tuple[tuple[int, ...], float]]:
        out = []
        for tok, kid in (node or self.root).kids.items():
            out.append(((*path, tok), kid.count))
            out += self.counts(kid, (*path, tok))
        return out

    def prune(self, node: Node | None = None) -> None:
        node = node or self.root
        for tok, kid in list(node.kids.items()):
            kid.count /= 2
            if kid.count < 1:
                del node.kids[tok]
            else:
                self.prune(kid)

    def suffix_match(self, key: list[int], limit: int) -> int:
        best = 0
        for m in range(1, min(limit, len(key)) + 1):
            node = self.find(key[-m:])
            if node is None or not node.kids:
                break
            best = m
        return best


@dataclass
class Kept:
    text: list[int] = field(default_factory=list)
    trimmed: int = 0
    starts: dict[tuple[int, ...], int] = field(default_factory=dict)  # prompt -> its latest output


@dataclass
class Running:
    scope: str
    prompt: tuple[int, ...]
    repeat: int  # where an earlier output of the same prompt starts; -1: none
    resumed: bool = False


class Recent:
    """Each scope's latest outputs, separated, bounded per scope, least recently used first."""

    def __init__(self, capacity: int, depth: int) -> None:
        self.capacity, self.depth = capacity, depth
        self.scopes: dict[str, Kept] = {}
        self.running: dict[str, Running] = {}
        self.num_tokens = 0
        self.repeats = 0  # copies of an earlier output of the very prompt (coverage)

    def begin(self, rid: str, scope: str | None, prompt: list[int]) -> None:
        if scope is None or self.capacity < 2:
            return
        kept = self.scopes.get(scope)
        repeat = kept.starts.get(tuple(prompt), -1) if kept else -1
        self.running[rid] = Running(scope, tuple(prompt), repeat)

    def end(self, rid: str, output: list[int]) -> None:
        run = self.running.pop(rid, None)
        if run is None or not output:
            return
        kept = self.scopes.pop(run.scope, None) or Kept()
        self.scopes[run.scope] = kept  # the most recently used
        output = output[len(output) - min(len(output), self.capacity - 1) :]
        if not run.resumed:
            kept.starts[run.prompt] = kept.trimmed + len(kept.text)
        kept.text += [*output, SEP]
        self.num_tokens += len(output) + 1
        while run.scope in self.scopes and len(self.scopes[run.scope].text) > self.capacity:
            self.trim(run.scope)

    def trim(self, scope: str) -> None:
        kept = self.scopes[scope]
        ends = [i for i, t in enumerate(kept.text) if t == SEP]
        cut = ends[len(ends) // 2 - 1] + 1 if len(ends) > 1 else len(kept.text)
        self.num_tokens -= cut
        if cut >= len(kept.text):
            del self.scopes[scope]
            return
        kept.text, kept.trimmed = kept.text[cut:], kept.trimmed + cut
        kept.starts = {p: at for p, at in kept.starts.items() if at >= kept.trimmed}

    def drop(self, scope: str) -> None:
        kept = self.scopes.pop(scope, None)
        if kept is not None:
            self.num_tokens -= len(kept.text)

    def copy(self, rid: str, own: list[int], key: list[int]) -> tuple[int, Chain]:
        """(match, chain) from the scope's outputs: the very prompt's earlier output while the
        request's own output (`own` past its prompt, resumed tokens included) agrees, else the
        longest match's copy."""
        run = self.running.get(rid)
        kept = self.scopes.get(run.scope) if run else None
        if run is None or kept is None:
            return 0, []
        if run.repeat >= 0:
            start, done = run.repeat - kept.trimmed, own[len(run.prompt) :]
            if start >= 0 and start + len(done) <= len(kept.text) and kept.text[start : start + len(done)] == done:
                rest = kept.text[start + len(done) : start + len(done) + self.depth]
                chain = [(t, 1.0) for t in rest[: rest.index(SEP) if SEP in rest else len(rest)]]
                if chain:
                    self.repeats += 1
                    return MATCH_CAP, chain
            run.repeat = -1
        return copy_chain(kept.text, key, MATCH_CAP, self.depth)
