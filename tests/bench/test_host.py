"""The host side of a step, timed with a stand-in forward that does no model work."""

from __future__ import annotations

from typing import Any

import torch

from batchserve import Submission
from batchserve.bench.host import PlanOnlyBackend, StandInModel, bigram_successor, stand_in_engine
from batchserve.bench.host_timing import HOST_PHASES, measure_host
from batchserve.bench.methods import Row
from batchserve.bench.report import phase_table
from batchserve.request import SamplingParams
from tests.conftest import TINY_VOCAB, make_tiny_tokenizer


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 200 + 1 for j in range(40)] for i in range(n)]


def test_the_stand_in_answers_from_its_bigram_table_and_jumps_now_and_then():
    successor = bigram_successor([[5, 9, 2], [9, 4]], 16)
    assert successor[5] == 9 and successor[9] == 4 and successor[2] == 3  # the last seen follower; else t + 1
    model = StandInModel(successor, torch.tensor([7]), break_every=1_000_000)
    ids = torch.tensor([[5, 9, 5, 9]])
    logits = model(ids, torch.tensor([[1, 2, 3, 4]]), torch.tensor([0, 1, 3]), None).logits[0]
    assert logits.shape == (3, 16)
    assert logits.argmax(-1).tolist() == [9, 4, 4]
    jumping = StandInModel(successor, torch.tensor([7]), break_every=1)  # every row jumps
    logits = jumping(ids, torch.tensor([[1, 2, 3, 4]]), torch.tensor([0, 1, 3]), None).logits[0]
    assert logits.argmax(-1).tolist() == [7, 7, 7]


def test_host_phases_are_measured_over_full_steps_with_trees():
    prompts = _prompts(12)
    tokenizer = make_tiny_tokenizer()
    for requests, length in ((1, 8), (4, 6)):
        core = stand_in_engine(prompts, tokenizer, TINY_VOCAB, requests, length)
        stats = measure_host(core, prompts, requests, max_new_tokens=24)
        assert stats.requests == requests and stats.steps >= 5
        assert set(stats.phase_ms) == set(HOST_PHASES) and all(t > 0 for t in stats.phase_ms.values())
        assert stats.host_ms > 0
        assert stats.rows > requests  # draft nodes were verified ...
        assert stats.tokens_per_step > 1  # ... and accepted (the outputs copy the prompts)
        assert isinstance(core.runner.backend, PlanOnlyBackend)  # planned as for FlashInfer, no kernel ran


def test_the_bench_phase_table_shows_the_host_side():
    row = Row("lookahead", "humaneval", 16, 8, 100, 1.0, 100.0, 2.0, 0.1, 0.1, 0.01, 0.01, True, steps=50)
    row.phase_ms = {"schedule": 1.0, "prepare": 0.5, "forward": 10.0, "verify": 0.25, "commit": 0.25, "wall": 12.0}
    row.overhead_ratio = 2.0 / 12.0
    lines = phase_table([row])
    header = [c.strip() for c in lines[1].split("|")]
    cells = [c.strip() for c in lines[3].split("|")]
    assert cells[header.index("host")] == "2.00"  # schedule + prepare + verify + commit


def test_the_report_prices_a_draft_row_per_bucket_from_the_cost_profile():
    from batchserve.bench.report import row_price_table
    from batchserve.cost_profile import CostProfile

    # A flat step up to 8 rows, then 0.5 ms a row: a GPU whose spare FLOPs run out at 8 rows.
    counts = (1, 8, 16, 32)
    profile = CostProfile("gpu", counts, (0, 1024), ((2.0, 2.0, 6.0, 14.0), (2.0, 2.0, 6.0, 14.0)))
    lines = row_price_table(profile, "bf16")
    header = [c.strip() for c in lines[1].split("|")][1:-1]
    step = [c.strip() for c in lines[3].split("|")][1:-1]
    extra = [c.strip() for c in lines[4].split("|")][1:-1]
    assert header[1:] == ["1", "2", "4", "8", "12", "16", "24", "32"]  # the buckets the profile covers
    assert step[header.index("8")] == "2.00" and step[header.index("16")] == "6.00"
    assert extra[header.index("8")] == "0.000" and extra[header.index("32")] == f"{12.0 / 31:.3f}"


