"""Copy chains from outputs a scope finished recently, seen only through TrieDrafter's public API.

A request repeating an earlier answer drafts it at any depth, past the output trie's; a request
repeating an earlier prompt of its scope copies that output from its first token while it agrees;
a copy stops at the end of an output; the copy chain is what a brute-force search of the scope's
kept text (`recent_text`) finds. Scopes are kept apart: a request with no scope reads and adds
nothing, prompts are never kept, a finished request's own text leaves no trace. The kept outputs
are bounded in tokens per scope: a scope over its bound loses its own oldest half, never another
scope's outputs. Where a test needs the copy chain alone it drafts with `_copier`: its trie runs are
2 tokens and its shortest match key 2, so neither the output trie nor the own text expands a match
and a proposal is the copy chain and nothing else (`_copy` reads one as the old `copy` did).
"""

from __future__ import annotations

import random
from collections import Counter
from itertools import accumulate
from operator import mul
from typing import Any

from batchserve.config import DraftConfig
from batchserve.draft.trie import TrieDrafter
from batchserve.trees import MATCH_CAP
from tests.engine.drafters import token_path

ANSWER = list(range(200, 230))  # a 30-token output
SEP = -1  # between two outputs in `recent_text`
# The copy chain's rules the oracle restates: tokens drafted per token of match, the shortest match
# copied, the most recent occurrences looked at.
COPY_PER_MATCH, COPY_MIN_MATCH, MAX_OCCURRENCES = 2, 3, 256
Chain = list[tuple[int, float]]  # (token, share among the occurrences still agreeing)


def _drafter(**kw: Any) -> TrieDrafter:
    kw.setdefault("branch_length", 6)
    kw.setdefault("own_branch_length", 24)
    return TrieDrafter(DraftConfig(**kw))


def _copier(**kw: Any) -> TrieDrafter:
    """A drafter whose proposals are the copy chain alone (see the module docstring)."""
    return _drafter(branch_length=2, min_match=2, **kw)


def _finish(d: TrieDrafter, rid: str, prompt: list[int], output: list[int], scope: str | None = "") -> None:
    d.on_request_start(rid, prompt, scope=scope)
    d.on_tokens_accepted(rid, output)
    d.on_request_finish(rid)


def _copy(d: TrieDrafter, scope: str | None, prompt: list[int]) -> tuple[int, Chain]:
    """(match, chain) a `_copier` drafts for a new request of `scope` with this prompt; (0, []): none."""
    d.on_request_start("probe", prompt, scope=scope)
    tree = d.propose("probe", prompt, 1000)
    d.on_request_finish("probe")  # it accepted nothing: it adds nothing
    if tree is None:
        return 0, []
    assert tree.parents == (None, *range(len(tree) - 1))  # one chain from the root
    return tree.match, list(zip(tree.tokens, tree.scores))


def test_a_repeated_answer_is_drafted_past_the_output_tries_depth() -> None:
    d = _drafter()
    _finish(d, "first", [1, 2, 3], ANSWER)
    d.on_request_start("again", [4, 5, 6])  # another prompt: its output has to match first
    d.on_tokens_accepted("again", ANSWER[:4])
    tree = d.propose("again", [4, 5, 6, *ANSWER[:4]], 32)
    # 4 tokens of match: 8 tokens copied in one path, where the trie's runs of 6 give at most 5.
    assert tree is not None and tree.match == 4
    assert tree.tokens[:8] == tuple(ANSWER[4:12]) and tree.parents[:8] == (None, 0, 1, 2, 3, 4, 5, 6)
    assert tree.scores[:8] == (1.0,) * 8
    off = _drafter(recent_output_tokens=0)
    _finish(off, "first", [1, 2, 3], ANSWER)
    off.on_request_start("again", [4, 5, 6])
    off.on_tokens_accepted("again", ANSWER[:4])
    tree = off.propose("again", [4, 5, 6, *ANSWER[:4]], 32)
    assert tree is not None and max(len(token_path(tree, i)) for i in range(len(tree))) <= 5


