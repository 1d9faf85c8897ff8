"""Tenants' shares of a step: a tenant with more prompt work than a step holds waits behind the
others' decodes and admissions, takes only what the measured slack allows beside them, and gives
up seats and blocks first; one tenant alone sees plain first come, first served."""

from __future__ import annotations

import itertools

from batchserve.config import SchedulerConfig
from batchserve.records import RunnerOutput, SchedulerOutput
from batchserve.request import Request, RequestStatus, SamplingParams
from batchserve.scheduler import BlockAllocator, Scheduler
from batchserve.scheduler.fairness import PromptSlack, background_tenants, prompt_backlog


def _req(rid: str, n_prompt: int, tenant: str, max_new: int = 1000) -> Request:
    return Request(
        rid,
        list(range(1, n_prompt + 1)),
        SamplingParams(max_new_tokens=max_new, ignore_eos=True),
        frozenset([0]),
        max_total_len=8192,
        tenant=tenant,
    )


def _sched(budget: int = 64, max_num_seqs: int = 8, num_blocks: int = 1024, slack: float = 0.25) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, tenant_slack=slack),
        BlockAllocator(num_blocks, 4),
    )


def _run(s: Scheduler, ms_per_token: float = 0.0, base_ms: float = 10.0) -> SchedulerOutput:
    """One step: schedule, a fake forward (every sampling row emits token 5), its time reported
    as `base_ms` plus `ms_per_token` for each token in the step beyond one per request."""
    out = s.schedule()
    emitted = {r.request_id: [5] for r in out.requests if r.sample}
    s.update(out, RunnerOutput(emitted, {rid: [] for rid in emitted}))
    extra = sum(r.num_tokens - 1 for r in out.requests)
    s.observe_step(out, (base_ms + ms_per_token * extra) / 1000)
    s.check_integrity()
    return out


def _flood(s: Scheduler, n: int, tenant: str = "hostile", max_new: int = 1000) -> None:
    """`n` more one-token prompts of `tenant`: with them it holds several requests, and its long
    prompt beside other tenants takes only the slack even on a server that is not busy."""
    for i in range(n):
        s.add_request(_req(f"extra{i}", 1, tenant, max_new))


def _tokens(out: SchedulerOutput, prefix: str) -> int:
    return sum(r.num_tokens for r in out.requests if r.request_id.startswith(prefix))


def test_background_needs_two_tenants_and_more_prompt_than_a_step() -> None:
    alone = [_req("a", 5000, "big"), _req("b", 5000, "big")]
    assert background_tenants(alone, 512) == frozenset()  # one tenant is nobody's background
    mixed = [*alone, _req("c", 30, "small"), _req("d", 600, "mid")]
    assert prompt_backlog(mixed) == {"big": 10000, "small": 30, "mid": 600}
    assert background_tenants(mixed, 512) == {"big", "mid"}
    assert background_tenants(mixed, 600) == {"big"}
    # Of two tenants over a step, the lighter is not held back: a burst of ordinary prompts is
    # not ranked with a flood; and two comparable loads share first come, first served.
    assert background_tenants([*alone, _req("e", 900, "burst")], 512) == {"big"}
    assert background_tenants([_req("f", 900, "one"), _req("g", 1700, "two")], 512) == frozenset()
    assert background_tenants([_req("f", 900, "one"), _req("g", 1801, "two")], 512) == {"two"}


def test_one_tenant_alone_is_first_come_first_served() -> None:
    s = _sched(budget=64)
    s.add_request(_req("old", 1000, "t"))
    s.add_request(_req("new", 10, "t"))
    out = _run(s)
    assert [(r.request_id, r.num_tokens) for r in out.requests] == [("old", 64)]  # the old prompt takes the step


