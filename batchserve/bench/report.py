"""Write a bench run's results: results.json, report.md and the console summary (plots: `plots.py`)."""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import asdict
from pathlib import Path

import torch

from batchserve.bench.methods import FIXED_LENGTHS, KERNEL_SUFFIXES, SINGLE, Row, load_point, method_rank, none_of
from batchserve.bench.near_ties import divergence_lines, lossless_cell
from batchserve.bench.served import served_table
from batchserve.bench.served_loop import HOST_PHASES, loop_table
from batchserve.cost_profile import CostProfile
from batchserve.records import StepPhases


def write_whole(path: Path, text: str) -> None:
    """`path` replaced by `text` in one rename: a process killed mid-write (a device's time limit)
    leaves the last whole file, never a cut one."""
    part = path.with_name(f".{path.name}.part")
    part.write_text(text)
    part.replace(path)


def save_results(rows: list[Row], out_dir: Path) -> None:
    """DIR/results.json: every row as a JSON object."""
    write_whole(out_dir / "results.json", json.dumps([asdict(r) for r in rows], indent=1))


def _header(num_prompts: int, max_new: int, decoding_length: int, repeats: int, keep: str, waves: int) -> str:
    best_of = (
        f" Each batchserve row, and the llamacpp row where batch 1 is swept, is the {keep} of {repeats} runs, "
        "taken in rounds."
        if repeats > 1
        else ""
    )
    prompts = f"{num_prompts} prompts per dataset"
    if waves:
        prompts = (
            f"max({num_prompts}, {waves} x batch) prompts per dataset and batch size, so the loop stays full "
            f"(the {', '.join(SINGLE)} rows: the first {num_prompts})"
        )
    return (
        f"# batchserve benchmark\n\n{prompts}, {max_new} new tokens, greedy, "
        f"decoding length {decoding_length}, {torch.get_num_threads()} CPU threads.{best_of} Batch size b = b requests "
        "in flight (closed loop); a batchserve request's TTFT counts from when its seat frees, so waiting "
        "for the engine to admit it is included. `vs hf`: tokens/s over HF `generate` at batch 1; "
        "`vs hf-batch`: over HF `generate_batch` at the same batch size. `tokens/s` counts every token over the "
        "run's wall time; `decode tok/s` only the tokens after each request's first, over the seconds from its "
        "first token to its last (one request's stream, its prompt and first token left out; TPOT likewise).\n"
    )


