"""The bench's throughput.png (throughput, latency and draft tokens against load, per dataset) and
the concurrency figure `batchserve plot` draws from runs' results (throughput and speedup over
plain decoding against requests in flight, TPOT against throughput)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from batchserve.bench.methods import PEERS, Row, method_rank, none_of


def _palette(rows: list[Row]) -> dict[str, Any]:
    """One colour per method of a figure, the same in every panel, distinct while there are at
    most 20 methods: tab10's in the order the tables list them, then tab20's lighter shades."""
    import matplotlib

    methods = sorted({r.method for r in rows}, key=method_rank)
    tab10, tab20 = matplotlib.colormaps["tab10"], matplotlib.colormaps["tab20"]
    return {m: tab10(i) if i < 10 else tab20((2 * (i - 10) + 1) % 20) for i, m in enumerate(methods)}


def _plot_throughput(ax: Any, rows: list[Row], dataset: str, colors: dict[str, Any]) -> None:
    """Top panel: output tokens/s against batch size, peers dashed."""
    for m in sorted({r.method for r in rows}, key=method_rank):
        pts = sorted((r.batch_size, r.tokens_per_s) for r in rows if r.dataset == dataset and r.method == m)
        if not pts:
            continue
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", label=m, linestyle="--" if m in PEERS else "-", color=colors[m])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (requests in flight)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(dataset)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_latency(ax: Any, rows: list[Row], dataset: str, colors: dict[str, Any]) -> None:
    """Middle panel: TPOT p50 against throughput, one point per batch size (down and right is better)."""
    for m in sorted({r.method for r in rows}, key=method_rank):
        pts = sorted(
            (r.batch_size, r.tokens_per_s, r.tpot_p50_s * 1e3) for r in rows if r.dataset == dataset and r.method == m
        )
        if not pts:
            continue
        _, xs, ys = zip(*pts)  # in order of batch size: the curve a growing load traces
        ax.plot(xs, ys, marker="o", label=m, linestyle="--" if m in PEERS else "-", color=colors[m])
        for b, x, y in pts:
            ax.annotate(str(b), (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("output tokens / s (labels: batch size)")
    ax.set_ylabel("TPOT p50 (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_draft_tokens(ax: Any, rows: list[Row], dataset: str, colors: dict[str, Any]) -> None:
    """Bottom panel: mean draft tokens per request step against batch size (drafting methods)."""
    for m in sorted({r.method for r in rows}, key=method_rank):
        pts = sorted(
            (r.batch_size, r.mean_decoding_length)
            for r in rows
            if r.dataset == dataset and r.method == m and r.mean_decoding_length is not None and m != "none"
        )
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", label=m, color=colors[m])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (requests in flight)")
    ax.set_ylabel("mean draft tokens per request step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a run without drafting methods leaves the panel empty
        ax.legend(fontsize=8)


def plot(rows: list[Row], path: Path) -> None:
    """The plot at `path`: one column per dataset; throughput against batch size, TPOT against
    throughput, draft tokens per step against batch size. None without closed-loop rows."""
    if any(r.request_rate is None for r in rows):
        _draw(rows, path, (_plot_throughput, _plot_latency, _plot_draft_tokens), (6, 12), dpi=110)


# The line the adaptive policy must stay above at every load: drafts never make a server slower.
NEVER_BELOW = 0.97


def _plot_speedup(ax: Any, rows: list[Row], dataset: str, colors: dict[str, Any]) -> None:
    """Each drafting method's tokens/s over `none` on the same weights, against batch size."""
    plain = {(r.method, r.batch_size): r.tokens_per_s for r in rows if r.dataset == dataset}
    for m in sorted({r.method for r in rows}, key=method_rank):
        if m in PEERS or m.startswith("none"):
            continue
        pts = sorted(
            (r.batch_size, r.tokens_per_s / plain[(none_of(m), r.batch_size)])
            for r in rows
            if r.dataset == dataset and r.method == m and plain.get((none_of(m), r.batch_size), 0) > 0
        )
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", label=f"{m} / {none_of(m)}", color=colors[m])
            for x, y in pts:
                ax.annotate(f"{y:.2f}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.axhline(NEVER_BELOW, color="red", linewidth=0.8, linestyle=":", label=f"{NEVER_BELOW}x")
    low, high = ax.get_ylim()
    ax.set_ylim(min(low, NEVER_BELOW - 0.07), high)  # the line in view, clear of the axis
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (requests in flight)")
    ax.set_ylabel("speedup over none (tokens/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_concurrency(rows: list[Row], path: Path, title: str | None = None) -> None:
    """The concurrency figure at `path`, one column per dataset: throughput against batch size,
    speedup over `none` against batch size (with the 0.97x line), TPOT against throughput.
    Closed-loop rows only; ValueError without any."""
    _draw(rows, path, (_plot_throughput, _plot_speedup, _plot_latency), (5, 11), dpi=80, title=title)


Panel = Callable[[Any, list[Row], str, dict[str, Any]], None]  # (axes, rows, dataset, colours)


def _draw(
    rows: list[Row], path: Path, panels: Sequence[Panel], size: tuple[float, float], dpi: int, title: str | None = None
) -> None:
    """A figure of the closed-loop rows at `path`: a column per dataset (`size`: one column's
    width and the height, in inches), a row per panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.request_rate is None]  # the curves are the closed loop's
    datasets = list(dict.fromkeys(r.dataset for r in rows))
    if not datasets:
        raise ValueError("no closed-loop rows to plot (of the methods asked for)")
    fig, axes = plt.subplots(len(panels), len(datasets), figsize=(size[0] * len(datasets), size[1]), squeeze=False)
    colors = _palette(rows)
    for column, dataset in enumerate(datasets):
        for row, panel in enumerate(panels):
            panel(axes[row][column], rows, dataset, colors)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