def test_a_new_tenant_is_not_queued_behind_a_long_prompt() -> None:
    """FCFS would hand the whole budget to the older long prompt for 16 steps; the short one of
    another tenant is computed in the first step and decodes every step after."""
    s = _sched(budget=64)
    s.add_request(_req("hog", 1000, "hostile"))
    _run(s)  # alone: the hog takes whole steps
    s.add_request(_req("good", 10, "good"))
    out = _run(s, ms_per_token=1.0)
    assert (out.requests[0].request_id, out.requests[0].num_tokens) == ("good", 10)
    for _ in range(40):
        out = _run(s, ms_per_token=1.0)
        assert _tokens(out, "good") == 1  # decodes every step


def test_background_chunks_beside_others_take_the_slack_of_every_other_step() -> None:
    """A tenant with several requests, one a long prompt, beside another tenant: a step costs
    10 ms plus 1 ms per prompt token, so with slack 0.25 a background chunk is worth 2.5 ms and
    settles at 2-3 tokens, in every other step that serves the other tenant."""
    s = _sched(budget=64, slack=0.25)
    s.add_request(_req("good", 4, "good"))
    s.add_request(_req("hog", 3000, "hostile"))
    _flood(s, 4)
    chunks = [_tokens(_run(s, ms_per_token=1.0), "hog") for _ in range(200)]
    assert all(a == 0 or b == 0 for a, b in itertools.pairwise(chunks[1:]))  # never two in a row
    settled = [c for c in chunks[100:] if c]
    assert settled and all(1 <= c <= 5 for c in settled), settled
    assert 30 <= len(settled) <= 50  # every other step, give or take the halvings


def test_background_takes_whole_steps_once_no_one_else_was_served_lately() -> None:
    s = _sched(budget=64)
    now = [0.0]
    s.slack.clock = lambda: now[0]
    s.add_request(_req("good", 4, "good", max_new=8))
    s.add_request(_req("hog", 3000, "hostile"))
    _flood(s, 4)
    for _ in range(8):
        _run(s, ms_per_token=1.0)  # good's 8 tokens: it is done
        now[0] += 0.01
    assert "good" not in s.requests
    # Within linger_s of good's last step (its user may be about to send the next request), a
    # step of the hog alone takes the allowance, not the budget: no step good would wait on.
    assert 1 <= _tokens(_run(s, ms_per_token=1.0), "hog") < 64
    now[0] += s.slack.linger_s
    outs = [_run(s, ms_per_token=1.0) for _ in range(3)]
    assert all(_tokens(o, "hog") == 64 for o in outs)  # the device never idles for fairness


def test_a_slow_step_shrinks_the_background_share_at_once() -> None:
    slack = PromptSlack(slack=0.2, budget=512, tokens=256)
    base = SchedulerOutput(requests=(), finished_request_ids=())
    slack.scheduled(base, (), True, 0)
    slack.observe(base, 0.010)  # 10 ms without background
    assert slack.cap(True, frozenset({"hog"})) == 256
    step = SchedulerOutput(requests=(), finished_request_ids=())
    slack.scheduled(step, (), True, 256)
    slack.observe(step, 0.100)  # 90 ms over, 2 ms of room: halved (at most) now
    assert slack.tokens == 128 and slack.cap(True, frozenset({"hog"})) == 0  # it sits out the next shared step
    other = SchedulerOutput(requests=(), finished_request_ids=())
    slack.scheduled(step, (), True, 64)
    slack.observe(other, 1.0)  # a step it did not schedule last: ignored
    assert slack.tokens == 128


def test_out_of_seats_a_background_prompt_gives_its_seat() -> None:
    s = _sched(budget=64, max_num_seqs=2)
    s.add_request(_req("hog1", 32, "hostile"))
    s.add_request(_req("hog2", 200, "hostile"))
    _run(s)  # alone: both admitted; hog1 decodes, hog2 has 168 prompt tokens to go
    s.add_request(_req("good", 8, "good"))
    out = _run(s)
    assert ("good", 8) in [(r.request_id, r.num_tokens) for r in out.requests]
    assert s.requests["hog2"].status is RequestStatus.WAITING  # the background request in its prompt
    assert s.requests["hog1"].status is RequestStatus.RUNNING  # decoding: kept


