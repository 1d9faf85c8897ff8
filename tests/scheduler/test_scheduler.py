"""Scheduler and block allocator without a model: a fake runner plays the model."""

from __future__ import annotations

import pytest

from batchserve.config import DraftConfig, SchedulerConfig
from batchserve.draft import NoDrafter
from batchserve.records import RunnerOutput, SchedulerOutput
from batchserve.request import FinishReason, Request, RequestStatus, SamplingParams
from batchserve.scheduler import BlockAllocator, NoFreeBlocksError
from batchserve.speculation.budget import AcceptanceTracker, DraftBudgetPolicy
from batchserve.trees import DraftTree
from tests.scheduler.drafting import DraftingScheduler
from tests.speculation.workloads import cpu_like, gpu_like


def _req(rid: str, n_prompt: int, max_new: int = 8, **kw) -> Request:
    return Request(
        rid,
        list(range(1, n_prompt + 1)),
        SamplingParams(max_new_tokens=max_new, **kw),
        frozenset([0]),
        max_total_len=4096,
    )


class ChainDrafter(NoDrafter):
    def __init__(self, n: int) -> None:
        self.n = n
        self.events: list[tuple[str, str]] = []
        self.proposed: list[str] = []  # request ids, one per proposal

    def on_request_start(self, request_id, prompt_token_ids, layout=None, scope="", window=None, references=()):
        self.events.append(("start", request_id))

    def on_request_finish(self, request_id):
        self.events.append(("finish", request_id))

    def propose(self, request_id, token_ids, max_tokens):
        self.proposed.append(request_id)
        return DraftTree.chain([7] * min(self.n, max_tokens)) if max_tokens else None


def _sched(
    num_blocks=64, block_size=4, max_num_seqs=4, budget=64, drafter=None, decoding_length=4
) -> DraftingScheduler:
    return DraftingScheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        DraftConfig(decoding_length=decoding_length),
        BlockAllocator(num_blocks, block_size),
        drafter or NoDrafter(),
    )


def _fake_run(out: SchedulerOutput, accept_all: bool = False) -> RunnerOutput:
    emitted, accepted = {}, {}
    for r in out.requests:
        if r.sample:
            n = len(r.draft) if (accept_all and r.draft is not None) else 0
            emitted[r.request_id] = [7] * n + [5]
            accepted[r.request_id] = list(range(n))  # a chain: node i is the i-th token
    return RunnerOutput(emitted, accepted)


def test_allocator_refcounts_and_integrity():
    a = BlockAllocator(4, 16)
    x = a.allocate(3)
    assert a.num_free_blocks == 1 and a.blocks_for(17) == 2
    a.free(x[1:])
    assert a.num_free_blocks == 3 and a.ref_count(x[0]) == 1
    a.check_integrity([x[:1]])
    a.free(x[:1])
    a.check_integrity([])
    with pytest.raises(ValueError, match="double free"):
        a.free(x[:1])
    with pytest.raises(NoFreeBlocksError):
        a.allocate(5)
    with pytest.raises(AssertionError):
        a.check_integrity([[0]])  # an owner claims a block the allocator thinks is free


def test_admission_respects_max_num_seqs_and_chunks_long_prompts():
    s = _sched(max_num_seqs=2, budget=16)
    for i, n in enumerate([40, 3, 3]):
        s.add_request(_req(f"r{i}", n))
    out = s.schedule()
    # r0's 40-token prompt takes the whole 16-token budget; nobody else fits this step.
    assert [(r.request_id, len(r.token_ids), r.sample) for r in out.requests] == [("r0", 16, False)]
    s.update(out, _fake_run(out))
    out = s.schedule()
    assert [(r.request_id, len(r.token_ids), r.sample) for r in out.requests] == [("r0", 16, False)]
    s.update(out, _fake_run(out))
    out = s.schedule()
    # Last chunk of r0 (8 tokens) and r1's prompt; r2 waits: max_num_seqs is 2.
    assert [(r.request_id, len(r.token_ids), r.sample) for r in out.requests] == [("r0", 8, True), ("r1", 3, True)]
    assert s.num_running == 2 and s.num_waiting == 1
    s.update(out, _fake_run(out))
    s.check_integrity()


