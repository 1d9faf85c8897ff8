"""`batchserve bench`: batchserve's drafters against real peers, one run, one machine.

Batch size b means b requests in flight at once (a closed loop: the next prompt starts when
one finishes). Every batchserve output is compared with HF `generate` greedy (`lossless`).
Writes DIR/results.json, DIR/report.md and DIR/throughput.png.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from batchserve.scheduler import SchedulerOutput, StepPhases
from benchmarks.datasets import humaneval, sharegpt, split
from benchmarks.simulate import encode

PEERS = ("hf", "hf-static", "hf-prompt-lookup", "hf-batch")
SINGLE = ("hf", "hf-static", "hf-prompt-lookup")  # peers that run one prompt at a time (batch 1)
FIXED_LENGTHS = (4, 16, 64)
ADAPTIVE_CAP = 64  # lookahead-adaptive: the per-request cap on draft tokens


@dataclass(frozen=True, slots=True)
class Method:
    draft: str
    layout: str
    warm: bool  # warm the trie on the dataset's dev outputs
    adaptive: bool = False
    decoding_length: int | None = None  # None: the run's --decoding-length
    cpu_linear: str = "torch"  # "onednn": the model's linear layers on oneDNN's kernel


BATCHSERVE = {
    "none": Method("none", "hierarchical", False),
    "llma": Method("llma", "single", False),
    "parallel": Method("lookahead", "parallel", True),
    "lookahead": Method("lookahead", "hierarchical", True),
    "lookahead-cold": Method("lookahead", "hierarchical", False),
    **{f"lookahead-{n}": Method("lookahead", "hierarchical", True, decoding_length=n) for n in FIXED_LENGTHS},
    "lookahead-adaptive": Method("lookahead", "hierarchical", True, adaptive=True, decoding_length=ADAPTIVE_CAP),
    # The same on oneDNN's CPU linear kernel (--cpu-linear onednn), to measure what it brings.
    "none-onednn": Method("none", "hierarchical", False, cpu_linear="onednn"),
    "lookahead-adaptive-onednn": Method(
        "lookahead", "hierarchical", True, adaptive=True, decoding_length=ADAPTIVE_CAP, cpu_linear="onednn"
    ),
}
METHODS = PEERS + tuple(BATCHSERVE)
KEEP = ("fastest", "median")  # which of the repeated runs stands for a (method, batch)


@dataclass(slots=True)
class Row:
    method: str
    dataset: str
    batch_size: int
    num_prompts: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    tokens_per_step: float | None
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    lossless: bool | None
    mean_decoding_length: float | None = None  # draft tokens per request step
    # batchserve rows: engine steps, and ms per step in each phase (StepPhases.NAMES) and in all ("wall")
    steps: int | None = None
    phase_ms: dict[str, float] | None = None
    overhead_ratio: float | None = None  # (step wall - forward) / step wall


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _row(method, dataset, b, outputs, seconds, ttfts, tpots, tokens_per_step, lossless) -> Row:
    n = sum(len(o) for o in outputs)
    return Row(
        method,
        dataset,
        b,
        len(outputs),
        n,
        round(seconds, 3),
        round(n / seconds, 2),
        None if tokens_per_step is None else round(tokens_per_step, 3),
        round(_pct(ttfts, 0.5), 4),
        round(_pct(ttfts, 0.99), 4),
        round(_pct(tpots, 0.5), 4),
        round(_pct(tpots, 0.99), 4),
        lossless,
    )


class _FirstTokenTimer:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def static_cache_kwargs(model, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
    """HF `generate` at its fastest: a static KV cache sized once for every prompt (so shapes
    recur) and a compiled forward (CUDA graphs on a GPU, inductor on a CPU)."""
    from transformers import CompileConfig

    cuda = model.device.type == "cuda"
    config = CompileConfig(fullgraph=True, mode="reduce-overhead" if cuda else "default")
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return {
        "cache_implementation": "static",
        "max_cache_len": max(map(len, prompts)) + max_new,
        "compile_config": config,
    }


def run_hf(model, prompts: list[list[int]], max_new: int, eos: int, lookup: int | None, desc: str, static=False):
    outputs, ttfts, tpots = [], [], []
    kwargs: dict[str, Any] = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    if static:
        kwargs.update(static_cache_kwargs(model, prompts, max_new))
        t0 = time.perf_counter()
        with torch.no_grad():  # compile (and capture) outside the timed run
            x = torch.tensor([prompts[0]], device=model.device)
            model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new, **kwargs)
        tqdm.write(f"{desc}: compiled in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    for ids in tqdm(prompts, desc=desc, leave=False):
        x = torch.tensor([ids], device=model.device)
        timer = _FirstTokenTimer()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new,
                pad_token_id=eos,
                streamer=timer,
                **kwargs,
            )
        end = time.perf_counter()
        toks = out[0, len(ids) :].tolist()
        outputs.append(toks)
        first = timer.first or end
        ttfts.append(first - start)
        if len(toks) > 1:
            tpots.append((end - first) / (len(toks) - 1))
    return outputs, time.perf_counter() - t0, ttfts, tpots


def run_hf_batch(model, prompts: list[list[int]], max_new: int, b: int):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=model.generation_config.eos_token_id)
    cb = ContinuousBatchingConfig(max_requests_per_batch=b)
    t0 = time.perf_counter()
    results = model.generate_batch(
        prompts, generation_config=gen, continuous_batching_config=cb, record_timestamps=True, progress_bar=False
    )
    seconds = time.perf_counter() - t0
    outputs, ttfts, tpots = [], [], []
    for r in results.values():
        outputs.append(list(r.generated_tokens))
        ts = r.timestamps or []
        started = r.lifespan[0] if r.lifespan[0] > 0 else r.created_time
        if ts:
            ttfts.append(ts[0] - started)
            if len(ts) > 1:
                tpots.append((ts[-1] - ts[0]) / (len(ts) - 1))
    return outputs, seconds, ttfts, tpots


def run_batchserve(engine_model, tokenizer, prompts, max_new, b, method, warm, decoding_length, cost_profile=None):
    from batchserve import LLM, SamplingParams

    m = BATCHSERVE[method]
    llm = LLM(
        draft=m.draft,
        draft_layout=m.layout,
        decoding_length=m.decoding_length or decoding_length,
        adaptive=m.adaptive,
        max_num_seqs=b,
        hf_model=engine_model,
        tokenizer=tokenizer,
        kv_cache_memory_gb=0.5,
        cost_profile=cost_profile,
        cpu_linear=m.cpu_linear,
    )
    if m.warm:
        llm.engine.drafter.warm_up(warm)
    phases = PhaseTotals()
    llm.engine.step_listeners.append(phases.add)
    t0 = time.perf_counter()
    results = llm.generate(prompts, SamplingParams(max_new_tokens=max_new), use_tqdm=False)
    seconds = time.perf_counter() - t0
    ttfts, tpots = [], []
    for r in results:
        # Closed loop: a request "starts" when it is admitted (the previous one finished).
        started = r.arrival_time + (r.stats.queue_seconds or 0.0)
        ttfts.append(r.first_token_time - started)
        if len(r.token_ids) > 1:
            tpots.append((r.finish_time - r.first_token_time) / (len(r.token_ids) - 1))
    steps = sum(r.stats.steps for r in results)
    outputs = [r.token_ids for r in results]
    mean_len = sum(r.stats.draft_tokens_proposed for r in results) / max(1, steps)
    return outputs, seconds, ttfts, tpots, sum(len(o) for o in outputs) / max(1, steps), mean_len, phases


@dataclass(slots=True)
class PhaseTotals:
    """Sums of the engine's step phases over a run (a step listener)."""

    steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys((*StepPhases.NAMES, "wall"), 0.0))

    def add(self, out: SchedulerOutput, phases: StepPhases) -> None:
        if not out.requests:
            return
        self.steps += 1
        for name, t in phases.items():
            self.seconds[name] += t
        self.seconds["wall"] += phases.wall

    def apply(self, row: Row) -> None:
        row.steps = self.steps
        if self.steps:
            row.phase_ms = {k: round(v * 1e3 / self.steps, 3) for k, v in self.seconds.items()}
            wall = self.seconds["wall"]
            row.overhead_ratio = round((wall - self.seconds["forward"]) / wall, 4) if wall else None