def test_recent_outputs_stay_in_their_scope_and_never_hold_a_prompt() -> None:
    d = _drafter()
    prompt = list(range(500, 540))
    _finish(d, "a", prompt, ANSWER, scope="tenant-a")
    _finish(d, "private", prompt, [7, 8, 9], scope=None)  # no scope: shares nothing
    assert d.recent_text("tenant-a") == [*ANSWER, SEP] and d.recent_text("tenant-b") is None
    assert d.recent_text("") is None and d.stats()["recent_scopes"] == ["tenant-a"]
    d.on_request_start("b", ANSWER[:6], scope="tenant-b")
    assert d.propose("b", ANSWER[:6], 32) is None  # tenant-a's answer is nothing to tenant-b
    d.on_request_start("a2", ANSWER[:6], scope="tenant-a")
    tree = d.propose("a2", ANSWER[:6], 32)  # 6 tokens of match: 12 copied
    assert tree is not None and tree.match == 6 and tree.tokens[:12] == tuple(ANSWER[6:18])
    assert tree.parents[:12] == (None, *range(11))
    d.on_request_start("a3", prompt[:6], scope="tenant-a")
    assert d.propose("a3", prompt[:6], 32) is None  # the prompt was never kept
    for rid in ("b", "a2", "a3"):
        d.on_request_finish(rid)
    assert d.stats()["recent_tokens"] == len(ANSWER) + 1  # one output and its separator
    d.on_request_start("b", [1, 2], scope="tenant-b")
    d.on_tokens_accepted("b", ANSWER[:5])
    tree = d.propose("b", [1, 2, *ANSWER[:5]], 16)
    assert tree is None or tree.match < 5  # tenant-a's answer is no draft of tenant-b's


def test_a_copy_stops_at_the_end_of_an_output() -> None:
    copier, d = _copier(), _drafter()
    for drafter in (copier, d):
        _finish(drafter, "r", [0], [1, 2, 3, 4, 5])
        _finish(drafter, "r", [0], [9, 9, 9])
        assert drafter.recent_text("") == [1, 2, 3, 4, 5, SEP, 9, 9, 9, SEP]
    assert _copy(copier, "", [7, 1, 2, 3]) == (3, [(4, 1.0), (5, 1.0)])  # 6 asked for, the output ended after 2
    assert _copy(copier, "", [7, 2, 3, 4, 5]) == (0, [])  # the match ends an output: nothing follows
    # That match (4 tokens) is measured all the same; the tree is only what followed 5 in the own text.
    d.on_request_start("q", [5, 8, 7, 2, 3, 4, 5])
    tree = d.propose("q", [5, 8, 7, 2, 3, 4, 5], 32)
    assert tree is not None and tree.match == 4 and tree.tokens == (8, 7, 2, 3, 4, 5)