def test_request_runs_to_max_new_tokens_and_frees_everything():
    drafter = ChainDrafter(3)
    s = _sched(drafter=drafter)
    s.add_request(_req("a", 5, max_new=10))
    while s.has_work():
        out = s.schedule()
        for r in out.requests:
            if r.draft is not None:
                # The draft never runs past max_new_tokens: output + draft + bonus <= 10.
                assert len(s.requests["a"].output_token_ids) + len(r.draft) + 1 <= 10
        events = s.update(out, _fake_run(out, accept_all=True))
        s.check_integrity()
    req = events[0][0]
    assert req.finish_reason is FinishReason.LENGTH and len(req.output_token_ids) == 10
    assert req.stats.steps == 3 and req.stats.draft_tokens_accepted == 7  # 4 + 4 + 2 tokens
    assert s.allocator.num_free_blocks == s.allocator.num_blocks
    assert drafter.events == [("start", "a"), ("finish", "a")]


def test_eos_and_stop_ids_truncate_accepted_tokens():
    s = _sched(drafter=ChainDrafter(4))
    s.add_request(_req("a", 3, max_new=50, stop_token_ids=(7,)))
    out = s.schedule()
    events = s.update(out, _fake_run(out, accept_all=True))  # emits 7 7 7 7 5: stops at the first 7
    req, toks = events[0]
    assert toks == [7] and req.finish_reason is FinishReason.STOP_SEQUENCE


def test_abort_frees_blocks_between_steps_and_running_step_result_is_ignored():
    s = _sched()
    s.add_request(_req("a", 10))
    s.add_request(_req("b", 10))
    out = s.schedule()
    assert s.abort("a") and not s.abort("a")
    events = s.update(out, _fake_run(out))
    assert [r.request_id for r, _ in events] == ["b"]
    s.check_integrity()
    assert s.schedule().finished_request_ids == ("a",)


def test_preemption_takes_the_youngest_and_resumes_it():
    # 6 blocks of 4 slots. Two requests of 8-token prompts take 2 blocks each (plus 1 each to grow).
    s = _sched(num_blocks=6, block_size=4, budget=64)
    s.add_request(_req("old", 8, max_new=12))
    s.add_request(_req("young", 8, max_new=12))
    young = s.requests["young"]
    while s.has_work():
        out = s.schedule()
        if young.stats.num_preemptions and young.status is RequestStatus.WAITING:
            assert young.num_computed_tokens == 0 and not young.block_ids  # its K/V dropped whole
        for r, _ in s.update(out, _fake_run(out)):
            if r.is_finished:
                assert r.finish_reason is FinishReason.LENGTH and len(r.output_token_ids) == 12
        s.check_integrity()
    # The youngest was preempted (never the oldest), and resumed to the end.
    assert s.num_preemptions >= 1 and young.stats.num_preemptions == s.num_preemptions
    assert young.is_finished and len(young.output_token_ids) == 12
    assert s.allocator.num_free_blocks == 6


def test_draft_dropped_before_anyone_is_preempted():
    # Two running requests; after both prompts, the pool holds both roots but not a tree.
    # 4 blocks of 4 slots: each 7-token prompt (+1 token) fills 2 blocks exactly.
    drafter = ChainDrafter(4)
    s = _sched(num_blocks=4, block_size=4, drafter=drafter, decoding_length=4)
    s.add_request(_req("a", 7, max_new=8))
    s.add_request(_req("b", 7, max_new=8))
    first = s.schedule()  # both prompts, each with a 4-token tree that would need a third block
    assert [r.request_id for r in first.requests] == ["a", "b"]
    assert all(r.sample and r.draft is None for r in first.requests)  # proposed, then dropped
    assert drafter.proposed == ["a", "b"]
    assert s.num_preemptions == 0 and s.num_running == 2
    s.update(first, _fake_run(first))
    s.check_integrity()


