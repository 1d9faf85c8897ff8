"""The bench's datasets, its simulation and its CLI, and the sweep against HF peers (slow)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from batchserve.bench.datasets import humaneval, sharegpt, sharegpt_multiturn, split, system_prompt
from batchserve.cli import main
from tests.conftest import smollm2_copy


def test_humaneval_has_all_problems_with_solutions() -> None:
    problems = humaneval()
    assert len(problems) == 164
    assert problems[0].id == "HumanEval/0" and "def " in problems[0].prompt and problems[0].reference.strip()
    dev, test = split(problems)
    assert len(dev) == len(test) == 82 and not {p.id for p in dev} & {p.id for p in test}


def test_sharegpt_reads_first_turns_record_by_record() -> None:
    samples = sharegpt(40)
    assert len(samples) == 40
    assert all(s.chat and s.prompt.strip() and s.reference.strip() for s in samples)
    assert len({s.id for s in samples}) == 40


def test_multiturn_second_turns_follow_their_first_turn_and_reference_reply() -> None:
    pairs = sharegpt_multiturn(20)
    assert len(pairs) == 20
    for first, second in pairs:
        assert second.history == (("user", first.prompt), ("assistant", first.reference))
        assert second.prompt.strip() and second.reference.strip() and second.id != first.id
        assert [m["role"] for m in second.messages()] == ["user", "assistant", "user"]


def test_multiturn_history_is_a_token_prefix_of_the_second_turn() -> None:
    from batchserve.bench.runs import load_dataset
    from batchserve.runner import load_tokenizer

    work = load_dataset("sharegpt-multiturn", 6, load_tokenizer(None))
    assert len(work.prompts) == len(work.earlier) == 6
    # What the cache holds from the earlier request is where the second turn's prompt starts.
    assert all(p[: len(e)] == e and len(p) > len(e) for p, e in zip(work.prompts, work.earlier))


def test_engine_run_reports_the_share_of_prompt_tokens_the_cache_served(tiny_tokenizer: Any) -> None:
    from batchserve.bench.methods import batchserve_method
    from batchserve.bench.runs import run_batchserve
    from tests.conftest import make_tiny_model

    # Two conversations whose history (3 and 2 full blocks of 16) ran earlier: the second turns
    # find it in the cache, whatever the pool's default size, and compute only the rest.
    earlier = [[5 + i % 50 for i in range(48)], [60 + i % 40 for i in range(32)]]
    prompts = [earlier[0] + [7, 8, 9], earlier[1] + [11, 12, 13, 14]]
    on, off = batchserve_method("none"), batchserve_method("none+nocache")
    assert on is not None and off is not None
    model = make_tiny_model()  # the engine swaps its attention: not the shared reference copy
    cached = run_batchserve(model, tiny_tokenizer, prompts, 4, 2, on, [], 16, None, earlier)
    assert cached.cached_share == (48 + 32) / (51 + 36)
    plain = run_batchserve(model, tiny_tokenizer, prompts, 4, 2, off, [], 16, None, earlier)
    assert plain.cached_share is None and plain.outputs == cached.outputs


def test_system_prompt_workload_shares_one_long_system_prompt() -> None:
    samples = system_prompt(30)
    assert len(samples) == 30 and len({s.history for s in samples}) == 1
    ((role, text),) = samples[0].history
    assert role == "system" and len(text) > 1500 and all(len(s.prompt) <= 300 for s in samples)


def test_nocache_suffix_turns_prefix_caching_off_for_any_batchserve_method() -> None:
    from batchserve.bench.methods import BATCHSERVE, batchserve_method, known_method

    for name, m in BATCHSERVE.items():
        assert batchserve_method(name) == m and m.prefix_caching
        off = batchserve_method(name + "+nocache")
        assert off is not None and not off.prefix_caching and off == replace(m, prefix_caching=False)
    assert batchserve_method("hf") is None and not known_method("hf+nocache") and known_method("hf")


def test_fixed_length_jacobi_methods_run_the_window_every_step_and_shaped_ones_adapt() -> None:
    from batchserve.bench.methods import FIXED_LENGTHS, batchserve_method

    for n in FIXED_LENGTHS:
        for base in ("jacobi", "hybrid"):
            m = batchserve_method(f"{base}-{n}")
            assert m is not None and m.draft == base and not m.adaptive and m.decoding_length == n
            assert m.warm == (base == "hybrid")  # the hybrid's trie is warmed like lookahead's
    shaped = batchserve_method("hybrid-5-4")
    assert shaped is not None and shaped.adaptive and shaped.jacobi == (5, 4, 5)


def test_bench_simulate_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "bench",
                "--simulate",
                "--dataset",
                "humaneval",
                "--num-samples",
                "12",
                "--decoding-lengths",
                "4,16",
                "--no-speed",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| trie hierarchical | " in out and "| llma (suffix copy) | " in out and "L=16" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--dataset", "imagenet"],
        ["bench", "--simulate", "--dataset", "imagenet"],
        ["bench", "--methods", "vllm"],
        ["bench", "--methods", "hf+nocache"],  # a peer has no prefix cache to turn off
        ["bench", "--methods", "none+cache"],
        ["bench", "--simulate", "--dataset", "system-prompt"],
        ["bench", "--num-prompts", "0"],
    ],
)
def test_bench_cli_refuses_what_it_cannot_do(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "batchserve bench:" in capsys.readouterr().err


def test_bench_cli_rejects_malformed_numbers() -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--simulate", "--decoding-lengths", "a,b"])


# results.json: the keys every row has, and the (method, batch) rows of the sweep below.
ROW_KEYS = {
    "method",
    "dataset",
    "batch_size",
    "num_prompts",
    "output_tokens",
    "seconds",
    "tokens_per_s",
    "tokens_per_step",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "lossless",
}
# float32 named (-f32): checked against HF greedy (a plain name runs make serve's weights).
ENGINE_METHODS = ("none-f32", "lookahead-f32", "lookahead-4-f32", "lookahead-adaptive-f32", "lookahead-f32+nocache")
SWEEP_ROWS = {("hf", 1), ("hf-prompt-lookup", 1), ("hf-batch", 1), ("hf-batch", 2)} | {
    (m, b) for m in ENGINE_METHODS for b in (1, 2)
}
SWEEP_ARGV = [
    "bench",
    "--dataset",
    "humaneval",
    "--num-prompts",
    "2",
    "--batch-sizes",
    "1,2",
    "--methods",
    ",".join(("hf", "hf-prompt-lookup", "hf-batch", *ENGINE_METHODS)),
    "--max-new-tokens",
    "6",
    "--repeats",
    "2",
    "--waves",
    "2",  # batch 2 runs 4 prompts: the loop stays full
]


def _quick_calibration(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """The adaptive method calibrates on first use: a small, fast calibration into a fresh cache."""
    from batchserve.runner import calibrate as cal

    monkeypatch.setenv("BATCHSERVE_CACHE_DIR", str(cache))
    real = cal.calibrate

    def quick(runner: Any, **kwargs: Any) -> Any:
        return real(runner, max_tokens=16, contexts=(64,), repeats=1, progress=False, key=kwargs.get("key"))

    monkeypatch.setattr(cal, "calibrate", quick)


def _copies_of_the_session_load(monkeypatch: pytest.MonkeyPatch, smollm2: tuple[Any, Any]) -> None:
    """The sweep loads SmolLM2 in float32 twice, HF's reference and the engines' model: each a copy
    of the session's `load_model(None, "float32")` of the same file, not two more conversions of
    it (about 15 s of a core each; that load is the `smollm2` fixture's, checked in test_loader)."""
    from batchserve.model import loader

    real = loader.load_model

    def load_model(path: Any = None, dtype: str = "auto", device: str = "auto") -> tuple[Any, Any]:
        if path is None and dtype == "float32" and device == "auto":
            return smollm2_copy(smollm2)
        return real(path, dtype, device)

    monkeypatch.setattr(loader, "load_model", load_model)


def _check_rows(rows: list[dict[str, Any]]) -> None:
    assert all(ROW_KEYS <= set(r) for r in rows)
    by = {(r["method"], r["batch_size"]): r for r in rows}
    assert set(by) == SWEEP_ROWS
    assert by[("lookahead-4-f32", 1)]["mean_decoding_length"] <= 4 and by[("none-f32", 1)]["mean_decoding_length"] == 0
    assert by[("hf", 1)]["num_prompts"] == by[("hf-prompt-lookup", 1)]["num_prompts"] == 2
    assert by[("hf-batch", 2)]["num_prompts"] == 4
    for m in ENGINE_METHODS:
        assert by[(m, 1)]["num_prompts"] == 2 and by[(m, 2)]["num_prompts"] == 4
        assert by[(m, 1)]["output_tokens"] == by[("hf", 1)]["output_tokens"]
        assert by[(m, 2)]["output_tokens"] == by[("none-f32", 2)]["output_tokens"]
        for b in (1, 2):
            r = by[(m, b)]
            assert r["lossless"] is True
            # The CPU attention is timed: part of the forward, and a share of the step.
            assert 0 < r["phase_ms"]["attention"] < r["phase_ms"]["forward"] < r["phase_ms"]["wall"]
            assert 0 < r["attention_share"] < 1
            assert r["decode_step_ms"] > 0  # 6 new tokens: some steps carry no prompt chunk
            assert (r["cached_share"] is None) == m.endswith("+nocache")
    assert by[("hf", 1)]["lossless"] is None
    assert all(r["tokens_per_s"] > 0 and r["ttft_p50_s"] > 0 for r in rows)


@pytest.mark.slow
def test_bench_against_peers_writes_results_report_and_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2: tuple[Any, Any]
) -> None:
    _quick_calibration(monkeypatch, tmp_path / "cache")
    _copies_of_the_session_load(monkeypatch, smollm2)
    out = tmp_path / "bench"
    assert main([*SWEEP_ARGV, "--out", str(out)]) == 0
    _check_rows(json.loads((out / "results.json").read_text()))
    report = (out / "report.md").read_text()
    assert "fastest of 2 runs" in report and "adaptive / best fixed" in report
    assert "max(2, 2 x batch) prompts" in report
    assert "| lookahead-f32 | 2 |" in report and "vs hf-batch" in report and "attention share" in report
    assert "| prompt cached |" in report
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"