def test_recent_outputs_are_bounded_per_scope_oldest_first() -> None:
    d = _copier(recent_output_tokens=100, trie_max_scopes=3)
    for i in range(10):
        _finish(d, "r", [0], list(range(1000 + 10 * i, 1009 + 10 * i)), scope="old")  # 9 tokens each
    old = d.recent_text("old")
    assert old is not None and len(old) == 100
    _finish(d, "r", [0], list(range(40)), scope="new")
    for i in range(30):  # every add keeps the scope's bound; the newest outputs stay
        _finish(d, "r", [0], list(range(2000 + 20 * i, 2019 + 20 * i)), scope="new")
        assert len(d.recent_text("new") or ()) <= 100
        assert d.recent_text("old") == old  # another scope's outputs never trim it
    newest = list(range(2580, 2599))
    assert _copy(d, "new", newest[:5]) == (5, [(t, 1.0) for t in newest[5:15]])
    assert _copy(d, "old", list(range(1000, 1005))) == (5, [(t, 1.0) for t in range(1005, 1009)])
    assert d.stats()["recent_tokens"] == 100 + len(d.recent_text("new") or ())
    _finish(d, "r", [0], list(range(500)), scope="new")  # longer than the bound: its last tokens are kept
    assert d.recent_text("new") == [*range(401, 500), SEP] and d.recent_text("old") == old
    assert _copy(d, "new", [496, 497, 498]) == (3, [(499, 1.0)])
    # The count of scopes is the one shared bound, counted 2Q's way (3 scopes: 1 on probation,
    # 2 proven). One-off scopes churn the probation place and never evict a scope that came back:
    _finish(d, "r", [0], [1], scope="x")
    _finish(d, "r", [0], [2], scope="y")  # "x" goes
    assert d.stats()["scopes"] == ["old", "new", "y"] and d.recent_text("x") is None
    assert d.recent_text("old") == old and d.recent_text("new") == [*range(401, 500), SEP]
    # A third scope that comes back (a second request ends in it) evicts the least recently used
    # proven one, its recent outputs with it.
    _finish(d, "r", [0], [3], scope="y")
    assert d.stats()["scopes"] == ["new", "y"] and d.recent_text("old") is None
    assert d.stats()["recent_tokens"] == 100 + 4 and d.stats()["recent_scopes"] == ["new", "y"]
    assert _copy(d, "old", list(range(1000, 1005))) == (0, [])
    none = _copier(recent_output_tokens=0)
    _finish(none, "r", [0], ANSWER)
    assert none.stats()["recent_tokens"] == 0 and none.stats()["recent_scopes"] == []
    assert none.recent_text("") is None and _copy(none, "", ANSWER[:5]) == (0, [])


def test_a_repeated_prompt_copies_the_earlier_answer_from_its_first_token_while_it_agrees() -> None:
    d = _drafter(own_branch_length=8)
    prompt = [1, 2, 3, 4]
    _finish(d, "first", prompt, ANSWER)
    d.on_request_start("again", prompt)
    tree = d.propose("again", prompt, 16)  # no output yet: no suffix of it was ever an output
    assert tree is not None and tree.match == MATCH_CAP and tree.tokens == tuple(ANSWER[:8])
    assert tree.parents == (None, *range(7)) and tree.scores == (1.0,) * 8
    d.on_tokens_accepted("again", ANSWER[:10])
    tree = d.propose("again", [*prompt, *ANSWER[:10]], 16)
    assert tree is not None and tree.match == MATCH_CAP and tree.tokens[:8] == tuple(ANSWER[10:18])
    d.on_tokens_accepted("again", [7])  # its output leaves the earlier one: nothing to copy, no match
    assert d.propose("again", [*prompt, *ANSWER[:10], 7], 16) is None
    # An output only grows: once it left the earlier answer it never copies it as a repeat again.
    # Agreeing with it later is a suffix match: 5 tokens, 10 copied (8, the depth).
    d.on_tokens_accepted("again", ANSWER[11:16])
    tree = d.propose("again", [*prompt, *ANSWER[:10], 7, *ANSWER[11:16]], 16)
    assert tree is not None and tree.match == 5 and tree.tokens[:8] == tuple(ANSWER[16:24])
    d.on_request_start("other", [9, *prompt])  # another prompt: nothing to copy before its output
    assert d.propose("other", [9, *prompt], 16) is None


def test_a_trimmed_output_is_no_repeat_source() -> None:
    d = _copier(recent_output_tokens=40, own_branch_length=8)
    _finish(d, "r", [1], ANSWER[:15])
    _finish(d, "r", [2], ANSWER[15:])
    assert _copy(d, "", [1]) == (MATCH_CAP, [(t, 1.0) for t in ANSWER[:8]])
    _finish(d, "r", [3], [5] * 20)  # over the bound: the first output goes
    assert d.recent_text("") == [*ANSWER[15:], SEP, *[5] * 20, SEP]
    assert _copy(d, "", [1]) == (0, [])
    assert _copy(d, "", [2]) == (MATCH_CAP, [(t, 1.0) for t in ANSWER[15:23]])