def test_request_that_can_never_fit_is_refused():
    s = _sched(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV cache"):
        s.add_request(_req("big", 10, max_new=10))
    assert not s.has_work()
    s.add_request(_req("ok", 10, max_new=6))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(_req("ok", 2))


# ---- with a draft budget policy -----------------------------------------------------------------


class WideDrafter(NoDrafter):
    """Proposes `max_tokens` nodes: a root child 10 with a chain below it, then siblings."""

    def propose(self, request_id, token_ids, max_tokens):
        n = min(max_tokens, 32)
        tokens = [10 + i for i in range(n)]
        parents: list[int | None] = [None] + [i - 1 if i < n // 2 else None for i in range(1, n)]
        return DraftTree(tuple(tokens), tuple(parents)) if n else None


class CountingDrafter(WideDrafter):
    def __init__(self) -> None:
        self.asked: list[int] = []

    def propose(self, request_id, token_ids, max_tokens):
        self.asked.append(max_tokens)
        return super().propose(request_id, token_ids, max_tokens)


@pytest.mark.parametrize("shadow", [0, 4])
def test_scheduler_proposes_only_what_the_policy_could_give(shadow: int):
    tracker = AcceptanceTracker(32)
    drafter = CountingDrafter()
    s = DraftingScheduler(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256),
        DraftConfig(decoding_length=32, adaptive=True, shadow_draft=shadow),
        BlockAllocator(256, 4),
        drafter,
        budget_policy=DraftBudgetPolicy(gpu_like(cdl=16), tracker, min_gain=0.2),
    )
    s.add_request(_req("silenced", 3, 200))
    s.add_request(_req("good", 3, 200))
    for _ in range(50):
        tracker.observe("silenced", 32, [])  # every draft rejected
        tracker.observe("good", 5, range(5))  # its 5 nodes always accepted
    out = s.schedule()
    # Only the good request's 5 sure ranks clear min_gain: the trie is asked for those, and for
    # the silenced request only a shadow draft (judged by its output, never verified).
    assert drafter.asked == ([shadow] if shadow else []) + [5]
    assert {r.request_id: r.draft is None for r in out.requests} == {"silenced": True, "good": False}


def _busy(n: int, profile, tracker: AcceptanceTracker, drafter, **draft) -> DraftingScheduler:
    """n 3-token requests on a policy over `profile`, 16-token drafts, 2-token shadow drafts."""
    s = DraftingScheduler(
        SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=256),
        DraftConfig(decoding_length=16, adaptive=True, shadow_draft=2, **draft),
        BlockAllocator(512, 4),
        drafter,
        budget_policy=DraftBudgetPolicy(profile, tracker),
    )
    for i in range(n):
        s.add_request(_req(f"r{i}", 3, 200))
    return s


def test_a_step_where_no_draft_could_pay_searches_no_tree():
    """Eight requests on a machine where a draft row costs as much as a token: even sure drafts
    barely pay, and these are only middling. The drafter is asked for shadow drafts only (the
    output judges them for free), never for a tree the policy could not give anything of."""
    tracker = AcceptanceTracker(16)
    for _ in range(50):
        for i in range(8):
            tracker.observe(f"r{i}", 16, [j for j in range(16) if (i + j) % 3 == 0])  # a third hit
    drafter = CountingDrafter()
    out = _busy(8, cpu_like(base=10.0, slope=10.0), tracker, drafter, shadow_requests=8).schedule()
    assert all(r.draft is None for r in out.requests)
    assert drafter.asked == [2] * 8  # every one of them a shadow (8 allowed a step)
    # Where the same drafts cost nothing, every request gets its tree searched, and drafts.
    free = CountingDrafter()
    out = _busy(8, gpu_like(cdl=256), tracker, free).schedule()
    assert all(n > 2 for n in free.asked) and len(free.asked) == 8
    assert all(r.draft is not None for r in out.requests)


def test_past_shadow_requests_the_requests_given_nothing_take_turns_at_a_shadow_draft():
    s = _busy(16, cpu_like(base=10.0, slope=10.0), AcceptanceTracker(16), CountingDrafter(), shadow_requests=4)
    shadowed: list[set[str]] = []
    for _ in range(4):
        out = s.schedule()
        assert all(r.draft is None for r in out.requests)
        shadowed.append(set(s.speculation._proposals))
        s.update(out, RunnerOutput({r.request_id: [7] for r in out.requests}, {r.request_id: [] for r in out.requests}))
    assert [len(x) for x in shadowed] == [4] * 4  # 16 requests given nothing, 4 shadows a step
    assert set().union(*shadowed) == {f"r{i}" for i in range(16)}  # each in its turn
    with pytest.raises(ValueError, match="shadow_requests"):
        DraftConfig(shadow_requests=0)


class TruthDrafter(NoDrafter):
    """Proposes the text's true continuation (position p holds 10 + p % 50) as a chain."""

    def propose(self, request_id, token_ids, max_tokens):
        start = len(token_ids)
        return DraftTree.chain([10 + (start + i) % 50 for i in range(min(max_tokens, 8))])


