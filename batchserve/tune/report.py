"""The report of `batchserve tune`: tune.json, tune.md (the table and the answer) and tune.png."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from batchserve.tune.points import DRAFTS, TuneResult, closest


def write_tune_report(result: TuneResult, out_dir: Path, dataset: str, max_new: int) -> None:
    """DIR/tune.json (every point), tune.md (the table and the answer) and tune.png."""
    g = result.goals
    (out_dir / "tune.json").write_text(
        json.dumps(
            {
                "dataset": dataset,
                "goals": asdict(g),
                "points": [asdict(p) for p in result.points],
                "best": None if result.best is None else asdict(result.best),
                "confirmed_tokens_per_s": result.confirmed_tokens_per_s,
            },
            indent=1,
        )
    )
    p = f"p{g.percentile:g}"
    goals = ", ".join(
        f"{name} {p} <= {v:g} ms" for name, v in (("TTFT", g.ttft_ms), ("TPOT", g.tpot_ms)) if v is not None
    )
    lines = [
        f"# batchserve tune: {dataset}\n",
        f"Goals: {goals or 'none (the most throughput)'}. Closed loop, c clients and `--max-num-seqs c`, "
        f"{max_new} new tokens, greedy; each point on the CPU weights `auto` takes for its seats.\n",
        f"| drafts | max-num-seqs | max-num-batched-tokens | weights | tokens/s | TTFT {p} (ms) | TPOT {p} (ms) "
        "| tokens/step | same output as none | goals |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for pt in result.points:
        same = "-" if pt.lossless is None else ("yes" if pt.lossless else "**NO**")
        lines.append(
            f"| {pt.draft} | {pt.max_num_seqs} | {pt.max_num_batched_tokens} | {pt.weights or '-'} | "
            f"{pt.tokens_per_s:.1f} | "
            f"{pt.ttft_ms:.0f} | {pt.tpot_ms:.1f} | {pt.tokens_per_step:.2f} | {same} | "
            f"{'met' if pt.meets else pt.missed} |"
        )
    lines.append("")
    lines.extend(answer_lines(result))
    (out_dir / "tune.md").write_text("\n".join(lines) + "\n")
    plot_tune(result, out_dir / "tune.png")


def answer_lines(result: TuneResult) -> list[str]:
    """The recommendation and the flags to serve with, or why there is none."""
    best = result.best
    if best is None:
        near = closest(result.points, result.goals)
        out = ["**No setting measured meets the goals.**"]
        if near is not None:
            out.append(
                f"Closest: {near.draft}, {near.max_num_seqs} seqs ({near.missed}). Loosen the goals, or serve "
                "fewer requests at once on a faster machine."
            )
        return out
    out = [
        f"**Recommended:** {best.draft} at {best.max_num_seqs} running request{'s' if best.max_num_seqs > 1 else ''}, "
        f"{best.max_num_batched_tokens} tokens per step: {best.tokens_per_s:.1f} tokens/s predicted.",
        "",
        f"    batchserve serve {best.serve_flags()}",
    ]
    if result.confirm_ratio is not None:
        out.append(
            f"\nConfirmed by a second run: {result.confirmed_tokens_per_s:.1f} tokens/s "
            f"({result.confirm_ratio:.2f}x the prediction)."
        )
    return out


def plot_tune(result: TuneResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = result.goals
    fig, (top, bottom) = plt.subplots(1, 2, figsize=(12, 4.5))
    for draft in DRAFTS:
        pts = sorted(
            (p.max_num_seqs, p.tokens_per_s, p.tpot_ms)
            for p in result.points
            if p.draft == draft and p.max_num_batched_tokens == (result.points[0].max_num_batched_tokens)
        )
        if not pts:
            continue
        cs, tps, tpots = zip(*pts)
        top.plot(cs, tps, marker="o", label=draft)
        bottom.plot(tps, tpots, marker="o", label=draft)
        for c, x, y in pts:
            bottom.annotate(str(c), (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    if result.best is not None:
        top.plot([result.best.max_num_seqs], [result.best.tokens_per_s], "k*", markersize=14, label="recommended")
    if g.tpot_ms is not None:
        bottom.axhline(g.tpot_ms, color="red", linestyle=":", label=f"TPOT goal (p{g.percentile:g})")
    top.set_xscale("log", base=2)
    seats = sorted({p.max_num_seqs for p in result.points})
    top.set_xticks(seats, [str(c) for c in seats])
    top.set_xlabel("concurrency (max-num-seqs)")
    top.set_ylabel("output tokens / s")
    bottom.set_xlabel("output tokens / s (labels: concurrency)")
    bottom.set_ylabel(f"TPOT p{g.percentile:g} (ms)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
