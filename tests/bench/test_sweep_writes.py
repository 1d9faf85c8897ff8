"""The bench sweep writes results.json and report.md as each row finishes: a sweep stopped by a
time limit (the GPU check runs it under `timeout`) keeps every row it finished."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import make_tiny_model


class Stopped(Exception):
    """Stands for the time limit's interrupt."""


def test_a_stopped_sweep_leaves_every_finished_row_in_results_and_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model: Any, tiny_tokenizer: Any
) -> None:
    from batchserve import runner
    from batchserve.bench import sweep
    from batchserve.bench.methods import make_row
    from batchserve.model import loader

    reference = [[10, 11, 12, 13], [5, 6, 7, 8]]
    monkeypatch.setattr(runner, "load_model", lambda path, dtype: (tiny_model, tiny_tokenizer))
    # The rows are faked: no run needs SmolLM2, which the sweep loads through `loader` (twice; the
    # engines' copy gets its attention replaced, so a fresh tiny model, never the shared one).
    monkeypatch.setattr(loader, "load_model", lambda path, dtype: (make_tiny_model(), tiny_tokenizer))
    monkeypatch.setattr(sweep, "load_dataset", lambda name, n, tok: sweep.Workload([[1, 2], [3, 4, 5]], []))
    monkeypatch.setattr(sweep, "run_hf", lambda m, prompts, *a, **k: (reference[: len(prompts)], 1.0, [0.1], [0.1]))
    out = tmp_path / "out"
    seen: list[tuple[str, int, list[str]]] = []  # each run: (method, batch, the rows on disk when it started)

    def fake_row(s: Any, dataset: str, b: int, method: str, prompts: list[list[int]], *args: Any, **kw: Any) -> Any:
        seen.append((method, b, [r["method"] for r in json.loads((out / "results.json").read_text())]))
        if (method, b) == ("none", 2):
            raise Stopped
        return make_row(method, dataset, b, reference[: len(prompts)], 1.0, [0.1], [0.1], 1.0, True)

    monkeypatch.setattr(sweep, "_batchserve_row", fake_row)
    with pytest.raises(Stopped):
        sweep.run(["humaneval"], ["hf", "none", "lookahead"], [1, 2], 2, 4, out, None)
    # Every run found the rows before it written, the peer's first.
    assert seen == [("none", 1, ["hf"]), ("lookahead", 1, ["hf", "none"]), ("none", 2, ["hf", "none", "lookahead"])]
    rows = json.loads((out / "results.json").read_text())
    assert [(r["method"], r["batch_size"]) for r in rows] == [("hf", 1), ("none", 1), ("lookahead", 1)]
    report = (out / "report.md").read_text()
    assert "| hf | 1 |" in report and "| none | 1 |" in report and "| lookahead | 1 |" in report
    assert not (out / "throughput.png").exists()  # drawn at the end only


def test_a_repeated_sweep_stopped_in_its_last_round_keeps_the_rounds_it_ran(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model: Any, tiny_tokenizer: Any
) -> None:
    """Three rounds of (none, lookahead) at batch 1, stopped in the third: each row stands as the
    kept run of its two, marked provisional in results.json and report.md; files are whole."""
    from batchserve import runner
    from batchserve.bench import sweep
    from batchserve.bench.methods import make_row
    from batchserve.model import loader

    reference = [[10, 11, 12, 13], [5, 6, 7, 8]]
    monkeypatch.setattr(runner, "load_model", lambda path, dtype: (tiny_model, tiny_tokenizer))
    monkeypatch.setattr(loader, "load_model", lambda path, dtype: (make_tiny_model(), tiny_tokenizer))
    monkeypatch.setattr(sweep, "load_dataset", lambda name, n, tok: sweep.Workload([[1, 2], [3, 4, 5]], []))
    monkeypatch.setattr(sweep, "run_hf", lambda m, prompts, *a, **k: (reference[: len(prompts)], 1.0, [0.1], [0.1]))
    runs = iter([1.0, 2.0, 4.0, 1.0])  # seconds: none, lookahead, none, lookahead; then the third round

    def fake_row(s: Any, dataset: str, b: int, method: str, prompts: list[list[int]], *args: Any, **kw: Any) -> Any:
        seconds = next(runs, None)
        if seconds is None:
            raise Stopped
        return make_row(method, dataset, b, reference[: len(prompts)], seconds, [0.1], [0.1], 1.0, True)

    monkeypatch.setattr(sweep, "_batchserve_row", fake_row)
    out = tmp_path / "out"
    with pytest.raises(Stopped):
        sweep.run(["humaneval"], ["hf", "none", "lookahead"], [1], 2, 4, out, None, repeats=3, keep="median")
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())}
    assert rows["hf"]["runs_done"] is None and rows["none"]["runs_done"] == rows["lookahead"]["runs_done"] == 2
    assert rows["none"]["run_tokens_per_s"] == [8.0, 2.0] and rows["none"]["seconds"] == 4.0  # the lower middle
    assert (
        "**Provisional**" in (out / "report.md").read_text()
        and "none b=1 (2 runs so far)" in (out / "report.md").read_text()
    )
    assert sorted(f.name for f in out.iterdir() if f.name.endswith(".part")) == []  # written whole, then renamed


def test_a_sweep_of_served_rows_only_loads_no_model_in_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_tokenizer: Any
) -> None:
    """The servers load the model; the bench process needs its tokenizer only (an 8B file's float32
    copy, which transformers' load makes, would not fit beside them)."""
    from batchserve.bench import sweep
    from batchserve.bench.methods import make_row
    from batchserve.model import loader

    def no_model(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a served-only sweep loaded the model in process")

    monkeypatch.setattr(loader, "load_model", no_model)
    monkeypatch.setattr(loader, "load_tokenizer", lambda path: tiny_tokenizer)
    monkeypatch.setattr(sweep, "load_dataset", lambda name, n, tok: sweep.Workload([[1, 2], [3, 4, 5]], []))
    monkeypatch.setattr(sweep, "served_peers", lambda *args: None)
    ran: list[tuple[str, int]] = []

    def served_row(s: Any, dataset: str, b: int, method: str, prompts: list[list[int]], work: Any) -> Any:
        ran.append((method, b))
        return make_row(method, dataset, b, [[1]] * len(prompts), 1.0, [0.1], [0.1], None, None)

    monkeypatch.setattr(sweep, "_served_row", served_row)
    rows = sweep.run(["humaneval"], ["served-http-none", "served-grpc-none"], [1, 2], 2, 4, tmp_path / "out", None)
    assert ran == [("served-http-none", 1), ("served-grpc-none", 1), ("served-http-none", 2), ("served-grpc-none", 2)]
    assert len(rows) == 4