def test_a_shadow_draft_that_the_output_matches_revives_a_silenced_request():
    tracker = AcceptanceTracker(8)
    s = DraftingScheduler(
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256),
        DraftConfig(decoding_length=8, adaptive=True),
        BlockAllocator(256, 4),
        TruthDrafter(),
        budget_policy=DraftBudgetPolicy(gpu_like(cdl=16), tracker, min_gain=0.2),
    )
    s.add_request(_req("r", 3, 200))
    for _ in range(50):
        tracker.observe("r", 8, [])  # every draft rejected so far: silenced
    assert s.speculation.policy.upper_gains("r", 8) == []
    drafted = []
    for _ in range(8):
        out = s.schedule()
        item = out.requests[0]
        drafted.append(0 if item.draft is None else len(item.draft))
        req = s.requests["r"]
        # The model emits the true text: every sent node is accepted, then one more token.
        n = drafted[-1]
        start = len(req.all_token_ids)
        s.update(out, RunnerOutput({"r": [10 + (start + i) % 50 for i in range(n + 1)]}, {"r": list(range(n))}))
    # Nothing verified at first; the shadow drafts matched, and drafting came back at no cost.
    assert drafted[0] == 0 and drafted[-1] > 0


def test_shadow_drafts_teach_every_rank_they_reach_not_only_the_first():
    """Where no draft pays, a request's shadow drafts are judged by the tokens of the steps after
    them too. Its matches are exact here, so every rank they reach learns that it would hit;
    judged by one step's token alone, the first rank could learn a hit, the deeper ones only
    misses (whenever the first missed), and a request whose matches turned good would never
    earn deep drafts."""
    tracker = AcceptanceTracker(16)
    s = DraftingScheduler(
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256),
        DraftConfig(decoding_length=16, adaptive=True, shadow_draft=4),
        BlockAllocator(512, 4),
        TruthDrafter(),
        budget_policy=DraftBudgetPolicy(cpu_like(base=10.0, slope=100.0), tracker),  # no draft pays
    )
    s.add_request(_req("r", 3, 200))
    for _ in range(40):
        out = s.schedule()
        assert out.requests[0].draft is None
        start = len(s.requests["r"].all_token_ids)
        s.update(out, RunnerOutput({"r": [10 + start % 50]}, {"r": []}))
    assert all(g > 0.9 for g in tracker.gains("r", 4))
    assert tracker.gains("r", 5)[4] < 0.9  # past the shadow drafts' reach: no evidence


def test_scheduler_applies_policy_overrides_and_feeds_acceptance():
    tracker = AcceptanceTracker(32)
    policy = DraftBudgetPolicy(gpu_like(cdl=16), tracker)
    s = DraftingScheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
        DraftConfig(decoding_length=32, adaptive=True),
        BlockAllocator(256, 4),
        WideDrafter(),
        budget_policy=policy,
    )
    s.add_request(_req("auto", 3, 200))
    s.add_request(_req("fixed", 3, 200, decoding_length=5))
    s.add_request(_req("off", 3, 200, decoding_length=0))
    out = s.schedule()  # prefill step: every request samples
    drafts = {r.request_id: r.draft for r in out.requests}
    assert len(drafts["fixed"]) == 5 and drafts["off"] is None
    # The step already holds 9 prompt tokens and 5 fixed drafts, 2 short of the 16 free rows;
    # since those are paid for anyway the adaptive request gets more than 2, but not its cap.
    assert 2 < len(drafts["auto"]) < 32
    assert all(r.num_tokens <= len(r.token_ids) + 32 for r in out.requests)
    # `auto` accepts its first two chain nodes (ranks 0 and 1): those ranks go up, rank 2 down.
    auto = drafts["auto"]
    emitted = {"auto": [10, 11, 99], "fixed": [99], "off": [99]}
    accepted = {"auto": [0, 1], "fixed": [], "off": []}
    before = tracker.gains("auto", 3)
    s.update(out, RunnerOutput(emitted, accepted))
    after = tracker._est["auto"]
    assert auto is not None and len(auto) >= 3
    assert after[0] > before[0] and after[1] > before[1] and after[2] < before[2]
    s.check_integrity()


