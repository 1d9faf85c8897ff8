"""Prompt chunks beside decodes (`PromptPacing`): a step that carries both takes about (1 +
prompt_stall) times a decode-only step's measured time (or UNNOTICED_MS), whatever a prompt token
costs; prompts always progress; a model whose steps a stream would not notice is never held back;
steps without decodes take the whole budget; and the step is measured as the engine runs it (after
`reserve` hangs drafts off it), for the pacing and the tenants' slack alike."""

from __future__ import annotations

import math

import pytest

from batchserve.config import SchedulerConfig
from batchserve.records import RunnerOutput, SchedulerOutput, StepDrafts
from batchserve.scheduler import BlockAllocator, Scheduler
from batchserve.scheduler.pacing import REFRESH_EVERY, UNNOTICED_MS, PromptPacing
from tests.scheduler.test_fairness import _req


def _sched(budget: int = 512, stall: float = 1.0, seats: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=seats, max_num_batched_tokens=budget, prompt_stall=stall)
    return Scheduler(config, BlockAllocator(4096, 4))


def _step(s: Scheduler, base_ms: float, ms_per_prompt_token: float) -> SchedulerOutput:
    """Schedule, reserve (no drafts), a fake forward (each sampling row emits token 5) whose time
    is `base_ms` plus `ms_per_prompt_token` for each token of a prompt chunk, observed as the
    engine observes it: on the reserved step."""
    out = s.reserve(s.schedule(), StepDrafts())
    emitted = {r.request_id: [5] for r in out.requests if r.sample}
    s.update(out, RunnerOutput(emitted, {rid: [] for rid in emitted}))
    prompt = sum(r.num_tokens for r in out.requests if r.num_tokens > 1)
    s.observe_step(out, (base_ms + ms_per_prompt_token * prompt) / 1000)
    s.check_integrity()
    return out


def _prompt_tokens(out: SchedulerOutput) -> int:
    return sum(r.num_tokens for r in out.requests if r.num_tokens > 1)


@pytest.mark.parametrize(("stall", "ms_per_token"), [(1.0, 2.0), (1.0, 8.0), (0.25, 4.0)])
def test_a_step_beside_decodes_takes_about_one_plus_stall_times_a_decode_step(stall, ms_per_token):
    s, base = _sched(stall=stall), 400.0
    for i in range(4):  # four requests decoding
        s.add_request(_req(f"d{i}", 8, ""))
    _step(s, base, ms_per_token)
    for i in range(6):  # long prompts arrive while they decode
        s.add_request(_req(f"p{i}", 3000, ""))
    times = []
    for _ in range(60):
        out = _step(s, base, ms_per_token)
        assert {f"d{i}" for i in range(4)} <= {r.request_id for r in out.requests}  # every decode, every step
        times.append(base + ms_per_token * _prompt_tokens(out))
    settled = times[20:]
    target = max((1 + stall) * base, UNNOTICED_MS)
    assert max(settled) <= 1.3 * target  # at most one step's overshoot past the bound
    assert sum(settled) / len(settled) >= 0.6 * target  # and the room is used: prompts progress


def test_steps_a_stream_would_not_notice_are_never_bounded():
    s = _sched(budget=512)
    for i in range(4):
        s.add_request(_req(f"d{i}", 8, ""))
    _step(s, 20.0, 0.5)
    for i in range(6):
        s.add_request(_req(f"p{i}", 3000, ""))
    for _ in range(10):  # a whole budget of prompt: 276 ms, under UNNOTICED_MS; no step left without
        out = _step(s, 20.0, 0.5)
        assert sum(r.num_tokens for r in out.requests) == 512 and _prompt_tokens(out) > 400


def test_a_decode_only_step_every_few_keeps_the_baseline_and_prompts_always_progress():
    p = PromptPacing(stall=1.0, budget=512, floor=16)
    assert p.room(0) is None and PromptPacing(stall=math.inf, budget=512).room(4) is None
    steps = []
    for _ in range(4 * REFRESH_EVERY):
        room = p.room(4)
        steps.append(room)
        out = SchedulerOutput(requests=(), finished_request_ids=())
        tokens = 512 if room is None else room
        p.scheduled(out, 4, tokens)
        p.observe(out, (600 + 100 * tokens) / 1000)  # 600 ms of decodes; 100 ms a prompt token
    assert steps[:2] == [None, 0]  # unbounded until a step runs past UNNOTICED_MS, then decodes alone...
    assert p.baseline_ms == pytest.approx(600.0)  # ...measure the baseline
    assert steps.count(0) >= 3  # and again while the allowance binds
    assert all(r is None or r == 0 or r >= p.floor for r in steps)  # never below the floor otherwise
    assert p.tokens == p.floor  # 16 tokens cost 1.6 s, past the 600 ms of room: the floor


def test_without_decodes_a_step_takes_the_whole_budget():
    s = _sched(budget=256)
    s.add_request(_req("p", 3000, ""))
    for _ in range(3):
        assert _prompt_tokens(_step(s, 100.0, 10.0)) == 256


def test_the_tenants_slack_learns_from_the_step_the_engine_runs():
    """`reserve` returns another object than `schedule` did; the slack measured only the latter,
    so in the engine its allowance never moved from one token."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, tenant_slack=0.25)
    s = Scheduler(config, BlockAllocator(1024, 4))
    s.add_request(_req("good", 4, "good"))
    for i in range(3):  # several long prompts: held to the slack
        s.add_request(_req(f"hog{i}", 400, "hostile"))
    for _ in range(12):
        _step(s, 10.0, 0.01)  # background tokens are cheap: the allowance grows
    assert s.slack.baseline_ms is not None and s.slack.tokens > 1
