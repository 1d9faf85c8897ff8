"""Copy chains from outputs a scope finished recently: repeats drafted at any depth, scopes kept apart, bounded."""

from __future__ import annotations

from batchserve.config import DraftConfig
from batchserve.draft.recent import SEPARATOR, RecentOutputs, copy_chain
from batchserve.draft.token_index import TokenIndex
from batchserve.draft.tree import MATCH_CAP
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


def test_recent_outputs_stay_in_their_scope_and_never_hold_a_prompt():
    d = _drafter()
    prompt = list(range(500, 540))
    _finish(d, "a", prompt, ANSWER, scope="tenant-a")
    _finish(d, "private", prompt, [7, 8, 9], scope=None)  # no scope: shares nothing
    d.on_request_start("b", [5], scope="tenant-b")
    assert d.recent.copy("b", ANSWER[:6], 32) == (0, [])
    d.on_request_start("a2", [5], scope="tenant-a")
    assert d.recent.copy("a2", ANSWER[:6], 32)[0] == 6
    assert d.recent.copy("a2", prompt[:6], 32)[0] == 0  # the prompt was never kept
    d.on_request_finish("b")
    d.on_request_finish("a2")
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


def _add(recent: RecentOutputs, scope: str, output: list[int], prompt: tuple[int, ...] = (0,)) -> None:
    recent.begin("r", scope, prompt)
    recent.end("r", output)


def test_recent_outputs_are_bounded_oldest_first_least_recent_scope_first():
    recent = RecentOutputs(capacity=100, depth=24)
    for i in range(10):
        _add(recent, "old", [1000 + i] * 9)
    _add(recent, "new", list(range(40)))
    assert recent.num_tokens <= 100
    for i in range(30):  # every add keeps the bound; the newest outputs stay
        _add(recent, "new", [2000 + i] * 19)
        assert recent.num_tokens <= 100
    recent.begin("q", "new", (5,))
    assert recent.copy("q", [2029] * 5, 32)[0] == 5
    recent.begin("q", "old", (5,))
    assert recent.copy("q", [1000] * 5, 32)[0] == 0  # the least recently used scope went first
    _add(recent, "new", list(range(500)))  # longer than the bound: its last tokens are kept
    recent.begin("q", "new", (5,))
    assert recent.num_tokens <= 100 and recent.copy("q", [496, 497, 498], 32)[0] == 3
    recent.drop("new")
    assert recent.num_tokens == 0 and recent.copy("q", [496, 497, 498], 32) == (0, [])
    none = RecentOutputs(capacity=0, depth=24)
    _add(none, "", ANSWER)
    none.begin("q", "", (0,))
    assert none.num_tokens == 0 and none.copy("q", ANSWER[:5], 32) == (0, [])


def test_a_repeated_prompt_copies_the_earlier_answer_from_its_first_token_while_it_agrees():
    d = _drafter(own_branch_length=8)
    prompt = [1, 2, 3, 4]
    _finish(d, "first", prompt, ANSWER)
    d.on_request_start("again", prompt)
    tree = d.propose("again", prompt, 16)  # no output yet: no suffix of it was ever an output
    assert tree is not None and tree.match == MATCH_CAP and tree.tokens[:8] == tuple(ANSWER[:8])
    d.on_tokens_accepted("again", ANSWER[:10])
    tree = d.propose("again", [*prompt, *ANSWER[:10]], 16)
    assert tree.match == MATCH_CAP and tree.tokens[:8] == tuple(ANSWER[10:18])
    d.on_tokens_accepted("again", [7])  # its output leaves the earlier one: a suffix match takes over
    tree = d.propose("again", [*prompt, *ANSWER[:10], 7], 16)
    assert tree is None or tree.match < MATCH_CAP
    assert d.recent.copy("again", [*prompt, *ANSWER[:10], 7], MATCH_CAP)[0] == 0
    assert d.recent._running["again"].repeat is None  # not compared again, step after step
    d.on_request_start("other", [9, *prompt])  # another prompt: nothing to copy before its output
    assert d.recent.copy("other", [9, *prompt], MATCH_CAP) == (0, [])


def test_a_trimmed_output_is_no_repeat_source():
    recent = RecentOutputs(capacity=40, depth=8)
    _add(recent, "", ANSWER[:15], prompt=(1,))
    _add(recent, "", ANSWER[15:], prompt=(2,))
    recent.begin("q", "", (1,))
    assert recent.copy("q", [1], 32)[0] == MATCH_CAP
    _add(recent, "", [5] * 20, prompt=(3,))  # over the bound: the first output goes
    recent.begin("q", "", (1,))
    assert recent.copy("q", [1], 32) == (0, [])
    recent.begin("q", "", (2,))
    assert recent.copy("q", [2], 32) == (MATCH_CAP, [(t, 1.0) for t in ANSWER[15:23]])