def test_the_drafter_hears_of_a_request_when_it_first_runs_never_while_it_waits():
    drafter = ChainDrafter(2)
    s = _sched(num_blocks=2048, max_num_seqs=1, budget=8192, drafter=drafter)
    s.add_request(_req("a", 5, max_new=3))
    s.add_request(_req("b", 4000, max_new=3))  # a long prompt, waiting behind a
    s.add_request(_req("c", 5, max_new=3))
    assert drafter.events == []  # queued: nothing built for anyone
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["a"] and drafter.events == [("start", "a")]
    s.abort("c")  # aborted while waiting: the drafter never knew it, so it has nothing to forget
    assert ("finish", "c") not in drafter.events
    while s.has_work():
        out = s.schedule()
        s.update(out, _fake_run(out))
    assert drafter.events == [("start", "a"), ("finish", "a"), ("start", "b"), ("finish", "b")]


def test_requests_that_end_in_one_step_are_forgotten_in_the_order_they_started():
    """The drafter forgets the requests a step ended in the order it heard of them, not in a set's
    order (which moves with string hashing): forgetting flushes a request's text into the shared
    trie, so the order is part of what later drafts see."""
    drafter = ChainDrafter(2)
    s = _sched(num_blocks=512, max_num_seqs=24, budget=512, drafter=drafter)
    ids = [f"req-{i * 7919 % 101}" for i in range(24)]
    for rid in ids:
        s.add_request(_req(rid, 5, max_new=1))
    out = s.schedule()
    s.update(out, _fake_run(out))
    assert not s.has_work()
    assert [rid for kind, rid in drafter.events if kind == "finish"] == ids


def test_a_preempted_request_is_not_indexed_twice():
    drafter = ChainDrafter(0)
    s = _sched(num_blocks=6, block_size=4, max_num_seqs=2, drafter=drafter)
    s.add_request(_req("a", 8, max_new=8))
    s.add_request(_req("b", 8, max_new=8))
    while s.has_work():
        out = s.schedule()
        s.update(out, _fake_run(out))
    assert s.num_preemptions > 0
    assert sorted(drafter.events) == [("finish", "a"), ("finish", "b"), ("start", "a"), ("start", "b")]


def test_finished_requests_leave_no_window_estimate():
    policy = DraftBudgetPolicy(gpu_like(cdl=16), AcceptanceTracker(4))
    s = DraftingScheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        DraftConfig(decoding_length=4),
        BlockAllocator(64, 4),
        NoDrafter(),
        budget_policy=policy,
    )
    s.add_request(_req("a", 5, max_new=2))
    out = s.schedule()
    policy.windows.observe("a", 2)  # as the planner does for a request whose window ran
    assert "a" in policy.windows._est
    while s.has_work():
        s.update(out, _fake_run(out))
        out = s.schedule()
    assert "a" not in policy.windows._est


def test_a_busy_step_searches_a_tree_a_little_past_what_the_request_could_be_given():
    """Sixteen requests whose first ranks are sure and later ones middling, on a machine where rows
    cost: at best each would be given a few nodes. The drafter is asked for twice that plus a
    shadow draft's length (2 here: room for the real allocation to give one request more), not
    for every rank that could pay on a free machine; what the step verifies fits in it."""
    tracker = AcceptanceTracker(16)
    for _ in range(50):
        for i in range(16):
            tracker.observe(f"r{i}", 16, [0, 1] + [j for j in range(2, 16) if j % 4 == 0])
    drafter = CountingDrafter()
    s = _busy(16, cpu_like(base=40.0, slope=1.0), tracker, drafter)
    policy = s.speculation.policy
    assert policy is not None
    most = {f"r{i}": len(policy.upper_gains(f"r{i}", 16)) for i in range(16)}  # ranks that could pay at all
    best: dict[str, int] = {}  # what each request would be given at best, as the planner saw it
    hopeful = policy.hopeful
    policy.hopeful = lambda upper, step: best.update(hopeful(upper, step)) or dict(best)  # type: ignore[method-assign]
    out = s.schedule()
    assert len(best) == 16 and all(0 < best[rid] < most[rid] for rid in best)
    asked = dict(zip((r.request_id for r in out.requests), drafter.asked))
    assert all(asked[rid] == min(most[rid], 2 * k + 2) for rid, k in best.items())
    assert any(asked[rid] < most[rid] for rid in best)
    for r in out.requests:  # what the step verifies is a prefix of what was proposed
        assert r.draft is None or len(r.draft) <= asked[r.request_id]
    assert any(r.draft is not None for r in out.requests)