def _method_table(rows: list[Row]) -> list[str]:
    """One dataset's rows, each against hf, hf-batch and none at its batch size."""
    hf = next((r.tokens_per_s for r in rows if r.method == "hf"), None)
    hfb = {r.batch_size: r.tokens_per_s for r in rows if r.method == "hf-batch"}
    none = {(r.method, r.batch_size): r.tokens_per_s for r in rows if r.method.startswith("none")}
    lines = [
        "| method | batch | tokens/s | decode tok/s | tokens/step | draft tokens/step | TTFT p50 / p99 (s) "
        "| TPOT p50 / p99 (s) | prompt cached | vs hf | vs hf-batch | vs none | lossless |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r.batch_size, method_rank(r.method))):
        vs_hf = f"{r.tokens_per_s / hf:.2f}x" if hf else "-"
        vs_hfb = f"{r.tokens_per_s / hfb[r.batch_size]:.2f}x" if r.batch_size in hfb else "-"
        base = none.get((none_of(r.versus or r.method), r.batch_size))
        vs_none = f"{r.tokens_per_s / base:.2f}x" if base and not r.method.startswith("none") else "-"
        tps = "-" if r.tokens_per_step is None else f"{r.tokens_per_step:.2f}"
        dl = "-" if r.mean_decoding_length is None else f"{r.mean_decoding_length:.1f}"
        decode = "-" if r.decode_tokens_per_s is None else f"{r.decode_tokens_per_s:.1f}"
        cached = "-" if r.cached_share is None else f"{r.cached_share:.0%}"
        lines.append(
            f"| {r.method} | {r.batch_size} | {r.tokens_per_s:.1f} | {decode} | {tps} | {dl} | {r.ttft_p50_s:.3f} / "
            f"{r.ttft_p99_s:.3f} | {r.tpot_p50_s:.4f} / {r.tpot_p99_s:.4f} | {cached} | {vs_hf} | {vs_hfb} | {vs_none} "
            f"| {lossless_cell(r)} |"
        )
    return lines


NEVER_SLOWER = 0.97  # the claim: lookahead-adaptive at least this times `none` at every load point


def never_slower(
    rows: list[Row], method: str = "lookahead-adaptive", base: str = "none", seated: bool = False
) -> list[str]:
    """One line: `method` over `base` at every load point they share (batch sizes, request rates),
    the lowest ratio named, and the points below NEVER_SLOWER. `seated`: by tokens/s over the
    steps with every seat taken, at the closed-loop points (where a row has it)."""

    def point(r: Row) -> tuple[int, float | None]:
        return (r.batch_size, r.request_rate)

    def speed(r: Row) -> float | None:
        return r.seated_tokens_per_s if seated else r.tokens_per_s

    if seated:
        rows = [r for r in rows if r.request_rate is None]
    ours = {point(r): s for r in rows if r.method == method and (s := speed(r)) is not None}
    theirs = {point(r): s for r in rows if r.method == base and (s := speed(r)) is not None}
    ratios = {p: ours[p] / theirs[p] for p in ours.keys() & theirs.keys() if theirs[p]}
    if not ratios:
        return []

    def name(p: tuple[int, float | None]) -> str:
        return f"b={p[0]}" if p[1] is None else f"{p[1]:g} req/s"

    worst = min(ratios, key=ratios.__getitem__)
    below = [name(p) for p in sorted(ratios, key=lambda p: (p[1] is not None, p)) if ratios[p] < NEVER_SLOWER]
    verdict = f"below {NEVER_SLOWER} at {', '.join(below)}" if below else f"at least {NEVER_SLOWER} everywhere"
    what = " with every seat taken" if seated else ""
    return [
        f"\n`{method}` over `{base}`{what} at {len(ratios)} load points: lowest {ratios[worst]:.2f}x "
        f"({name(worst)}); {verdict}.\n"
    ]


def _open_loop_table(rows: list[Row]) -> list[str]:
    """Open-loop rows: Poisson arrivals at each rate, against `none` at the same rate."""
    if not rows:
        return []
    none = {(r.method, r.request_rate): r.tokens_per_s for r in rows if r.method.startswith("none")}
    lines = [
        f"\nOpen loop: Poisson arrivals (seeded, the same schedule for every method), at most "
        f"{rows[0].batch_size} running; TTFT counts from the scheduled arrival.\n",
        "| method | req/s | tokens/s | tokens/step | TTFT p50 / p99 (s) | TPOT p50 / p99 (s) | vs none | lossless |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r.request_rate or 0.0, method_rank(r.method))):
        base = none.get((none_of(r.method), r.request_rate))
        vs_none = f"{r.tokens_per_s / base:.2f}x" if base and not r.method.startswith("none") else "-"
        tps = "-" if r.tokens_per_step is None else f"{r.tokens_per_step:.2f}"
        lines.append(
            f"| {r.method} | {r.request_rate:g} | {r.tokens_per_s:.1f} | {tps} | {r.ttft_p50_s:.3f} / "
            f"{r.ttft_p99_s:.3f} | {r.tpot_p50_s:.4f} / {r.tpot_p99_s:.4f} | {vs_none} | {lossless_cell(r)} |"
        )
    return lines


def write_report(
    rows: list[Row],
    out_dir: Path,
    num_prompts: int,
    max_new: int,
    decoding_length: int,
    repeats: int = 1,
    keep: str = "fastest",
    waves: int = 0,
    skipped: str = "",
    profiles: dict[str, CostProfile] | None = None,
) -> None:
    """DIR/report.md: per dataset, the method table, the adaptive summary and the phase table;
    `skipped`: a line on an optional peer the run went without, and why; `profiles`: the cost
    profiles the adaptive methods sized their drafts by (by kernels), as a draft row's price."""
    lines = [_header(num_prompts, max_new, decoding_length, repeats, keep, waves)]
    if skipped:
        lines.append(f"{skipped}\n")
    if early := [f"{r.method} b={r.batch_size} ({r.runs_done} runs so far)" for r in rows if r.runs_done]:
        lines.append(f"**Provisional** (more runs were to come when this was written): {', '.join(early)}.\n")
    for kernels, profile in (profiles or {}).items():
        lines.extend(row_price_table(profile, kernels))
    for dataset in dict.fromkeys(r.dataset for r in rows):
        everything = [r for r in rows if r.dataset == dataset]
        rs = [r for r in everything if r.request_rate is None]
        lines.append(f"\n## {dataset}\n")
        lines.extend(_short_of_prompts(everything, num_prompts, waves))
        lines.extend(_method_table(rs))
        lines.extend(served_table(rs))
        for suffix in ("", *KERNEL_SUFFIXES):
            lines.extend(never_slower(everything, "lookahead-adaptive" + suffix, "none" + suffix))
            lines.extend(never_slower(everything, "lookahead-adaptive" + suffix, "none" + suffix, seated=True))
        lines.extend(_repeat_rounds(rs))
        lines.extend(_every_run(everything))
        lines.extend(divergence_lines(everything))
        lines.extend(_open_loop_table([r for r in everything if r.request_rate is not None]))
        lines.extend(_llamacpp_note(rs))
        for suffix in ("", *KERNEL_SUFFIXES):
            lines.extend(adaptive_summary(rs, suffix))
        lines.extend(phase_table(rs))
        lines.extend(loop_table(rs))
    write_whole(out_dir / "report.md", "\n".join(lines) + "\n")


def _short_of_prompts(rows: list[Row], num_prompts: int, waves: int) -> list[str]:
    """The load points that ran fewer prompts than the header says, because the dataset's test
    split holds no more (the count moves what a closed loop's ramp-up and tail weigh)."""
    short: dict[str, tuple[int, int]] = {}
    for r in rows:
        asked = num_prompts if r.method in SINGLE else max(num_prompts, waves * r.batch_size)
        if r.num_prompts < asked:
            short.setdefault(load_point(r), (r.num_prompts, asked))
    if not short:
        return []
    parts = ", ".join(f"{point} ran {ran} of the {asked} asked for" for point, (ran, asked) in short.items())
    return [f"The dataset holds fewer test prompts than asked: {parts}.\n"]


def _repeat_rounds(rows: list[Row]) -> list[str]:
    """A +repeat workload: each row's second round (the same prompts again, once the first round
    has finished), where every draft from the first round's outputs would be accepted."""
    seconds = [r for r in rows if r.repeat_tokens_per_step is not None]
    if not seconds:
        return []
    parts = ", ".join(f"{r.method} b={r.batch_size}: {r.repeat_tokens_per_step:.2f}" for r in seconds)
    return [f"\nTokens per step of the second round alone (exact repeats, run after the first): {parts}.\n"]


def _every_run(rows: list[Row]) -> list[str]:
    """Repeated rows: every run's tokens/s in round order (a round runs each method once), so a
    ratio can be read round by round as well as between the kept runs."""
    runs = [r for r in rows if r.run_tokens_per_s]
    if not runs:
        return []
    parts = "; ".join(
        f"{r.method} {load_point(r)}: {', '.join(f'{x:.1f}' for x in r.run_tokens_per_s or [])}" for r in runs
    )
    return [f"\nEvery run's tokens/s, in round order: {parts}.\n"]


def _llamacpp_note(rows: list[Row]) -> list[str]:
    """What the llamacpp row measured, so its tokens/s is read for what it is."""
    r = next((r for r in rows if r.method == "llamacpp"), None)
    if r is None:
        return []
    try:
        version = f" {importlib.metadata.version('llama-cpp-python')}"
    except importlib.metadata.PackageNotFoundError:
        version = ""
    return [
        f"\n`llamacpp`: llama.cpp through llama-cpp-python{version} on the same GGUF file and prompt tokens, "
        f"greedy, {torch.get_num_threads()} threads, requests run one after another (sequential: it serves "
        "one sequence at a time, so batch 1 only); tokens/s = generated tokens / wall time of all its requests. "
        "It runs the GGUF's quantized weights on its own kernels, so its output is not checked for "
        f"losslessness: it equals HF greedy on {r.reference_matches} of {r.num_prompts} prompts.\n"
    ]


def adaptive_summary(rows: list[Row], suffix: str = "") -> list[str]:
    """Adaptive decoding length against the best fixed length and against no speculation, on the
    weights and kernels `suffix` names."""
    fixed = [f"lookahead-{n}{suffix}" for n in FIXED_LENGTHS]
    out: list[str] = []
    for b in sorted({r.batch_size for r in rows}):
        at = {r.method: r for r in rows if r.batch_size == b}
        ada, none = at.get("lookahead-adaptive" + suffix), at.get("none" + suffix)
        best = max((at[m] for m in fixed if m in at), key=lambda r: r.tokens_per_s, default=None)
        if ada is None or none is None or best is None:
            continue
        if not out:
            out = [
                f"\nAdaptive decoding length against the best fixed length and against `none{suffix}`:\n",
                "| batch | adaptive tok/s | best fixed | adaptive / best fixed | adaptive / none | mean draft tokens |",
                "|---|---|---|---|---|---|",
            ]
        out.append(
            f"| {b} | {ada.tokens_per_s:.1f} | {best.method} {best.tokens_per_s:.1f} | "
            f"{ada.tokens_per_s / best.tokens_per_s:.2f}x | {ada.tokens_per_s / none.tokens_per_s:.2f}x | "
            f"{ada.mean_decoding_length or 0:.1f} |"
        )
    return out


# Row counts the price table shows: the CUDA graphs' small row buckets (runner/graphs.py).
PRICE_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def row_price_table(profile: CostProfile, kernels: str = "", context: int = 512) -> list[str]:
    """What the adaptive length sees a step cost: ms per step at each row bucket (one request,
    `context` keys) and the price of a row past one, per row: on a GPU, of replayed steps."""
    counts = [n for n in PRICE_ROWS if n <= profile.token_counts[-1]]
    if not counts:
        return []
    ms = [profile.time_ms(n, context) for n in counts]
    name = f" ({kernels})" if kernels else ""
    out = [
        f"\nThe cost profile{name} the adaptive length sizes drafts by ({profile.key}; one request, {context} "
        "keys): ms per step at each row count, and what each row past the first adds:\n",
        "| rows | " + " | ".join(str(n) for n in counts) + " |",
        "|---|" + "---|" * len(counts),
        "| step ms | " + " | ".join(f"{t:.2f}" for t in ms) + " |",
        "| ms per extra row | - | "
        + " | ".join(f"{(t - ms[0]) / (n - 1):.3f}" for n, t in zip(counts[1:], ms[1:]))
        + " |",
    ]
    return out


def phase_table(rows: list[Row]) -> list[str]:
    """Where a step goes: ms per engine step in each phase, and the share outside the forward."""
    timed = [r for r in rows if r.phase_ms]
    if not timed:
        return []
    names = (*StepPhases.NAMES, "wall")
    out = [
        "\nWhere a step goes (ms per engine step; host: schedule + prepare + verify + commit, what the host adds "
        "to every device step; overhead = (wall - forward) / wall; attention: the "
        "part of forward inside the attention backend, and its share of the wall; decode step: the "
        "mean wall of full-batch steps without a prompt chunk; grammar: time in structured output's "
        "matchers and masks, and its share of the wall; seated tok/s: tokens/s over the steps with "
        "every seat taken, the run without its ramp-up and tail):\n",
        "| method | batch | steps | "
        + " | ".join(names)
        + " | host | overhead | attention | attention share | decode step | grammar | grammar share | seated tok/s |",
        "|---|---|---|" + "---|" * len(names) + "---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(timed, key=lambda r: (r.batch_size, method_rank(r.method))):
        assert r.phase_ms is not None
        cells = " | ".join(f"{r.phase_ms[n]:.2f}" for n in names)
        attention, grammar = r.phase_ms.get("attention"), r.phase_ms.get("grammar")
        grammar_share = grammar / r.phase_ms["wall"] if grammar is not None and r.phase_ms["wall"] else None
        extra = " | ".join(
            "-" if x is None else fmt.format(x)
            for x, fmt in (
                (attention, "{:.2f}"),
                (r.attention_share, "{:.2f}"),
                (r.decode_step_ms, "{:.1f}"),
                (grammar, "{:.2f}"),
                (grammar_share, "{:.3f}"),
                (r.seated_tokens_per_s, "{:.1f}"),
            )
        )
        host = sum(r.phase_ms[n] for n in HOST_PHASES)
        out.append(
            f"| {r.method} | {r.batch_size} | {r.steps} | {cells} | {host:.2f} | {r.overhead_ratio:.3f} | {extra} |"
        )
    return out


def summary_table(rows: list[Row]) -> str:
    """One line per row for the console: tokens/s, tokens/step and losslessness."""
    return "\n".join(
        f"{r.dataset:10} {r.method:17} {load_point(r):9} {r.tokens_per_s:8.1f} tok/s "
        f"{'' if r.tokens_per_step is None else f'{r.tokens_per_step:5.2f} tok/step'} "
        f"lossless={f'near-ties({r.near_ties})' if r.near_ties else r.lossless}"
        for r in rows
    )
