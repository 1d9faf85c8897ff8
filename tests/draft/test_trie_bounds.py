"""The trie drafter's bounds, through its public API, against brute-force oracles written here:
a request's own text drafts what best-first expansion over the dict trie of its runs gives (a
common key read at its 256 most recent occurrences) and costs little memory; scopes are capped in
number, counted and evicted by recency, and each decays on its own, so many small tenants never
cost a busy one its n-grams; a corpus warmed up in slices counts as one insert; output runs
counted as tokens arrive, under every capacity rule, equal a model that walks each run from the
root."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
from collections import Counter
from collections.abc import Sequence

import pytest

from batchserve.config import DraftConfig
from batchserve.draft.trie import TrieDrafter

MAX_OCCURRENCES = 256  # kMaxOccurrences (csrc/text.h): the most recent occurrences of a key read
BIG = 10**6  # a budget no tree here reaches
Tree = tuple[tuple[int, ...], tuple[int | None, ...], tuple[float, ...]]


def _continuations(text: list[int], starts: list[int], path: list[int], depth: int) -> list[tuple[int, int]]:
    """(token, count) of what follows `path` at the key occurrences `starts` (the path's first
    tokens are the key), first occurrence first; none at `depth` tokens."""
    n = len(path)
    if n >= depth:
        return []
    return list(Counter(text[s + n] for s in starts if s + n < len(text) and text[s : s + n] == path).items())


def _reference_tree(text: list[int], key: list[int], depth: int, weight: float, budget: int) -> Tree:
    """Best first over the brute-force trie of `text` under `key`: a node's count is how often
    its path occurs (at one of the key's most recent MAX_OCCURRENCES occurrences)."""
    m = len(key)
    starts = [s for s in range(len(text) - m + 1) if text[s : s + m] == key][-MAX_OCCURRENCES:]
    made: dict[tuple[int | None, int], int] = {}  # (parent, token) -> node, in node order
    scores: list[float] = []
    heap: list[tuple[float, int, int | None, int, list[int], float]] = []
    counter = itertools.count()

    def push(path: list[int], parent: int | None) -> None:
        kids = [(tok, count * weight) for tok, count in _continuations(text, starts, path, depth)]
        total = 0.0
        for _tok, w in kids:  # in order, as the native sum (sum() compensates since Python 3.12)
            total += w
        for tok, w in kids:
            heapq.heappush(heap, (-w, next(counter), parent, tok, [*path, tok], w / total))

    push(list(key), None)
    while heap and len(scores) < budget:
        _w, _n, parent, tok, path, prob = heapq.heappop(heap)
        score = prob * (1.0 if parent is None else scores[parent])
        idx = made.setdefault((parent, tok), len(scores))  # a node reached again keeps the higher score
        if idx == len(scores):
            scores.append(score)
        scores[idx] = max(scores[idx], score)
        if len(scores) < budget:
            push(path, idx)
    for i, (parent, _tok) in enumerate(made):  # children never above their parent
        if parent is not None:
            scores[i] = min(scores[i], scores[parent])
    return tuple(t for _p, t in made), tuple(p for p, _t in made), tuple(scores)


def _own_drafter(m: int, depth: int) -> TrieDrafter:
    """Drafts from a request's own text only, keys of exactly `m` tokens, best first."""
    config = DraftConfig(method="lookahead", layout="hierarchical", copy_chain=False, own_branch_length=depth)
    return TrieDrafter(dataclasses.replace(config, max_match=m, min_match=m))


def _text(kind: str, rng: random.Random) -> list[int]:
    if kind == "repetitive":
        unit = [rng.randrange(50) for _ in range(rng.randint(2, 6))]
        return (unit * 40)[: rng.randint(1, 150)]
    # "few-symbols": keys with dozens of occurrences; "wide": nodes with more than 8 children.
    symbols, longest = {"random": (12, 120), "few-symbols": (4, 120), "wide": (24, 300)}[kind]
    return [rng.randrange(symbols) for _ in range(rng.randint(1, longest))]


def _check_every_key(d: TrieDrafter, text: list[int], m: int, depth: int, rng: random.Random) -> int:
    """Each distinct key of `m` tokens drafts the oracle's tree; returns how many trees were non-empty."""
    drafted = 0
    for key, end in {tuple(text[e - m : e]): e for e in range(m, len(text) + 1)}.items():  # its last occurrence
        for budget in (BIG, rng.randint(1, 12)):
            tokens, parents, scores = _reference_tree(text, list(key), depth, d.config.prompt_weight, budget)
            tree = d.propose("r", text[:end], budget)
            if not tokens:
                assert tree is None, key
                continue
            assert tree is not None and (tree.tokens, tree.parents, tree.scores) == (tokens, parents, scores), key
            drafted += 1
    return drafted


@pytest.mark.parametrize("kind", ["random", "repetitive", "few-symbols", "wide"])
def test_the_index_reads_as_the_dict_trie_of_every_run(kind: str) -> None:
    rng = random.Random(3)
    depth, drafted = 6, 0
    for _ in range(20):
        text = _text(kind, rng)
        split = rng.randint(0, len(text))
        for m in range(1, 5):
            d = _own_drafter(m, depth)
            d.on_request_start("r", text[:split], scope=None)
            step = rng.randint(1, 3)
            for i in range(split, len(text), step):  # the output arrives a few tokens at a time
                d.on_tokens_accepted("r", text[i : i + step])
            assert d.num_indexed_tokens == len(text)
            drafted += _check_every_key(d, text, m, depth, rng)
            assert d.propose("r", [*text, 99], BIG) is None  # a key it never saw
            assert d.num_nodes == 0 and d.stats()["scopes"] == []  # no scope: no output trie
    assert drafted > 500


def test_a_common_key_reads_only_its_most_recent_occurrences() -> None:
    text = [7, 1] * 1000 + [7, 2]
    d = _own_drafter(1, 4)
    d.on_request_start("r", text, scope=None)
    tree = d.propose("r", [7], BIG)
    assert tree is not None
    assert (tree.tokens, tree.parents, tree.scores) == _reference_tree(text, [7], 4, d.config.prompt_weight, BIG)
    # After the 256 most recent 7s: 1 255 times, 2 once (not 1000 times to once).
    first = [(tok, score) for tok, parent, score in zip(tree.tokens, tree.parents, tree.scores) if parent is None]
    assert first == [(1, 255 / 256), (2, 1 / 256)]


def test_an_8k_prompt_costs_under_a_mebibyte() -> None:
    d = TrieDrafter(DraftConfig(method="lookahead"))
    rng = random.Random(0)
    prompt = [rng.randrange(49152) for _ in range(8191)]
    before = d.memory_bytes()
    d.on_request_start("r", prompt)
    grown = d.memory_bytes() - before
    assert 4 * len(prompt) <= grown < 2**20, grown  # at least the tokens themselves
    assert d.num_indexed_tokens == 8191
    d.on_request_finish("r")
    assert d.num_indexed_tokens == 0


def _counted(d: TrieDrafter) -> None:
    """The drafter's node total is the sum over its scopes' tries."""
    stats = d.stats()
    assert stats["nodes"] == sum(len(d.trie_counts(s) or {}) for s in stats["scopes"]) == d.num_nodes


def test_100k_scopes_stay_capped_and_counted() -> None:
    d = TrieDrafter(DraftConfig(method="lookahead", branch_length=4, trie_max_scopes=1000, trie_capacity=10**9))
    d.on_request_start("busy", [1, 2, 3], scope="busy")
    d.on_tokens_accepted("busy", [5, 6, 7])
    for i in range(100_000):
        d.warm_up([[i % 997, 1, 2]], scope=f"t{i}")
    scopes = d.stats()["scopes"]
    # The live scope survives (least recently used); the idle ones go oldest first. A warmed-up
    # scope is an operator's corpus, proven at once: they hold the cap less probation's quarter.
    assert scopes == ["busy"] + [f"t{i}" for i in range(99_250, 100_000)]
    assert d.trie_counts("busy") == {(5,): 1, (5, 6): 1, (5, 6, 7): 1, (6,): 1, (6, 7): 1, (7,): 1}
    assert d.trie_counts("t99249") is None and d.trie_counts("t99250") is not None
    _counted(d)


def test_many_one_off_tenants_never_evict_or_decay_a_busy_tenant() -> None:
    d = TrieDrafter(DraftConfig(method="lookahead", branch_length=4, trie_capacity=2000, trie_max_scopes=500))
    phrase = (40, 41, 42, 43)
    d.on_request_start("busy", [1], scope="acme")
    for i in range(5000):  # one-off tenants, each with a request that comes and goes
        rid = f"r{i}"
        d.on_request_start(rid, [2], scope=f"user{i}")
        d.on_tokens_accepted(rid, [i % 250, (i * 7) % 250, (i * 13) % 250])
        d.on_request_finish(rid)
        if i % 50 == 0:
            d.on_tokens_accepted("busy", phrase)
        assert len(d.stats()["scopes"]) <= 500 and d.num_nodes <= 500 * 6 + 16  # 6 nodes a one-off, 16 acme's
    counts = d.trie_counts("acme")
    assert counts is not None and counts[phrase] == 100  # every time, never halved
    _counted(d)


def test_a_live_scope_alone_over_capacity_decays() -> None:
    d = TrieDrafter(DraftConfig(method="lookahead", trie_capacity=500))
    d.on_request_start("a", [1])
    rng = random.Random(0)
    drops, last = 0, 0
    for _ in range(200):
        d.on_tokens_accepted("a", [rng.randrange(1000) for _ in range(5)])
        assert d.num_nodes <= 500 + 6 * 12
        drops += d.num_nodes < last
        last = d.num_nodes
        _counted(d)
    assert drops > 0 and d.stats()["scopes"] == [""] and d.num_nodes == len(d.trie_counts("") or {})


def _run_counts(corpus: Sequence[Sequence[int]], branch: int) -> Counter[tuple[int, ...]]:
    """How often each run of up to `branch` tokens occurs in the corpus."""
    return Counter(
        tuple(s[i:j]) for s in corpus for i in range(len(s)) for j in range(i + 1, min(i + branch, len(s)) + 1)
    )


@pytest.mark.parametrize(("slice_tokens", "slices"), [(1, 1011), (7, 146), (128, 10), (5000, 3)])
def test_a_corpus_inserted_in_slices_counts_as_one_insert(slice_tokens: int, slices: int) -> None:
    rng = random.Random(5)
    seq = [rng.randrange(20) for _ in range(1000)]
    corpus = [seq, seq[:10], [3]]
    config = DraftConfig(method="lookahead", branch_length=6)
    whole, sliced = TrieDrafter(config), TrieDrafter(config)
    assert whole.warm_up(corpus, scope="acme") == 3
    assert sum(1 for _ in sliced.warm_up_slices(corpus, scope="acme", slice_tokens=slice_tokens)) == slices
    counts, got = whole.trie_counts("acme"), sliced.trie_counts("acme")
    assert counts is not None and got is not None
    assert list(got.items()) == list(counts.items())  # the same counts, children in the same order
    assert counts == _run_counts(corpus, 6) and sliced.num_nodes == len(counts)


class _Node:
    __slots__ = ("count", "kids")

    def __init__(self) -> None:
        self.count = 0.0
        self.kids: dict[int, _Node] = {}  # creation order


def _size(node: _Node) -> int:
    return sum(1 + _size(kid) for kid in node.kids.values())


def _counts(node: _Node, path: tuple[int, ...] = ()) -> dict[tuple[int, ...], float]:
    """Every node's path and count, depth first in creation order (as `trie_counts`)."""
    out: dict[tuple[int, ...], float] = {}
    for tok, kid in node.kids.items():
        out[(*path, tok)] = kid.count
        out.update(_counts(kid, (*path, tok)))
    return out


def _prune(node: _Node) -> None:
    """Halve every count; delete the nodes that fall below 1, with their subtrees."""
    for tok, kid in list(node.kids.items()):
        kid.count /= 2
        if kid.count < 1:
            del node.kids[tok]
        else:
            _prune(kid)


class _Model:
    """Output tries per scope, each run ending at an accepted token walked from the root; a scope
    over its capacity decays its own trie, and scopes are counted 2Q's way: made on probation,
    proven by the end of a request that started after they were made, and past either part's
    bound (a quarter of the cap for probation) an idle one of that part goes."""

    def __init__(self, branch: int, capacity: int, max_scopes: int) -> None:
        self.branch, self.capacity, self.max_scopes = branch, capacity, max_scopes
        self.tries: dict[str, _Node] = {}  # least recently used first
        self.live: dict[str, int] = {}  # running requests per scope, in the order scopes became live
        self.requests: dict[str, tuple[str, list[int], int]] = {}  # scope, text, prompt length
        self.proven: set[str] = set()
        self.prunes = self.over_scopes = 0  # prunes; idle scopes evicted for the scope cap

    def start(self, rid: str, prompt: list[int], scope: str) -> None:
        self.requests[rid] = (scope, list(prompt), len(prompt), scope in self.tries)
        self.live[scope] = self.live.get(scope, 0) + 1

    def finish(self, rid: str) -> None:
        scope, text, num_prompt, proves = self.requests.pop(rid)
        if len(text) > num_prompt and scope not in self.tries:  # its recent outputs need their scope
            self._use(scope)
        if proves and scope in self.tries and scope not in self.proven:
            self.proven.add(scope)
            self._scope_room(scope)
        self.live[scope] -= 1
        if not self.live[scope]:
            del self.live[scope]

    def accept(self, rid: str, tokens: list[int]) -> None:
        scope, text, num_prompt, _ = self.requests[rid]
        text.extend(tokens)
        root = self._use(scope)
        for i in range(len(text) - len(tokens), len(text)):
            for start in range(max(i + 1 - self.branch, num_prompt), i + 1):  # the runs inside the output
                node = root
                for tok in text[start : i + 1]:
                    node = node.kids.setdefault(tok, _Node())  # made uncounted where missing
                node.count += 1
        self._make_room(scope)

    def _use(self, scope: str) -> _Node:
        root = self.tries.pop(scope, None)
        self.tries[scope] = root if root is not None else _Node()  # now the most recently used
        if root is None:
            self._scope_room(scope)
        return self.tries[scope]

    def _scope_room(self, keep: str) -> None:
        probation_cap = max(1, self.max_scopes // 4)
        protected_cap = self.max_scopes - probation_cap if self.max_scopes > probation_cap else 1
        if len(self.tries) - len(self.proven) > probation_cap:
            self.over_scopes += self._evict_idle(keep, proven=False)
        if len(self.proven) > protected_cap:
            self.over_scopes += self._evict_idle(keep, proven=True)
        if len(self.tries) > self.max_scopes:
            self.over_scopes += self._evict_idle(keep, proven=False) or self._evict_idle(keep, proven=True)

    def _evict_idle(self, keep: str, proven: bool) -> bool:
        for scope in self.tries:  # least recently used first
            if scope != keep and scope not in self.live and (scope in self.proven) == proven:
                del self.tries[scope]
                self.proven.discard(scope)
                return True
        return False

    def _make_room(self, current: str) -> None:
        while _size(self.tries[current]) > self.capacity:  # its own trie, never another's
            _prune(self.tries[current])
            self.prunes += 1


# More scopes than the cap of 2: scopes come back after an eviction, and idle ones make room.
SCOPES = ("a", "b", "c", "d", "e")


def _random_event(rng: random.Random, event: int, live: list[str], d: TrieDrafter, model: _Model) -> None:
    """Requests come and go in five scopes; steps accept a few tokens of eight."""
    if (len(live) < 4 and rng.random() < 0.05) or not live:
        rid, scope = f"r{event}", rng.choice(SCOPES)
        prompt = [rng.randrange(8) for _ in range(rng.randint(1, 6))]
        d.on_request_start(rid, prompt, scope=scope)
        model.start(rid, prompt, scope)
        live.append(rid)
    elif rng.random() < 0.02:
        rid = live.pop(rng.randrange(len(live)))
        d.on_request_finish(rid)
        model.finish(rid)
    else:  # repetitive enough that runs recur and prunes come
        rid, tokens = rng.choice(live), [rng.randrange(8) for _ in range(rng.randint(1, 4))]
        d.on_tokens_accepted(rid, tokens)
        model.accept(rid, tokens)


@pytest.mark.parametrize("seed", [7, 8])
def test_runs_counted_as_tokens_arrive_equal_walks_from_the_root(seed: int) -> None:
    rng = random.Random(seed)
    d = TrieDrafter(DraftConfig(method="lookahead", branch_length=5, trie_capacity=150, trie_max_scopes=2))
    model = _Model(branch=5, capacity=150, max_scopes=2)
    live: list[str] = []
    halved = drops = last = 0
    for event in range(3000):
        _random_event(rng, event, live, d, model)
        assert d.stats()["scopes"] == list(model.tries)
        for scope in SCOPES:
            got, root = d.trie_counts(scope), model.tries.get(scope)
            assert (got is None) == (root is None), scope
            if got is not None and root is not None:
                assert list(got.items()) == list(_counts(root).items()), scope  # creation order too
                halved += any(c != int(c) for c in got.values())
        assert d.num_nodes == sum(_size(t) for t in model.tries.values())
        assert all(_size(t) <= 150 for t in model.tries.values())
        drops += d.num_nodes < last
        last = d.num_nodes
    assert model.prunes > 5 and halved > 0 and drops > 5  # prunes happened on the way
    assert model.over_scopes > 0  # and idle scopes went for the scope cap