def _oracle(text: list[int], key: list[int], depth: int) -> tuple[int, Chain, int]:
    """Brute force: (m, chain, occurrences) a request whose text ends with `key` copies from `text`."""
    key = key[-MATCH_CAP:]
    agree = {}  # where an occurrence ends (a token after it) -> tokens agreeing back from there
    for p in range(len(text) - 1):
        k = 0
        while k < len(key) and k <= p and text[p - k] == key[-1 - k]:
            k += 1
        agree[p] = k
    m = max(agree.values(), default=0)
    if m < COPY_MIN_MATCH:
        return m, [], 0
    found = [p + 1 for p in sorted(agree) if agree[p] == m]
    after, chain = found[-MAX_OCCURRENCES:], []
    for i in range(after[-1], min(len(text), after[-1] + min(COPY_PER_MATCH * m, depth))):
        share = 1.0
        if len(after) > 1:  # one occurrence left: it is the copy, every share 1
            going = [a for a in after if a < len(text)]
            after = [a + 1 for a in going if text[a] == text[i]]
            share = len(after) / len(going)
        if text[i] == SEP:
            break
        chain.append((text[i], share))
    return m, chain, len(found)


def _accepted(rng: random.Random, outputs: list[list[int]], vocab: int) -> list[int]:
    """What a request accepts: mostly a run of an earlier output (a copy), at times changed at its end."""
    if rng.random() < 0.15:
        return [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
    out = rng.choice(outputs)
    start = rng.randrange(len(out))
    run = out[start : start + rng.randint(1, 45)]
    return [*run, *(rng.randrange(vocab) for _ in range(rng.randint(1, 3) if rng.random() < 0.3 else 0))]


def test_the_copy_chain_is_what_a_brute_force_search_of_the_kept_outputs_finds() -> None:
    seen: Counter[str] = Counter()
    for seed in range(8):
        rng = random.Random(seed)
        vocab, depth = rng.choice([2, 3, 6]), rng.choice([6, 16, 64])
        d = _copier(own_branch_length=depth)
        outputs: list[list[int]] = []
        for i in range(rng.randint(3, 8)):
            if outputs and rng.random() < 0.4:  # a long copy of an earlier output, its end changed
                out = [*rng.choice(outputs), *(rng.randrange(vocab) for _ in range(rng.randint(0, 5)))]
            else:
                longest = 4000 if i == 0 and seed % 4 == 0 else 70  # one long output: keys recur hundreds of times
                out = [rng.randrange(vocab) for _ in range(rng.randint(1, longest))]
            outputs.append(out)
            _finish(d, "done", [1000 + i], out, scope="s")
        assert d.recent_text("s") == [t for out in outputs for t in (*out, SEP)]
        for case in range(25):
            accepted = _accepted(rng, outputs, vocab)
            text = [2000 + case, *accepted]  # its prompt: a token no output or other prompt holds
            kept = d.recent_text("s")
            assert kept is not None
            m, chain, many = _oracle(kept, text, depth)
            own_m, own_chain, _ = _oracle(text, text, depth)  # the request's own text wins a tie
            if own_m >= m:
                m, chain, many = own_m, own_chain, 0
            d.on_request_start("q", text[:1], scope="s")
            d.on_tokens_accepted("q", accepted)
            tree = d.propose("q", text, 10_000)
            d.on_request_finish("q")  # its output is kept: the next case searches it too
            if not chain:
                assert tree is None
                seen["nothing"] += 1
                continue
            assert tree is not None and tree.match == m
            assert tree.tokens == tuple(t for t, _ in chain) and tree.parents == (None, *range(len(chain) - 1))
            assert tree.scores == tuple(accumulate((s for _, s in chain), mul))
            seen["own"] += many == 0
            seen["recent"] += many > 0
            seen["shared"] += many > 0 and min(s for _, s in chain) < 1
            seen["past 256 occurrences"] += many > MAX_OCCURRENCES
            seen["at a separator"] += many > 0 and len(chain) < min(COPY_PER_MATCH * m, depth)
            seen["at the depth"] += len(chain) == depth < COPY_PER_MATCH * m
            seen["capped match"] += m == MATCH_CAP
    assert len(seen) == 8 and min(seen.values()) >= 2, seen  # every branch of the rules was exercised


def test_no_scope_sees_another_scopes_outputs_or_any_prompt_and_a_finished_request_leaves_no_trace() -> None:
    rng = random.Random(7)
    d = _drafter()
    low = {"A": 1000, "B": 2000, None: 3000}  # each scope's outputs draw from their own tokens
    d.on_request_start("bystander", list(range(8000, 8010)), scope="A")
    d.on_tokens_accepted("bystander", [1000, 1001])
    base = d.stats()["indexed_tokens"]
    kept: dict[str | None, list[int]] = {"A": [], "B": []}
    prompts: list[list[int]] = []
    for i in range(30):
        scope = rng.choice(list(low))
        prompt = list(range(5000 + 100 * i, 5000 + 100 * i + rng.randint(2, 40)))  # no output holds these
        output = [low[scope] + rng.randrange(20) for _ in range(rng.randint(1, 30))]
        d.on_request_start("r", prompt, scope=scope)
        d.on_tokens_accepted("r", output)
        assert d.stats()["indexed_tokens"] == base + len(prompt) + len(output)
        d.on_request_finish("r")
        assert d.stats()["indexed_tokens"] == base and d.stats()["requests"] == 1  # no trace of its own text
        if scope is not None:
            kept[scope] += [*output, SEP]
        for s in ("A", "B"):  # exactly its own outputs: no other scope's, none of no scope, no prompt
            assert d.recent_text(s) == (kept[s] or None)
        assert set(d.stats()["recent_scopes"]) == {s for s in kept if kept[s]}
        assert d.recent_text("") is None
        prompts.append(prompt)
    for prompt in prompts:  # whatever scope asks, no draft and no match holds a finished request's prompt
        for scope in low:
            d.on_request_start("probe", prompt[: len(prompt) // 2], scope=scope)
            assert d.propose("probe", prompt[: len(prompt) // 2], 64) is None
            assert d.match_length("probe", prompt[: len(prompt) // 2]) == 0
            d.on_request_finish("probe")
    alone = _drafter()
    _finish(alone, "private", [1, 2, 3], ANSWER, scope=None)
    stats = alone.stats()
    assert stats["recent_tokens"] == 0 and stats["recent_scopes"] == [] and stats["scopes"] == []
    assert stats["nodes"] == 0 and stats["indexed_tokens"] == 0 and alone.recent_text("") is None


def test_each_scopes_recent_outputs_stay_within_its_bound_whatever_the_others_do() -> None:
    rng = random.Random(3)
    cap = 50
    d = _drafter(recent_output_tokens=cap)
    scopes = [f"t{i}" for i in range(5)]
    last: dict[str, int] = {}  # scope -> when it last finished an output
    kept: dict[str, list[int] | None] = dict.fromkeys(scopes)
    for i in range(200):
        scope = rng.choice(scopes)
        output = [rng.randrange(100) for _ in range(rng.randint(1, 80))]
        _finish(d, "r", [9000 + i], output, scope=scope)
        last[scope] = i
        before, kept = kept, {s: d.recent_text(s) for s in scopes}
        assert all(kept[s] == before[s] for s in scopes if s != scope)  # the others' outputs untouched
        stats = d.stats()
        assert all(len(text or ()) <= cap for text in kept.values())
        assert stats["recent_tokens"] == sum(len(kept[s] or ()) for s in stats["recent_scopes"])
        assert [s for s in scopes if kept[s] is not None] == sorted(stats["recent_scopes"])
        assert stats["recent_scopes"] == sorted(stats["recent_scopes"], key=last.__getitem__)  # by last use
        tail = output[-(cap - 1) :]  # the newest output (its last cap - 1 tokens) is always kept whole
        text = kept[scope]
        assert text is not None and text[-len(tail) - 1 :] == [*tail, SEP]
        for text in kept.values():  # whole outputs only: the oldest half goes, never part of one
            assert text is None or (text[0] != SEP and text[-1] == SEP)
