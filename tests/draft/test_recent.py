"""Copy chains from outputs a scope finished recently: repeats drafted at any depth, scopes kept apart, bounded."""

from __future__ import annotations

from batchserve.config import DraftConfig
from batchserve.draft.recent import SEPARATOR, RecentOutputs, copy_chain
from batchserve.draft.token_index import TokenIndex
from batchserve.draft.trie import TrieDrafter
from tests.engine.drafters import token_path

ANSWER = list(range(200, 230))  # a 30-token output


def _drafter(**kw) -> TrieDrafter:
    kw.setdefault("branch_length", 6)
    kw.setdefault("own_branch_length", 24)
    return TrieDrafter(DraftConfig(**kw))


def _finish(d: TrieDrafter, rid: str, prompt: list[int], output: list[int], scope: str | None = "") -> None:
    d.on_request_start(rid, prompt, scope=scope)
    d.on_tokens_accepted(rid, output)
    d.on_request_finish(rid)


def test_a_repeated_answer_is_drafted_past_the_output_tries_depth():
    d = _drafter()
    _finish(d, "first", [1, 2, 3], ANSWER)
    d.on_request_start("again", [1, 2, 3])
    d.on_tokens_accepted("again", ANSWER[:4])
    tree = d.propose("again", [1, 2, 3, *ANSWER[:4]], 32)
    # 4 tokens of match: 8 tokens copied in one path, where the trie's runs of 6 give at most 5.
    assert tree is not None and tree.match == 4
    assert tree.tokens[:8] == tuple(ANSWER[4:12]) and tree.parents[:8] == (None, 0, 1, 2, 3, 4, 5, 6)
    assert tree.scores[:8] == (1.0,) * 8
    off = _drafter(recent_output_tokens=0)
    _finish(off, "first", [1, 2, 3], ANSWER)
    off.on_request_start("again", [1, 2, 3])
    off.on_tokens_accepted("again", ANSWER[:4])
    tree = off.propose("again", [1, 2, 3, *ANSWER[:4]], 32)
    assert tree is not None and max(len(token_path(tree, i)) for i in range(len(tree))) <= 5


def test_recent_outputs_stay_in_their_scope_and_never_hold_a_prompt():
    d = _drafter()
    prompt = list(range(500, 540))
    _finish(d, "a", prompt, ANSWER, scope="tenant-a")
    _finish(d, "private", prompt, [7, 8, 9], scope=None)  # no scope: shares nothing
    assert d.recent.copy("tenant-b", ANSWER[:6], 32) == (0, [])
    assert d.recent.copy("tenant-a", ANSWER[:6], 32)[0] == 6
    assert d.recent.copy("tenant-a", prompt[:6], 32)[0] == 0  # the prompt was never kept
    assert d.recent.num_tokens == len(ANSWER) + 1  # one output and its separator
    d.on_request_start("b", [1, 2], scope="tenant-b")
    d.on_tokens_accepted("b", ANSWER[:5])
    tree = d.propose("b", [1, 2, *ANSWER[:5]], 16)
    assert tree is None or tree.match < 5  # tenant-a's answer is no draft of tenant-b's


def test_a_copy_stops_at_the_end_of_an_output():
    index = TokenIndex([1, 2, 3, 4, 5, SEPARATOR, 9, 9, 9, SEPARATOR], 24)
    m, chain = copy_chain(index, [7, 1, 2, 3], 32)
    assert m == 3 and [t for t, _ in chain] == [4, 5]  # 6 asked for, the output ended after 2
    assert copy_chain(index, [7, 2, 3, 4, 5], 32) == (4, [])  # the match ends an output: nothing follows


def test_recent_outputs_are_bounded_oldest_first_least_recent_scope_first():
    recent = RecentOutputs(capacity=100, depth=24)
    for i in range(10):
        recent.add("old", [1000 + i] * 9)
    recent.add("new", list(range(40)))
    assert recent.num_tokens <= 100
    for i in range(30):  # every add keeps the bound; the newest outputs stay
        recent.add("new", [2000 + i] * 19)
        assert recent.num_tokens <= 100
    assert recent.copy("new", [2029] * 5, 32)[0] == 5
    assert recent.copy("old", [1000] * 5, 32)[0] == 0  # the least recently used scope went first
    recent.add("new", list(range(500)))  # longer than the bound: its last tokens are kept
    assert recent.num_tokens <= 100 and recent.copy("new", [496, 497, 498], 32)[0] == 3
    recent.drop("new")
    assert recent.num_tokens == sum(t.size for t in recent._texts.values())
    none = RecentOutputs(capacity=0, depth=24)
    none.add("", ANSWER)
    assert none.num_tokens == 0 and none.copy("", ANSWER[:5], 32) == (0, [])
