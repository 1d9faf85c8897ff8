"""`batchserve plot`: bench results read back from results.json, and the concurrency figure."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import matplotlib
import pytest

from batchserve.bench.methods import Row, read_rows
from batchserve.bench.plots import _palette, _plot_speedup
from batchserve.cli import main

matplotlib.use("Agg")


def _row(method: str, b: int, tps: float, dataset: str = "code-edit", rate: float | None = None) -> Row:
    return Row(method, dataset, b, 4, 40, 1.0, tps, 2.0, 0.1, 0.2, 0.01, 0.02, True, request_rate=rate)


def _write(path: Path, rows: list[Row]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.json").write_text(json.dumps([asdict(r) for r in rows]))
    return path


def test_rows_read_back_from_several_runs_the_later_run_standing_for_a_point(tmp_path: Path) -> None:
    first = _write(tmp_path / "a", [_row("none-bf16", 1, 30.0), _row("none-bf16", 2, 50.0)])
    second = _write(tmp_path / "b", [_row("none-bf16", 2, 55.0), _row("none-bf16", 2, 9.0, rate=3.0)])
    extra = json.loads((second / "results.json").read_text())
    extra[0]["a_field_from_a_later_version"] = 1  # ignored, not an error
    (second / "results.json").write_text(json.dumps(extra))
    rows = read_rows([first, second / "results.json"])
    got = {(r.method, r.batch_size, r.request_rate): r.tokens_per_s for r in rows}
    assert got == {("none-bf16", 1, None): 30.0, ("none-bf16", 2, None): 55.0, ("none-bf16", 2, 3.0): 9.0}


@pytest.mark.parametrize(
    "content",
    [None, "not json", '{"method": "none"}', '[{"method": "none"}]', '[{"x": 1}]'],
    ids=["missing", "not-json", "not-a-list", "missing-fields", "not-a-row"],
)
def test_what_is_not_a_bench_results_file_is_named_in_the_error(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=r"results\.json: not a bench results\.json"):
        read_rows([path])


def test_a_row_with_a_non_numeric_speed_is_refused(tmp_path: Path) -> None:
    item = asdict(_row("none", 1, 1.0))
    item["tokens_per_s"] = "fast"
    (tmp_path / "results.json").write_text(json.dumps([item]))
    with pytest.raises(ValueError, match="not a number"):
        read_rows([tmp_path])


def test_the_speedup_panel_divides_by_none_on_the_same_weights() -> None:
    import matplotlib.pyplot as plt

    rows = [
        _row("none-bf16", 1, 20.0),
        _row("none-bf16", 4, 50.0),
        _row("none-gguf", 1, 40.0),
        _row("lookahead-adaptive-bf16", 1, 50.0),
        _row("lookahead-adaptive-bf16", 4, 48.0),
        _row("lookahead-adaptive-gguf", 1, 60.0),
        _row("lookahead-adaptive-gguf", 4, 99.0),  # no none-gguf at 4: no point
        _row("lookahead-adaptive-bf16", 1, 1.0, dataset="doc-qa"),  # another dataset's panel
    ]
    fig, ax = plt.subplots()
    _plot_speedup(ax, rows, "code-edit", _palette(rows))
    curves = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    plt.close(fig)
    assert curves["lookahead-adaptive-bf16 / none-bf16"] == ([1, 4], [2.5, 0.96])
    assert curves["lookahead-adaptive-gguf / none-gguf"] == ([1], [1.5])
    assert "0.97x" in curves  # the line drafting must stay above


def test_plot_command_writes_the_figure_and_refuses_bad_input(tmp_path: Path, capsys) -> None:
    run = _write(
        tmp_path / "run",
        [_row(m, b, t) for m, b, t in [("none-bf16", 1, 20.0), ("none-bf16", 2, 35.0)]]
        + [_row("lookahead-adaptive-bf16", b, t) for b, t in [(1, 40.0), (2, 50.0)]]
        + [_row("none-bf16", 1, 30.0, dataset="doc-qa"), _row("lookahead-adaptive-bf16", 1, 45.0, dataset="doc-qa")],
    )
    out = tmp_path / "concurrency.png"
    assert main(["plot", str(run), "--out", str(out), "--title", "a test"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "6 points of code-edit, doc-qa" in capsys.readouterr().out
    assert main(["plot", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.png")]) == 2
    assert "not a bench results.json" in capsys.readouterr().err
    assert main(["plot", str(run), "--out", str(tmp_path / "z.png"), "--methods", "hf"]) == 2  # nothing left
    assert "no closed-loop rows" in capsys.readouterr().err
    open_loop = _write(tmp_path / "open", [_row("none", 8, 10.0, rate=2.0)])
    assert main(["plot", str(open_loop), "--out", str(tmp_path / "y.png")]) == 2
    assert "no closed-loop rows" in capsys.readouterr().err
    assert not any((tmp_path / f).exists() for f in ("x.png", "y.png", "z.png"))


def test_the_bench_plot_skips_a_run_without_closed_loop_rows(tmp_path: Path) -> None:
    from batchserve.bench.plots import plot

    plot([_row("none", 8, 10.0, rate=2.0)], tmp_path / "open.png")  # a long run never fails at its last line
    assert not (tmp_path / "open.png").exists()
    plot([_row("none", 1, 10.0), _row("lookahead", 1, 20.0)], tmp_path / "closed.png")
    assert (tmp_path / "closed.png").read_bytes()[:4] == b"\x89PNG"
