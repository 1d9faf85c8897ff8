"""Jacobi lookahead and the hybrid end to end: lossless, windows that are the model's own
Jacobi iteration, scratch KV, per-request shapes and the policy's say over windows."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from batchserve import SamplingParams
from batchserve.admission import Submission
from batchserve.cost_profile import CostProfile
from batchserve.engine import EngineCore
from tests.conftest import TINY_VOCAB, hf_greedy, make_tiny_model, tiny_llm

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    """Random prompts with a repeated phrase in each: text the model tends to continue in loops."""
    out = []
    for i in range(n):
        rng = random.Random(100 + i)
        phrase = [rng.randrange(TINY_VOCAB) for _ in range(4)]
        out.append([rng.randrange(TINY_VOCAB) for _ in range(5 + i % 7)] + phrase * 4)
    return out


def _checked(core: EngineCore) -> None:
    core.step_listeners.append(lambda out, phases: core.scheduler.check_integrity())


def _run_staggered(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> list:
    """Add a request every other step, so windows start and end while others run."""
    reqs, pending = [], list(prompts)
    while pending or core.has_work():
        if pending:
            reqs.append(core.add_request(Submission(pending.pop(0), params)))
        core.step()
        if pending:
            core.step()
    return reqs


@pytest.mark.parametrize("method", ["jacobi", "hybrid"])
def test_greedy_equals_hf_alone_and_with_16_staggered_requests(tiny_model, method):
    prompts = _prompts(16)
    expected = [hf_greedy(tiny_model, p, GREEDY.max_new_tokens, ignore_eos=True) for p in prompts]
    one = tiny_llm(None, draft=method, window_size=4, ngram_size=3, guesses=4)
    _checked(one.engine)
    assert one.generate(prompts[:1], GREEDY)[0].token_ids == expected[0]

    core = tiny_llm(None, draft=method, window_size=4, ngram_size=3, guesses=4, max_num_seqs=16).engine
    _checked(core)
    reqs = _run_staggered(core, prompts, GREEDY)
    assert [r.output_token_ids for r in reqs] == expected
    pool = core.speculation.drafter.pool if method == "jacobi" else core.speculation.drafter.jacobi.pool
    assert len(pool) > 0  # the windows ran and filled the pool
    if method == "jacobi":  # every accepted draft token came from the pool
        assert sum(r.stats.draft_tokens_accepted for r in reqs) > 0


@pytest.mark.parametrize("method", ["jacobi", "hybrid"])
def test_seeded_sampling_is_identical_with_and_without_windows(method):
    prompts = _prompts(6)
    params = SamplingParams(max_new_tokens=40, temperature=0.8, top_k=20, seed=7)
    plain = tiny_llm(None, draft="none").generate(prompts, params)
    drafted = tiny_llm(None, draft=method, window_size=4, ngram_size=3, guesses=4).generate(prompts, params)
    for a, b in zip(plain, drafted, strict=True):
        assert len(set(a.token_ids)) > 5
        assert b.token_ids == a.token_ids


def test_window_outputs_are_the_models_next_token_on_each_chain():
    """The window's rows carry explicit positions and a mask that is not a tree. Checked against
    HF run on each row's chain as a plain sequence: the committed text, then the window tokens
    the row sees (level 0 up to its column, then its column down the levels)."""
    model = make_tiny_model()
    core = tiny_llm(None, draft="jacobi", window_size=3, ngram_size=4, guesses=2, block_size=4).engine
    drafter = core.speculation.drafter
    seen: dict[str, list[int]] = {}
    checked = []
    real_window, real_outputs = drafter.window, drafter.on_window_outputs

    def window(rid, max_rows):
        rows = real_window(rid, max_rows)
        seen[rid] = list(core.scheduler.requests[rid].all_token_ids)  # ends with the root
        return rows

    def on_window_outputs(rid, rows, outputs):
        first_out = len(rows) - rows.num_outputs
        for k, out in enumerate(outputs):
            visible = np.flatnonzero(rows.mask[first_out + k]).tolist()
            chain = seen[rid] + [rows.tokens[c] for c in visible]
            with torch.no_grad():
                logits = model(torch.tensor([chain])).logits[0, -1]
            checked.append(int(logits.argmax()) == out)
        real_outputs(rid, rows, outputs)

    drafter.window, drafter.on_window_outputs = window, on_window_outputs
    reqs = [core.add_request(Submission(p, SamplingParams(max_new_tokens=12, ignore_eos=True))) for p in _prompts(3)]
    while core.has_work():
        core.step()
    assert all(r.is_finished for r in reqs)
    assert len(checked) >= 3 * 3 * 5 and all(checked)  # 3 requests, 3 columns, many steps


def test_window_rows_are_scratch_and_a_request_may_ask_for_a_smaller_window():
    core = tiny_llm(None, draft="jacobi", window_size=4, ngram_size=3, guesses=3, block_size=4).engine
    _checked(core)
    rows_per_step: dict[str, set[int]] = {"small": set(), "default": set()}

    def record(out, phases):
        for item in out.requests:
            if item.window is not None:
                rows_per_step[item.request_id].add(len(item.window))

    core.step_listeners.append(record)
    prompt = _prompts(1)[0]
    core.add_request(
        Submission(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True, jacobi=(2, None, 1)), "small")
    )
    core.add_request(Submission(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True), "default"))
    while core.has_work():
        core.step()
        for r in core.scheduler.running:  # between steps: only committed K/V holds blocks
            assert core.scheduler.allocator.blocks_for(r.num_computed_tokens) == len(r.block_ids)
    assert rows_per_step["small"] == {2, 4}  # (w=2) x 1 level, then 2 levels (N - 1 = 2)
    assert rows_per_step["default"] == {4, 8}
    alloc = core.scheduler.allocator
    assert alloc.num_free_blocks == alloc.num_blocks


def test_a_request_without_speculation_runs_no_window():
    core = tiny_llm(None, draft="hybrid", window_size=3, ngram_size=3, guesses=2).engine
    windows = []
    core.step_listeners.append(lambda out, phases: windows.extend(i.window for i in out.requests if i.window))
    core.add_request(Submission(_prompts(1)[0], SamplingParams(max_new_tokens=10, decoding_length=0)))
    while core.has_work():
        core.step()
    assert windows == []


def _flat_then_steep(knee: int) -> CostProfile:
    """A step costs 10 ms up to `knee` rows, then 10 ms more per row."""
    counts = (1, 8, 16, 32, 64, 128)
    return CostProfile("synthetic", counts, (0,), (tuple(10.0 + 10.0 * max(0, n - knee) for n in counts),))


@pytest.mark.parametrize(("knee", "runs"), [(128, True), (1, False)])
def test_the_policy_runs_windows_only_where_their_rows_pay(knee, runs):
    """Flat cost: a window's rows are nearly free and it runs. Steep cost: its expected gain
    does not pay for its rows and the policy leaves it off."""
    llm = tiny_llm(
        None,
        draft="jacobi",
        adaptive=True,
        cost_profile=_flat_then_steep(knee),
        learn_step_costs=False,
        window_size=4,
        ngram_size=3,
        guesses=3,
    )
    core = llm.engine
    windows = []
    core.step_listeners.append(lambda out, phases: windows.extend(i.window for i in out.requests if i.window))
    out = llm.generate(_prompts(2), GREEDY)
    assert bool(windows) is runs
    assert [o.token_ids for o in out] == [hf_greedy(make_tiny_model(), p, 40, ignore_eos=True) for p in _prompts(2)]
