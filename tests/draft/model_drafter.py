"""The randomized oracle's model of the native drafter (batchserve/draft/csrc/drafter.cpp and
retrieve.cpp), restated from its rules over the brute-force texts and tries of model_texts.py:
requests starting, resuming, accepting (at once or deferred) and ending, scopes capped in number
and nodes, and a proposal in each layout, from its copy chain and every match length."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any

from tests.draft.model_texts import LIB, MATCH_CAP, Chain, Node, Recent, Trie, copy_chain, copy_source, find

HIERARCHICAL, PARALLEL, SINGLE = (LIB.LAYOUTS[name] for name in ("hierarchical", "parallel", "single"))


@dataclass
class Request:
    local: list[int]  # prompt, resumed and accepted tokens
    num_prompt: int  # prompt and resumed: never taught to a scope
    scope: str | None
    layout: int
    pending: int = 0
    proves: bool = False  # its scope existed when it started


@dataclass
class Own:  # a path of the request's own text, as a trie node: where its occurrences end
    depth: int
    ends: list[int]


@dataclass
class Kid:
    token: int
    own: Own | None
    out: Node | None
    w: float
    prob: float = 0.0


@dataclass
class Builder:  # TreeBuilder: nodes merged by token path, scores the path's probability
    budget: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    index: dict[tuple[int, int], int] = field(default_factory=dict)

    def full(self) -> bool:
        return len(self.tokens) >= self.budget

    def add(self, parent: int, token: int, prob: float) -> int:
        score = prob * (1.0 if parent < 0 else self.scores[parent])
        idx = self.index.setdefault((parent, token), len(self.tokens))
        if idx == len(self.tokens):
            self.tokens.append(token)
            self.parents.append(parent)
            self.scores.append(score)
        self.scores[idx] = max(self.scores[idx], score)
        return idx

    def add_chain(self, chain: Chain) -> None:
        parent = -1
        for token, prob in chain:
            if self.full():
                return
            parent = self.add(parent, token, prob)


class Model:
    """The native drafter's state and retrieval (trie_scope_bytes never binds: the byte quota's
    rules depend on the allocator's capacities, which a model cannot restate)."""

    def __init__(self, s: Any) -> None:
        self.s = s  # a DraftConfig
        self.layout = LIB.LAYOUTS[s.layout]
        self.tries: dict[str, Trie] = {}  # least recently used first
        self.live: dict[str, int] = {}
        self.proven: set[str] = set()  # scopes a second request ended in (2Q's protected part)
        self.requests: dict[str, Request] = {}
        self.pending: list[str] = []
        self.deferred = False
        self.recent = Recent(s.recent_output_tokens, s.own_branch_length)
        self.sources: set[str] = set()  # where the trees it built drew from (coverage)

    # ---- state (drafter.cpp) ----------------------------------------------------------

    def start(self, rid: str, prompt: list[int], scope: str | None, layout: int) -> None:
        self.finish(rid)
        self.requests[rid] = Request(list(prompt), len(prompt), scope, layout, proves=scope in self.tries)
        self.recent.begin(rid, scope, prompt)
        if scope is not None:
            self.live[scope] = self.live.get(scope, 0) + 1

    def resume(self, rid: str, tokens: list[int]) -> None:
        r = self.requests.get(rid)
        if r is None or not tokens:
            return
        assert len(r.local) == r.num_prompt, "the drafter refuses this (the test never sends it)"
        r.local += tokens
        r.num_prompt += len(tokens)
        if rid in self.recent.running:
            self.recent.running[rid].resumed = True

    def accept(self, rid: str, tokens: list[int]) -> None:
        r = self.requests.get(rid)
        if r is None or not tokens:
            return
        r.local += tokens
        if r.scope is None:
            return
        if self.deferred:
            if r.pending == 0:
                self.pending.append(rid)
            r.pending += len(tokens)
        else:
            self.insert(r, len(tokens))

    def flush(self) -> None:
        for rid in self.pending:
            r = self.requests.get(rid)
            if r is not None and r.pending:
                self.insert(r, r.pending)
        self.pending.clear()

    def set_deferred(self, on: bool) -> None:
        if not on:
            self.flush()
        self.deferred = on

    def finish(self, rid: str) -> None:
        r = self.requests.pop(rid, None)
        if r is None:
            return
        if r.pending:
            self.insert(r, r.pending)
        if r.scope is not None:
            out = r.local[r.num_prompt :]
            if out and r.scope not in self.tries:
                self.output(r.scope)
            if r.proves and r.scope in self.tries and r.scope not in self.proven:  # it came back: 2Q's protected part
                self.proven.add(r.scope)
                self.make_room(r.scope)
            self.recent.end(rid, out)
            self.keep_bounds(r.scope)
            self.live[r.scope] -= 1
            if not self.live[r.scope]:
                del self.live[r.scope]
        if rid in self.pending:
            self.pending.remove(rid)
        self.recent.running.pop(rid, None)

    def warm(self, scope: str, seq: list[int]) -> None:
        trie = self.output(scope)
        if scope not in self.proven:
            self.proven.add(scope)
            self.make_room(scope)
        for s in range(len(seq)):
            trie.walk(seq[s : s + self.s.branch_length], count_each=True)
        self.keep_bounds(scope)

    def insert(self, r: Request, num_new: int) -> None:
        """Each run of its output (up to branch_length) ending at a new token, walked from the root."""
        assert r.scope is not None
        trie = self.output(r.scope)
        for i in range(len(r.local) - num_new, len(r.local)):
            for start in range(max(i + 1 - self.s.branch_length, r.num_prompt), i + 1):
                trie.walk(r.local[start:i], count_each=False).kids.setdefault(r.local[i], Node()).count += 1
        r.pending = 0
        self.keep_bounds(r.scope)

    def output(self, scope: str) -> Trie:
        trie = self.tries.pop(scope, None)
        self.tries[scope] = trie or Trie()  # the most recently used
        if trie is None:
            self.make_room(scope)
        return self.tries[scope]

    def make_room(self, keep: str) -> None:
        """2Q over the scope count: probation holds a quarter of it, the proven the rest."""
        cap = self.s.trie_max_scopes
        probation_cap = max(1, cap // 4)
        protected_cap = cap - probation_cap if cap > probation_cap else 1
        if len(self.tries) - len(self.proven) > probation_cap:
            self.evict_idle(keep, proven=False)
        if len(self.proven) > protected_cap:
            self.evict_idle(keep, proven=True)
        if len(self.tries) > cap and not self.evict_idle(keep, proven=False):
            self.evict_idle(keep, proven=True)

    def evict_idle(self, keep: str, proven: bool) -> bool:
        idle = next((s for s in self.tries if s != keep and s not in self.live and (s in self.proven) == proven), None)
        if idle is None:
            return False
        del self.tries[idle]
        self.proven.discard(idle)
        self.recent.drop(idle)
        return True

    def keep_bounds(self, scope: str) -> None:
        trie = self.tries.get(scope)
        while trie is not None and trie.size() > self.s.trie_capacity:
            trie.prune()

    def stats(self) -> dict[str, Any]:
        return {
            "nodes": sum(t.size() for t in self.tries.values()),
            "indexed_tokens": sum(len(r.local) for r in self.requests.values()),
            "requests": len(self.requests),
            "pending": len(self.pending),
            "recent_tokens": self.recent.num_tokens,
            "scopes": list(self.tries),
            "recent_scopes": list(self.recent.scopes),
        }

    # ---- retrieval (retrieve.cpp) -----------------------------------------------------

    def propose(self, rid: str, key: list[int], budget: int) -> tuple[Any, ...] | None:
        r = self.requests.get(rid)
        if r is None or budget < 1 or not key:
            return None
        trie = self.tries.get(r.scope) if r.scope is not None else None
        layout = r.layout if r.layout >= 0 else self.layout
        b, own = Builder(budget), -1
        if self.s.copy_chain:
            own, chain = copy_chain(r.local, key, MATCH_CAP, self.s.own_branch_length)
            seen, theirs = self.recent.copy(rid, r.local, key)
            recent = seen > own
            if recent:
                own, chain = seen, theirs
            if chain:
                self.sources.add("recent outputs" if recent else "copy chain")
            b.add_chain(chain)
        for m in range(min(self.s.max_match, len(key), self.s.branch_length - 1), self.s.min_match - 1, -1):
            if b.full() or (layout == SINGLE and b.tokens):
                break
            start = self.match_start(r, trie, key[-m:])
            if start.own is None and start.out is None:
                continue
            self.sources.update({"own text"} if start.own is not None else set())
            self.sources.update({"output trie"} if start.out is not None and start.out.kids else set())
            if layout == PARALLEL:
                self.parallel(r, start, b)
            elif layout == SINGLE:
                b.add_chain(self.heaviest_chain(r, start, b.budget))
            else:
                self.best_first(r, start, b)
        if not b.tokens:
            return None
        for i, parent in enumerate(b.parents):  # children never above their parent
            if parent >= 0:
                b.scores[i] = min(b.scores[i], b.scores[parent])
        parents = tuple(None if p < 0 else p for p in b.parents)
        return tuple(b.tokens), parents, tuple(b.scores), self.match_of(r, key, own)

    def match_length(self, rid: str, key: list[int]) -> int:
        r = self.requests.get(rid)
        return 0 if r is None or not key else self.match_of(r, key, -1)

    def match_of(self, r: Request, key: list[int], own: int) -> int:
        match = own if own >= 0 else copy_source(r.local, key, MATCH_CAP)[0]
        trie = self.tries.get(r.scope) if r.scope is not None else None
        deepest = self.s.branch_length - 1
        return max(match, trie.suffix_match(key, deepest)) if trie is not None and match < deepest else match

    def match_start(self, r: Request, trie: Trie | None, key: list[int]) -> Kid:
        m = len(key)
        ends = find(r.local, key) if m <= min(len(r.local), self.s.own_branch_length) else []
        return Kid(-1, Own(m, ends) if ends else None, trie.find(key) if trie is not None else None, 0.0)

    def grouped(self, r: Request, node: Own) -> dict[int, Own]:
        """What follows the path in the request's own text, first occurrence first."""
        kids: dict[int, Own] = {}
        if node.depth + 1 <= self.s.own_branch_length:
            for e in node.ends:
                if e < len(r.local):
                    kids.setdefault(r.local[e], Own(node.depth + 1, [])).ends.append(e + 1)
        return kids

    def children(self, r: Request, pair: Kid) -> list[Kid]:
        own = self.grouped(r, pair.own) if pair.own is not None else {}
        pw = self.s.prompt_weight
        kids = []
        if pair.out is not None:
            for tok, c in pair.out.kids.items():
                mine = own.get(tok)
                kids.append(Kid(tok, mine, c, (len(mine.ends) * pw if mine else 0.0) + c.count))
        theirs = pair.out.kids if pair.out is not None else {}
        kids += [Kid(t, o, None, len(o.ends) * pw) for t, o in own.items() if t not in theirs]
        total = 0.0
        for k in kids:
            total += k.w
        for k in kids:
            k.prob = k.w / total if total > 0 else 0.0
        return kids

    def best_first(self, r: Request, start: Kid, b: Builder) -> None:
        heap: list[tuple[float, int, int, Kid]] = []
        seq = itertools.count()

        def push(pair: Kid, parent: int) -> None:
            for k in self.children(r, pair):
                heapq.heappush(heap, (-k.w, next(seq), parent, k))

        push(start, -1)
        while heap and not b.full():
            _, _, parent, top = heapq.heappop(heap)
            idx = b.add(parent, top.token, top.prob)
            if not b.full():
                push(top, idx)

    def heaviest_chain(self, r: Request, pair: Kid, limit: int) -> Chain:
        chain: Chain = []
        for _ in range(limit):
            kids = self.children(r, pair)
            if not kids:
                break
            pair = kids[0]
            for k in kids:
                pair = k if k.w > pair.w else pair
            chain.append((pair.token, pair.prob))
        return chain

    def parallel(self, r: Request, start: Kid, b: Builder) -> None:
        for k in sorted(self.children(r, start), key=lambda k: -k.w):
            if b.full():
                return
            if (-1, k.token) in b.index:  # an earlier (longer) match has a branch starting with it
                continue
            room = min(self.s.branch_length, b.budget - len(b.tokens))
            b.add_chain([(k.token, k.prob), *self.heaviest_chain(r, k, room - 1)])