def test_repeated_runs_keep_the_fastest_or_the_median_and_any_mismatch() -> None:
    from batchserve.bench.methods import Row, pick_run
    from batchserve.bench.report import _every_run

    def row(tps: float, lossless: bool = True) -> Row:
        return Row("none", "humaneval", 1, 2, 10, 1.0, tps, 1.0, 0.1, 0.1, 0.1, 0.1, lossless)

    runs = [row(30.0), row(45.0), row(20.0)]  # one lucky run, one unlucky
    assert pick_run(runs, "fastest").tokens_per_s == 45.0
    assert pick_run(runs, "median").tokens_per_s == 30.0
    assert pick_run([row(20.0), row(30.0)], "median").tokens_per_s == 20.0  # even count: the lower middle
    marked = pick_run([row(30.0), row(45.0, lossless=False)], "median")
    assert marked.tokens_per_s == 30.0 and marked.lossless is False
    assert pick_run(runs, "median").run_tokens_per_s == [30.0, 45.0, 20.0]  # every run, in round order
    assert pick_run([row(30.0)], "median").run_tokens_per_s is None
    open_loop = replace(pick_run(runs, "median"), request_rate=2.5)
    (line,) = _every_run([pick_run(runs, "fastest"), open_loop, pick_run([row(30.0)], "median")])
    assert (
        line.strip()
        == "Every run's tokens/s, in round order: none b=1: 30.0, 45.0, 20.0; none 2.5 req/s: 30.0, 45.0, 20.0."
    )
    with pytest.raises(SystemExit):
        main(["bench", "--keep", "mean"])