def load_dataset(name: str, num_prompts: int, tokenizer):
    if name == "humaneval":
        samples = humaneval()
    else:
        samples = sharegpt(max(400, 2 * num_prompts))
    dev, test = split(samples)
    test_e = encode(test[:num_prompts], tokenizer)
    warm = [e.output for e in encode(dev, tokenizer)]
    return [e.prompt for e in test_e], warm


def run(
    datasets: list[str],
    methods: list[str],
    batch_sizes: list[int],
    num_prompts: int,
    max_new: int,
    out_dir: Path,
    model_path: str | None,
    decoding_length: int = 16,
    dtype: str = "float32",
    repeats: int = 1,
    keep: str = "fastest",
    waves: int = 0,
) -> list[Row]:
    """Batch size b runs max(`num_prompts`, `waves` * b) prompts: with too few, the loop
    drains (the batch is below b for the last requests), and a method whose requests end at
    different steps is measured at a smaller batch than b.

    `repeats` > 1 runs every batchserve (method, batch) that many times, in rounds over the
    methods, and keeps the fastest run (`keep="fastest"`: interference on a shared machine
    mostly slows a run down) or the median one (`keep="median"`: robust to a lucky run as
    well as an unlucky one). Rounds spread drift over all methods alike. Every run is
    checked for losslessness."""
    if keep not in KEEP:
        raise ValueError(f"keep must be one of {KEEP}, got {keep!r}")
    from batchserve.runner import load_model

    out_dir.mkdir(parents=True, exist_ok=True)
    ref_model, tokenizer = load_model(model_path, dtype)
    engine_model = load_model(model_path, dtype)[0] if set(methods) & set(BATCHSERVE) else None
    eos = tokenizer.eos_token_id
    # The profiles the server would use (cached per device, dtype, model and kernels; measured if absent).
    cost_profiles = {}
    for cpu_linear in {BATCHSERVE[m].cpu_linear for m in methods if m in BATCHSERVE and BATCHSERVE[m].adaptive}:
        from batchserve import LLM

        probe = LLM(
            adaptive=True, hf_model=engine_model, tokenizer=tokenizer, kv_cache_memory_gb=0.5, cpu_linear=cpu_linear
        )
        cost_profiles[cpu_linear] = probe.engine.cost_profile
        del probe
    count = {b: max(num_prompts, waves * b) for b in batch_sizes}
    rows: list[Row] = []
    total = len(datasets) * (
        sum(m in SINGLE for m in methods) + len(batch_sizes) * sum(m not in SINGLE for m in methods) * repeats
    )
    bar = tqdm(total=total, desc="bench", unit="run")
    for dataset in datasets:
        prompts, warm = load_dataset(dataset, max(count.values()), tokenizer)
        # The greedy reference; its first `num_prompts` are also the `hf` row.
        reference, secs, ttfts, tpots = run_hf(ref_model, prompts[:num_prompts], max_new, eos, None, f"{dataset} hf")
        if "hf" in methods:
            rows.append(_row("hf", dataset, 1, reference, secs, ttfts, tpots, 1.0, None))
            bar.update(1)
        if len(prompts) > num_prompts:
            rest = run_hf(ref_model, prompts[num_prompts:], max_new, eos, None, f"{dataset} reference")[0]
            reference = reference + rest
        if "hf-static" in methods:
            outs, secs, ttfts, tpots = run_hf(
                ref_model, prompts[:num_prompts], max_new, eos, None, f"{dataset} hf-static", static=True
            )
            rows.append(_row("hf-static", dataset, 1, outs, secs, ttfts, tpots, 1.0, outs == reference[:num_prompts]))
            bar.update(1)
        if "hf-prompt-lookup" in methods:
            outs, secs, ttfts, tpots = run_hf(
                ref_model, prompts[:num_prompts], max_new, eos, 10, f"{dataset} hf-prompt-lookup"
            )
            rows.append(_row("hf-prompt-lookup", dataset, 1, outs, secs, ttfts, tpots, None, None))
            bar.update(1)
        for b in batch_sizes:
            batch_prompts, batch_reference = prompts[: count[b]], reference[: count[b]]
            if "hf-batch" in methods:
                outs, secs, ttfts, tpots = run_hf_batch(ref_model, batch_prompts, max_new, b)
                rows.append(_row("hf-batch", dataset, b, outs, secs, ttfts, tpots, 1.0, None))
                bar.update(1)
            runs: dict[str, list[Row]] = {}
            for _ in range(repeats):
                for m in methods:
                    if m not in BATCHSERVE:
                        continue
                    outs, secs, ttfts, tpots, tps, mean_len, phases = run_batchserve(
                        engine_model,
                        tokenizer,
                        batch_prompts,
                        max_new,
                        b,
                        m,
                        warm,
                        decoding_length,
                        cost_profiles.get(BATCHSERVE[m].cpu_linear),
                    )
                    row = _row(m, dataset, b, outs, secs, ttfts, tpots, tps, outs == batch_reference)
                    row.mean_decoding_length = mean_len
                    phases.apply(row)
                    runs.setdefault(m, []).append(row)
                    bar.update(1)
                    bar.set_postfix_str(f"{dataset} {m} b={b}: {row.tokens_per_s} tok/s")
            rows.extend(pick_run(rs, keep) for rs in runs.values())
            _save(rows, out_dir)  # after every batch size, so an interrupted sweep keeps what it measured
    bar.close()
    write_report(rows, out_dir, num_prompts, max_new, decoding_length, repeats, keep, waves)
    plot(rows, out_dir / "throughput.png")
    return rows


