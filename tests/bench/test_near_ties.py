"""The GPU rows' lossless verdict: where a drafted run's output first differs from its engine's own
`none`, the top-1 minus top-2 logit margin there, and the verdict: identical, near-ties (rounding
can flip them), or a mismatch beyond the bound (a bug). On a CPU the comparison stays exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from batchserve.bench import sweep
from batchserve.bench.methods import make_row, pick_run
from batchserve.bench.near_ties import Divergence, divergences, first_difference, judge, lossless_cell, near_tie_bound
from batchserve.bench.report import write_report
from batchserve.bench.runs import EngineRun, PhaseTotals, Workload
from tests.conftest import hf_greedy, make_tiny_model

PROMPTS = [[5, 17, 3, 99], [9, 1, 44, 2]]
MAX_NEW, AT = 8, 3  # outputs' length; where prompt 0's output is made to differ


def _independent_margin(model: Any, prompt: list[int], reference: list[int], pos: int) -> tuple[float, float]:
    """(top-1, top-1 minus top-2) at output position `pos`, from one forward over the whole prompt
    and reference output (causal: the logits there see only what precedes them)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + reference])).logits[0, len(prompt) + pos - 1].float()
    best = logits.sort(descending=True).values
    return best[0].item(), (best[0] - best[1]).item()


def _runner_up(model: Any, prompt: list[int], reference: list[int], pos: int) -> int:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + reference[:pos]])).logits[0, -1]
    return int(logits.topk(2).indices[1])


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a prefix: where the shorter ends


def test_the_bound_is_four_ulps_of_the_top_logit_floored_at_one() -> None:
    bf16 = torch.finfo(torch.bfloat16).eps
    assert bf16 == 2**-7
    assert near_tie_bound(20.0, bf16) == 4 * 20 / 128 == 0.625
    assert near_tie_bound(-20.0, bf16) == 0.625
    assert near_tie_bound(0.1, bf16) == 4 / 128  # below 1: the floor


def test_a_difference_at_a_large_margin_is_a_mismatch_at_its_position() -> None:
    model = make_tiny_model()  # float32: a margin beyond 4 ulps of float32 is anything but a tie
    reference = [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    other = _runner_up(model, PROMPTS[0], reference[0], AT)
    outputs = [reference[0][:AT] + [other] * (MAX_NEW - AT), reference[1]]

    found = divergences(model, PROMPTS, outputs, reference)
    assert [(d.prompt, d.position) for d in found] == [(0, AT)]
    top1, margin = _independent_margin(model, PROMPTS[0], reference[0], AT)
    assert found[0].top1 == pytest.approx(top1, abs=1e-4)
    assert found[0].margin == pytest.approx(margin, abs=1e-4) and margin > 0.01
    assert found[0].bound == near_tie_bound(found[0].top1, torch.finfo(torch.float32).eps)
    assert not found[0].near_tie

    row = make_row("lookahead", "d", 1, outputs, 1.0, [0.1], [0.1], 1.0, False)
    judge(row, found)
    assert row.lossless is False and row.near_ties is None
    assert row.divergences == [found[0]._asdict()]
    assert lossless_cell(row).startswith(f"**NO** (prompt 0 at token {AT}: margin ")


def test_a_difference_at_a_forced_tie_is_a_near_tie() -> None:
    model = make_tiny_model(dtype=torch.bfloat16)
    reference = [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    best, other = reference[0][AT], _runner_up(model, PROMPTS[0], reference[0], AT)
    with torch.no_grad():  # the runner-up's LM head row := the winner's: their logits tie
        model.lm_head.weight[other] = model.lm_head.weight[best]
    outputs = [reference[0][:AT] + [other] * (MAX_NEW - AT), reference[1]]

    found = divergences(model, PROMPTS, outputs, reference)
    assert [(d.prompt, d.position) for d in found] == [(0, AT)]
    assert found[0].margin <= 2**-7 * abs(found[0].top1)  # at most an ulp apart
    assert found[0].bound == near_tie_bound(found[0].top1, 2**-7) and found[0].near_tie

    row = make_row("lookahead", "d", 1, outputs, 1.0, [0.1], [0.1], 1.0, False)
    judge(row, found)
    # not lossless=False: `batchserve bench` fails a run only on False (commands.py)
    assert row.lossless is None and row.near_ties == 1 and lossless_cell(row) == "near-ties (1)"

    clean = make_row("lookahead", "d", 1, reference, 0.5, [0.1], [0.1], 1.0, True)
    judge(clean, [])
    assert clean.lossless is True and clean.near_ties is None and clean.divergences is None
    # the kept run (the fastest) carries the worst verdict among the runs
    kept = pick_run([row, clean], "fastest")
    assert kept.tokens_per_s == clean.tokens_per_s and kept.near_ties == 1 and kept.lossless is None
    mismatch = make_row("lookahead", "d", 1, outputs, 4.0, [0.1], [0.1], 1.0, False)
    judge(mismatch, [found[0]._replace(margin=1.0, bound=0.1)])
    kept = pick_run([row, clean, mismatch], "fastest")
    assert kept.lossless is False and kept.near_ties is None and kept.divergences == mismatch.divergences


class _Bar:
    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass


@pytest.mark.parametrize("on_device", [True, False])
def test_the_sweep_judges_near_ties_on_a_device_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, on_device: bool
) -> None:
    model = make_tiny_model(dtype=torch.bfloat16)
    reference = [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    best, other = reference[0][AT], _runner_up(model, PROMPTS[0], reference[0], AT)
    with torch.no_grad():
        model.lm_head.weight[other] = model.lm_head.weight[best]
    outputs = [reference[0][:AT] + [other] * (MAX_NEW - AT), reference[1]]
    decode = [(MAX_NEW - 1, 0.5)] * 2
    run = EngineRun(outputs, 1.0, [0.1] * 2, [0.1] * 2, 1.0, 0.0, PhaseTotals(1), None, decode=decode)
    monkeypatch.setattr(sweep, "run_batchserve", lambda *a, **k: run)
    s = sweep._Sweep(["none", "lookahead"], MAX_NEW, 16, 1, "fastest", model, model, None, {}, _Bar())
    s.on_device = on_device
    if on_device:  # the engine's own `none` is the reference
        s.own_references[("float32", ("d", 1, None))] = reference
    row = sweep._batchserve_row(s, "d", 1, "lookahead", PROMPTS, reference, Workload(PROMPTS, []))

    assert row.decode_tokens_per_s == 14.0  # 2 x 7 tokens after the first / 2 x 0.5 s
    if not on_device:  # a CPU row stays exact: judged by HF greedy, no margins
        assert row.lossless is False and row.near_ties is None and row.divergences is None
        return
    assert row.lossless is None and row.near_ties == 1
    assert [Divergence(**d).position for d in row.divergences or []] == [AT]
    write_report([row], tmp_path, 2, MAX_NEW, 16)
    report = (tmp_path / "report.md").read_text()
    assert "| near-ties (1) |" in report and f"- lookahead b=1: prompt 0 at token {AT}: margin " in report
