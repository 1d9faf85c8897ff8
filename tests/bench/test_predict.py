"""`batchserve bench --simulate --curve`: none and lookahead-adaptive tokens/s predicted from replayed
acceptance and a cost curve. On the synthetic curve (flat to a knee, then linear) the outcome is
deterministic arithmetic: asserted exactly."""

from __future__ import annotations

import random

import pytest

from batchserve.bench.curve import synthetic_profile
from batchserve.bench.predict import predict, prediction_table, run_loop
from batchserve.bench.simulate import Encoded
from batchserve.cli import main


def _copying_workload(n: int, seed: int = 0) -> list[Encoded]:
    """Outputs that copy stretches of their prompt, as code edits and RAG answers do: the trie's
    own-text drafts get accepted."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(2, 2000) for _ in range(60)]
        a, b = rng.randrange(0, 20), rng.randrange(0, 20)
        output = [*prompt[a : a + 30], rng.randrange(2, 2000), *prompt[b : b + 25], 1]
        out.append(Encoded(prompt, output))
    return out


def test_none_pays_the_curve_for_its_rows_and_emits_one_token_per_request() -> None:
    profile = synthetic_profile(base_ms=10.0, knee=16)
    test = _copying_workload(40)
    full, every = run_loop(profile, test, 8)
    assert full.tokens == full.request_steps and full.draft_tokens == 0
    assert full.tokens_per_s == pytest.approx(8 / 10.0 * 1e3)  # 8 rows, under the knee: 10 ms a step
    assert every.tokens == sum(len(s.output) for s in test)
    full, _ = run_loop(profile, test, 32)
    assert full.tokens_per_s == pytest.approx(32 / 20.0 * 1e3)  # twice the knee: twice the time


def test_adaptive_drafts_where_rows_are_free_and_not_where_the_curve_is_steep() -> None:
    profile = synthetic_profile(base_ms=10.0, knee=16)
    test = _copying_workload(80)
    warm = [s.output for s in _copying_workload(10, seed=1)]
    one, four, sixteen, sixty_four = predict(profile, warm, test, (1, 4, 16, 64))
    # Alone, up to 15 draft rows cost nothing: the drafts the policy sends pay off.
    assert one.adaptive_tokens_per_s > 1.5 * one.none_tokens_per_s and one.draft_tokens > 2
    assert four.ratio > 1.2 and 0 < four.draft_tokens < one.draft_tokens
    # From the knee on a draft row costs what a request's token does, and a draft is accepted less
    # than always: the policy drafts nothing, and the loop is plain decoding step for step.
    for p in (sixteen, sixty_four):
        assert p.draft_tokens == 0 and p.ratio == 1.0 and p.full_steps > 0
    table = prediction_table([one, sixty_four])
    assert table.splitlines()[0].startswith("| in flight | none tok/s | lookahead-adaptive tok/s | ratio |")
    assert "| 64 | " in table and "| 1.00x |" in table


def test_predict_cli_replays_humaneval_on_the_synthetic_curve(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--simulate", "--curve", "synthetic", "--dataset", "humaneval", "--num-samples", "12"]
    assert main([*argv, "--batch-sizes", "1,2", "--max-new-tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "synthetic-8ms-knee64" in out and "### humaneval: 6 test samples" in out
    rows = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2
