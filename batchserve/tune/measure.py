"""`batchserve tune`: the serving settings that give the most throughput within latency goals,
measured on this machine with the user's workload.

Stage 1 runs a closed loop at every concurrency c (c clients, `max_num_seqs = c`), with and
without drafts (`none`, `lookahead-adaptive`), at the default token budget. Stage 2 tries other
token budgets (`max_num_batched_tokens`, which bounds a step's prompt chunk and so TTFT and
TPOT under prompt load) at the best point that meets the goals. The recommendation is the point
with the most output tokens/s whose TTFT and TPOT at the goals' percentile are within them;
`--confirm` runs it once more to show how well the prediction holds.

Each point is a bench run (`bench/runs.py`: the workload, the engine a method's settings build,
the closed loop and its latencies), so that `tune` measures what `batchserve bench` measures; the
weights and the forward are the server's own choice (`model/`), as `batchserve serve` makes it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from batchserve.bench.methods import WEIGHTS_SUFFIX, batchserve_method, percentile
from batchserve.tune.points import DRAFTS, Goals, Point, TuneResult, closest, format_point, recommend
from batchserve.tune.report import write_tune_report


@dataclass(slots=True)
class _Runner:
    """What every run of one tune shares."""

    model: Any
    tokenizer: Any
    work: Any  # sweep.Workload
    goals: Goals
    num_prompts: int
    waves: int
    max_new: int
    weights: str  # "gguf", "bfloat16" or "float32": what the server would run
    cost_profile: Any
    bar: Any
    repeats: int = 1  # runs per point; the median by tokens/s stands for it
    outputs: dict[int, list[list[int]]] = field(default_factory=dict)  # `none`'s, per concurrency

    def method(self, draft: str) -> Any:
        m = batchserve_method(draft + WEIGHTS_SUFFIX[self.weights])
        assert m is not None
        return m

    def run(self, draft: str, c: int, budget: int) -> tuple[Point, list[list[int]]]:
        """The point's median run of `repeats` (a shared machine's noise is mostly one-sided
        slowdowns; a median resists a lucky run too), and its outputs."""
        runs = [self._once(draft, c, budget) for _ in range(self.repeats)]
        runs.sort(key=lambda r: r[0].tokens_per_s)
        return runs[(len(runs) - 1) // 2]

    def _once(self, draft: str, c: int, budget: int) -> tuple[Point, list[list[int]]]:
        from batchserve.bench.runs import run_batchserve

        n = max(self.num_prompts, self.waves * c)
        m = self.method(draft)
        run = run_batchserve(
            self.model,
            self.tokenizer,
            self.work.prompts[:n],
            self.max_new,
            c,
            m,
            self.work.warm,
            16,
            self.cost_profile if m.adaptive else None,
            self.work.earlier[:n],
            max_num_batched_tokens=budget,
        )
        q = self.goals.percentile / 100
        tokens = sum(map(len, run.outputs))
        ttft, tpot = percentile(run.ttfts, q) * 1e3, percentile(run.tpots, q) * 1e3
        point = Point(draft, c, budget, round(tokens / run.seconds, 2), round(ttft, 1), round(tpot, 2), 0.0)
        point.tokens_per_step = round(run.tokens_per_step, 2)
        point.missed = self.goals.missed(ttft, tpot)
        self.bar.update(1)
        return point, run.outputs

    def point(self, draft: str, c: int, budget: int) -> Point:
        p, outputs = self.run(draft, c, budget)
        p.weights = self.weights
        if draft == "none":
            self.outputs.setdefault(c, outputs)
        elif c in self.outputs:
            p.lossless = outputs == self.outputs[c]
        tqdm.write(format_point(p))
        return p


def tune(
    dataset: str,
    goals: Goals,
    concurrency: list[int],
    token_budgets: list[int],
    num_prompts: int,
    waves: int,
    max_new: int,
    model_path: str | None,
    out_dir: Path,
    confirm: bool = False,
    repeats: int = 1,
) -> TuneResult:
    """Measure, recommend, write DIR/tune.md, tune.json and tune.png (see the module doc)."""
    from batchserve.bench.runs import cost_profiles, load_dataset
    from batchserve.config import EngineConfig
    from batchserve.model import choose_cpu_weights, choose_impl
    from batchserve.model.gguf_native import load_gguf_native
    from batchserve.model.loader import load_model, load_tokenizer, resolve_model_path

    default_budget = EngineConfig().scheduler.max_num_batched_tokens
    concurrency = sorted(set(concurrency))
    budgets = sorted({b for b in token_budgets if b != default_budget})
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    on_cpu = not torch.cuda.is_available()
    # Each point runs the weights a server would take (the same at every seat count), loaded as
    # the server loads them (a GGUF from its blocks; transformers' model for the rest): one
    # forward per kind, reused by every run.
    weights_at = dict.fromkeys(concurrency, choose_cpu_weights(on_cpu, model_path))
    loaded = set(weights_at.values()) - {"gguf"}
    hf_model, tokenizer = load_model(model_path, "float32") if loaded else (None, load_tokenizer(model_path))
    work = load_dataset(dataset, max(num_prompts, waves * concurrency[-1]), tokenizer)
    kinds = len(set(weights_at.values()))
    total = kinds + (len(concurrency) * len(DRAFTS) + len(budgets) + int(confirm)) * repeats
    bar = tqdm(total=total, desc="tune", unit="run")
    runners: dict[str, _Runner] = {}
    for weights in dict.fromkeys(weights_at.values()):  # each forward built once, then the HF model goes
        if weights == "gguf":
            directory, name = resolve_model_path(model_path)
            model = load_gguf_native(directory / str(name))[0]
        else:
            model = choose_impl(hf_model, "auto", "auto", weights, model_path, loaded_from_path=True)
        profile = cost_profiles(["lookahead-adaptive" + WEIGHTS_SUFFIX[weights]], model, tokenizer).popitem()[1]
        runners[weights] = _Runner(
            model, tokenizer, work, goals, num_prompts, waves, max_new, weights, profile, bar, repeats
        )
    del hf_model
    result = TuneResult(goals)
    try:
        for r in runners.values():
            r._once("none", 1, default_budget)  # unmeasured: a forward's first run pays one-time setup
        _measure(result, lambda c: runners[weights_at[c]], concurrency, budgets, default_budget, confirm)
    finally:
        bar.close()
    write_tune_report(result, out_dir, dataset, max_new)
    return result


def _measure(
    result: TuneResult,
    runner: Callable[[int], _Runner],
    concurrency: list[int],
    budgets: list[int],
    default_budget: int,
    confirm: bool,
) -> None:
    """Stage 1 at every concurrency, stage 2 at the best point's seats, the confirmation (module doc)."""
    for c in concurrency:
        for draft in DRAFTS:
            result.points.append(runner(c).point(draft, c, default_budget))
    stage1 = recommend(result.points) or closest(result.points, result.goals)
    assert stage1 is not None
    seats, at_best = stage1.max_num_seqs, runner(stage1.max_num_seqs)
    for budget in budgets:
        if budget >= seats:  # every running request needs a token per step
            result.points.append(at_best.point(stage1.draft, seats, budget))
        else:
            at_best.bar.update(at_best.repeats)
    result.best = best = recommend(result.points)
    if confirm and best is not None:
        again, _ = runner(best.max_num_seqs).run(best.draft, best.max_num_seqs, best.max_num_batched_tokens)
        result.confirmed_tokens_per_s = again.tokens_per_s