def _one_request_on_a_30_ms_device() -> tuple[Any, Any, Any]:
    """(engine, its EmulatedDevice, the request's first step, scheduled): a device whose every
    step takes 30 ms."""
    from batchserve.bench.host import EmulatedDevice
    from batchserve.cost_profile import CostProfile

    prompts = _prompts(2)
    core = stand_in_engine(prompts, make_tiny_tokenizer(), TINY_VOCAB, 1, 4)
    device = EmulatedDevice(core.runner, CostProfile("30ms", (1, 64), (0,), ((30.0, 30.0),)))
    core.runner = device
    core.add_request(Submission(prompts[0], SamplingParams(max_new_tokens=4, ignore_eos=True)))
    return core, device, core.schedule()


def _to_the_end(core: Any, step: Any) -> None:
    """Collect and commit the launched `step`, then step until the request leaves the engine."""
    core.collect(step)
    assert step.result is not None and core.commit(step)
    while core.has_work():
        core.step()


def test_the_emulated_device_returns_a_step_no_sooner_than_its_profile_says():
    import time

    core, device, step = _one_request_on_a_30_ms_device()
    core.launch(step)
    due = device._due
    assert due > time.perf_counter()  # launched: the device's 30 ms still running
    core.collect(step)
    assert time.perf_counter() >= due  # collect waited out the rest of them (spinning, as CUDA's readback does)
    assert device.device_seconds == 0.030 and device.backend is device.runner.backend  # the rest is the runner's
    _to_the_end(core, step)


def test_the_emulated_devices_time_starts_when_the_step_is_staged(monkeypatch):
    """The stand-in's forward runs on the CPU inside `launch`; on a GPU it is the device's work, so
    it counts within the device's time, not before it (here a forward of 0.2 s, a device of 30 ms:
    the results are due 30 ms after staging, long past already)."""
    import time

    forward = StandInModel.forward

    def slow(self: StandInModel, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.2)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(StandInModel, "forward", slow)
    core, device, step = _one_request_on_a_30_ms_device()
    before = time.perf_counter()
    core.launch(step)
    assert step.launched is not None
    staged = before + step.launched.clock.spent["prepare"]
    assert staged + 0.030 <= device._due < staged + 0.130 < time.perf_counter()
    _to_the_end(core, step)


def test_the_pipelined_loop_hides_building_outputs_on_the_emulated_device():
    from batchserve.bench.host import emulated_engine
    from batchserve.bench.host_timing import measure_emulated

    prompts, tokenizer = _prompts(8), make_tiny_tokenizer()
    runs = {}
    for pipelined in (False, True):
        core = emulated_engine(prompts, tokenizer, TINY_VOCAB, 4, 6)
        runs[pipelined] = (core, measure_emulated(core, prompts, 4, 16, pipelined))
    (seq_core, seq), (pipe_core, pipe) = runs[False], runs[True]
    # The same work: every step the same shape (fixed drafts), the same tokens.
    assert pipe.steps == seq.steps >= 3 and pipe.tokens_per_step == seq.tokens_per_step > 1
    assert pipe.draft_rows == seq.draft_rows > 0 and pipe.device_ms == seq.device_ms
    assert seq_core.num_steps == pipe_core.num_steps and pipe.pipelined and not seq.pipelined
    assert pipe.outputs_ms > 0 and pipe.critical_ms > 0 and pipe.tokens_per_s > 0


def test_the_adaptive_policy_plans_with_the_emulated_devices_profile():
    from batchserve.bench.host import H100_SMOLLM2, emulated_engine

    core = emulated_engine(_prompts(4), make_tiny_tokenizer(), TINY_VOCAB, 2, 16, adaptive=True)
    assert core.cost_profile is H100_SMOLLM2 and core.runner.profile is H100_SMOLLM2
    assert core.speculation.policy is not None
