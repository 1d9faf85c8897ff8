"""The bench's throughput.png: throughput, latency and draft tokens against load, per dataset."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

from batchserve.bench.methods import METHODS, PEERS, Row, method_rank


def _color(method: str) -> Any:
    """One colour per method, the same in every panel."""
    import matplotlib

    # A +nocache row, or a jacobi-W-N shape: its method's colour, shifted.
    index, nocache, base = method_rank(method)
    variant = 0 if base in METHODS else zlib.crc32(base.encode()) % 7 + 1
    return matplotlib.colormaps["tab20"]((index + (10 if nocache else 0) + variant) % 20)


def _plot_throughput(ax: Any, rows: list[Row], dataset: str) -> None:
    """Top panel: output tokens/s against batch size, peers dashed."""
    for m in sorted({r.method for r in rows}, key=method_rank):
        pts = sorted((r.batch_size, r.tokens_per_s) for r in rows if r.dataset == dataset and r.method == m)
        if not pts:
            continue
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", label=m, linestyle="--" if m in PEERS else "-", color=_color(m))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (requests in flight)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(dataset)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_latency(ax: Any, rows: list[Row], dataset: str) -> None:
    """Middle panel: TPOT p50 against throughput, one point per batch size (down and right is better)."""
    for m in sorted({r.method for r in rows}, key=method_rank):
        pts = sorted(
            (r.batch_size, r.tokens_per_s, r.tpot_p50_s * 1e3) for r in rows if r.dataset == dataset and r.method == m
        )
        if not pts:
            continue
        _, xs, ys = zip(*pts)  # in order of batch size: the curve a growing load traces
        ax.plot(xs, ys, marker="o", label=m, linestyle="--" if m in PEERS else "-", color=_color(m))
        for b, x, y in pts:
            ax.annotate(str(b), (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("output tokens / s (labels: batch size)")
    ax.set_ylabel("TPOT p50 (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_draft_tokens(ax: Any, rows: list[Row], dataset: str) -> None:
    """Bottom panel: mean draft tokens per request step against batch size (drafting methods)."""
    for m in sorted({r.method for r in rows}, key=method_rank):
        pts = sorted(
            (r.batch_size, r.mean_decoding_length)
            for r in rows
            if r.dataset == dataset and r.method == m and r.mean_decoding_length is not None and m != "none"
        )
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", label=m, color=_color(m))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (requests in flight)")
    ax.set_ylabel("mean draft tokens per request step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot(rows: list[Row], path: Path) -> None:
    """The plot at `path`: one column per dataset; throughput against batch size, TPOT against
    throughput, draft tokens per step against batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.request_rate is None]  # the curves are the closed loop's
    datasets = list(dict.fromkeys(r.dataset for r in rows))
    fig, axes = plt.subplots(3, len(datasets), figsize=(6 * len(datasets), 12), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        _plot_throughput(ax, rows, dataset)
    for ax, dataset in zip(axes[1], datasets):
        _plot_latency(ax, rows, dataset)
    for ax, dataset in zip(axes[2], datasets):
        _plot_draft_tokens(ax, rows, dataset)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