def test_out_of_blocks_a_background_request_is_preempted_first() -> None:
    s = _sched(budget=16, num_blocks=60, max_num_seqs=4)  # 240 slots of 4
    s.add_request(_req("hog", 220, "hostile", max_new=1))
    for _ in range(10):
        _run(s)  # alone: 160 of its prompt, 40 blocks
    s.add_request(_req("good", 8, "good", max_new=100))
    s.add_request(_req("good2", 6, "good", max_new=100))  # FCFS would preempt it, the youngest
    _flood(s, 2, max_new=100)  # three requests: its prompt beside others held to the slack
    for _ in range(60):  # a prompt token beyond one costs 10 ms: the hog's chunks stay at a token or two
        _run(s, ms_per_token=10.0)
        assert s.requests["good"].stats.num_preemptions == 0
        assert s.requests["good2"].stats.num_preemptions == 0
    hostile = [r for r in s.requests.values() if r.tenant == "hostile"]
    assert sum(r.stats.num_preemptions for r in hostile) >= 1


def test_a_background_tenants_short_prompt_goes_before_its_own_flood() -> None:
    s = _sched(budget=64)
    s.add_request(_req("good", 4, "good"))
    s.add_request(_req("hog", 3000, "hostile"))
    s.add_request(_req("small", 12, "hostile"))
    for _ in range(60):
        out = _run(s, ms_per_token=1.0)
        small = next((r for r in out.requests if r.request_id == "small"), None)
        if _tokens(out, "hog"):  # only what the step had left once the short prompt reached its end
            assert small is not None and small.sample, [(r.request_id, r.num_tokens) for r in out.requests]
        if s.requests["small"].output_token_ids:
            break
    assert s.requests["small"].output_token_ids  # its prompt was computed and it decodes


def test_a_new_request_out_of_blocks_takes_them_from_a_background_tenant() -> None:
    s = _sched(budget=16, num_blocks=60)
    s.add_request(_req("hog", 200, "hostile", max_new=1))
    for _ in range(4):
        _run(s)  # alone: 64 of its prompt, 16 blocks
    held = s.allocator.allocate(s.allocator.num_free_blocks - 1)  # the rest of the pool taken elsewhere
    s.add_request(_req("good", 16, "good", max_new=4))  # its first chunk needs 4 blocks
    out = s.schedule()
    assert ("good", 16) in [(r.request_id, r.num_tokens) for r in out.requests]  # admitted at once
    assert s.requests["hog"].status is RequestStatus.WAITING and s.requests["hog"].stats.num_preemptions == 1
    s.allocator.free(held)


def test_a_lone_long_prompt_beside_another_tenants_tiny_decode_takes_whole_steps() -> None:
    """2,000 prompt tokens beside another tenant's single 4-token request: one request, within its
    share of the seats, is no flood, so its first token comes within 1.25x of its time alone (held to
    the 10% slack of every other step it took about 10 times as long: the other tenant's presence
    alone made it background). Beside three decodes, a busy server, it is held to the slack. Steps
    cost 10 ms plus 0.07 ms a token beyond one a request."""

    def first_token_ms(beside: int) -> float:
        s = _sched(budget=512, max_num_seqs=16, num_blocks=4096, slack=0.1)
        for i in range(beside):
            s.add_request(_req(f"other{i}", 4, "other", max_new=1000))
        if beside:
            _run(s)
        s.add_request(_req("long", 2000, "lone", max_new=4))
        elapsed = 0.0
        while not s.requests["long"].output_token_ids:
            out = _run(s, ms_per_token=0.07, base_ms=10.0)
            elapsed += 10.0 + 0.07 * sum(r.num_tokens - 1 for r in out.requests)
        return elapsed

    alone, beside = first_token_ms(0), first_token_ms(1)
    assert beside <= 1.25 * alone, (alone, beside)
    # A busy server (other tenants run more than an eighth of the 16 seats): the slack again.
    assert first_token_ms(3) > 3 * alone