def test_the_report_says_where_the_dataset_held_fewer_prompts_than_asked() -> None:
    from batchserve.bench.methods import Row
    from batchserve.bench.report import _short_of_prompts

    def row(method: str, b: int, n: int, rate: float | None = None) -> Row:
        return Row(method, "humaneval", b, n, 10, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.1, None, request_rate=rate)

    # 82 test prompts, 16 asked, --waves 2: b=8 asks 16 (all there), b=64 asks 128, and the open loop too
    rows = [
        row("hf", 1, 16),
        row("none", 8, 16),
        row("none", 64, 82),
        row("lookahead", 64, 82),
        row("none", 64, 82, 6.0),
    ]
    (line,) = _short_of_prompts(rows, 16, 2)
    assert line.strip() == (
        "The dataset holds fewer test prompts than asked: b=64 ran 82 of the 128 asked for, "
        "6 req/s ran 82 of the 128 asked for."
    )
    assert _short_of_prompts(rows[:2], 16, 2) == []
    (peer,) = _short_of_prompts([row("hf", 1, 10)], 16, 2)  # a peer runs the first --num-prompts
    assert "b=1 ran 10 of the 16 asked for" in peer


def test_closed_loop_ttft_counts_from_when_a_seat_frees() -> None:
    from types import SimpleNamespace

    from batchserve.bench.runs import closed_loop_ttfts

    def req(first: float, finish: float) -> SimpleNamespace:
        return SimpleNamespace(arrival_time=0.0, first_token_time=first, finish_time=finish)

    # Two seats, four requests all sent at t=0: the third gets the seat freed at t=2, the
    # fourth the one freed at t=3, however long the engine then takes to admit them.
    results = [req(1.0, 3.0), req(1.5, 2.0), req(4.0, 6.0), req(5.0, 7.0)]
    assert closed_loop_ttfts(results, 2) == [1.0, 1.5, 2.0, 2.0]
    assert closed_loop_ttfts(results, 4) == [1.0, 1.5, 4.0, 5.0]  # all in flight from the start


def test_the_hf_methods_run_the_transformers_forward_with_their_own_cost_profile():
    from batchserve.bench.methods import batchserve_method

    ours, theirs = batchserve_method("lookahead-adaptive"), batchserve_method("lookahead-adaptive-hf")
    assert ours.model_impl == "auto" and theirs.model_impl == "transformers"
    assert ours.kernels != theirs.kernels  # the sweep measures a profile for each
    assert batchserve_method("none-hf").draft == "none"