def pick_run(runs: list[Row], keep: str) -> Row:
    """The run that stands for a (method, batch): the fastest, or the median by tokens/s
    (the lower middle one for an even count). Any run that was not lossless marks it."""
    by_speed = sorted(runs, key=lambda r: r.tokens_per_s)
    row = by_speed[-1] if keep == "fastest" else by_speed[(len(by_speed) - 1) // 2]
    if any(r.lossless is False for r in runs):
        row = replace(row, lossless=False)
    return row


def _save(rows: list[Row], out_dir: Path) -> None:
    (out_dir / "results.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))


def write_report(
    rows: list[Row],
    out_dir: Path,
    num_prompts: int,
    max_new: int,
    decoding_length: int,
    repeats: int = 1,
    keep: str = "fastest",
    waves: int = 0,
) -> None:
    best_of = f" Each batchserve row is the {keep} of {repeats} runs, taken in rounds." if repeats > 1 else ""
    prompts = f"{num_prompts} prompts per dataset"
    if waves:
        prompts = (
            f"max({num_prompts}, {waves} x batch) prompts per dataset and batch size, so the loop stays full "
            f"(the {', '.join(SINGLE)} rows: the first {num_prompts})"
        )
    lines = [
        f"# batchserve benchmark\n\n{prompts}, {max_new} new tokens, greedy, "
        f"decoding length {decoding_length}, {torch.get_num_threads()} CPU threads.{best_of} Batch size b = b requests "
        "in flight (closed loop). `vs hf`: tokens/s over HF `generate` at batch 1; `vs hf-batch`: over HF "
        "`generate_batch` at the same batch size.\n"
    ]
    for dataset in dict.fromkeys(r.dataset for r in rows):
        rs = [r for r in rows if r.dataset == dataset]
        hf = next((r.tokens_per_s for r in rs if r.method == "hf"), None)
        hfb = {r.batch_size: r.tokens_per_s for r in rs if r.method == "hf-batch"}
        lines.append(f"\n## {dataset}\n")
        none = {r.batch_size: r.tokens_per_s for r in rs if r.method == "none"}
        lines.append(
            "| method | batch | tokens/s | tokens/step | draft tokens/step | TTFT p50 / p99 (s) | TPOT p50 / p99 (s) "
            "| vs hf | vs hf-batch | vs none | lossless |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in sorted(rs, key=lambda r: (r.batch_size, METHODS.index(r.method))):
            vs_hf = f"{r.tokens_per_s / hf:.2f}x" if hf else "-"
            vs_hfb = f"{r.tokens_per_s / hfb[r.batch_size]:.2f}x" if r.batch_size in hfb else "-"
            vs_none = f"{r.tokens_per_s / none[r.batch_size]:.2f}x" if r.batch_size in none else "-"
            tps = "-" if r.tokens_per_step is None else f"{r.tokens_per_step:.2f}"
            dl = "-" if r.mean_decoding_length is None else f"{r.mean_decoding_length:.1f}"
            lossless = "-" if r.lossless is None else ("yes" if r.lossless else "**NO**")
            lines.append(
                f"| {r.method} | {r.batch_size} | {r.tokens_per_s:.1f} | {tps} | {dl} | {r.ttft_p50_s:.3f} / "
                f"{r.ttft_p99_s:.3f} | {r.tpot_p50_s:.4f} / {r.tpot_p99_s:.4f} | {vs_hf} | {vs_hfb} | {vs_none} "
                f"| {lossless} |"
            )
        lines.extend(adaptive_summary(rs))
        lines.extend(phase_table(rs))
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")


def adaptive_summary(rows: list[Row]) -> list[str]:
    """Adaptive decoding length against the best fixed length and against no speculation."""
    fixed = [f"lookahead-{n}" for n in FIXED_LENGTHS]
    out: list[str] = []
    for b in sorted({r.batch_size for r in rows}):
        at = {r.method: r for r in rows if r.batch_size == b}
        ada, none = at.get("lookahead-adaptive"), at.get("none")
        best = max((at[m] for m in fixed if m in at), key=lambda r: r.tokens_per_s, default=None)
        if ada is None or none is None or best is None:
            continue
        if not out:
            out = [
                "\nAdaptive decoding length against the best fixed length and against `none`:\n",
                "| batch | adaptive tok/s | best fixed | adaptive / best fixed | adaptive / none | mean draft tokens |",
                "|---|---|---|---|---|---|",
            ]
        out.append(
            f"| {b} | {ada.tokens_per_s:.1f} | {best.method} {best.tokens_per_s:.1f} | "
            f"{ada.tokens_per_s / best.tokens_per_s:.2f}x | {ada.tokens_per_s / none.tokens_per_s:.2f}x | "
            f"{ada.mean_decoding_length or 0:.1f} |"
        )
    return out


def phase_table(rows: list[Row]) -> list[str]:
    """Where a step goes: ms per engine step in each phase, and the share outside the forward."""
    timed = [r for r in rows if r.phase_ms]
    if not timed:
        return []
    names = (*StepPhases.NAMES, "wall")
    out = [
        "\nWhere a step goes (ms per engine step; overhead = (wall - forward) / wall):\n",
        "| method | batch | steps | " + " | ".join(names) + " | overhead |",
        "|---|---|---|" + "---|" * len(names) + "---|",
    ]
    for r in sorted(timed, key=lambda r: (r.batch_size, METHODS.index(r.method))):
        assert r.phase_ms is not None
        cells = " | ".join(f"{r.phase_ms[n]:.2f}" for n in names)
        out.append(f"| {r.method} | {r.batch_size} | {r.steps} | {cells} | {r.overhead_ratio:.3f} |")
    return out


def _color(method: str) -> Any:
    """One colour per method, the same in every panel."""
    import matplotlib

    return matplotlib.colormaps["tab20"](METHODS.index(method) % 20)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r.dataset for r in rows))
    fig, axes = plt.subplots(2, len(datasets), figsize=(6 * len(datasets), 8), squeeze=False)
    for ax, dataset in zip(axes[1], datasets):
        for m in METHODS:
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
    for ax, dataset in zip(axes[0], datasets):
        for m in METHODS:
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_table(rows: list[Row]) -> str:
    return "\n".join(
        f"{r.dataset:10} {r.method:17} b={r.batch_size:<3} {r.tokens_per_s:8.1f} tok/s "
        f"{'' if r.tokens_per_step is None else f'{r.tokens_per_step:5.2f} tok/step'} "
        f"lossless={r.lossless}"
        for r in rows
    )
