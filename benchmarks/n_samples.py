"""n samples of one prompt (OpenAI's `n`) against the same samples sent as separate requests.

    .venv/bin/python benchmarks/n_samples.py --num-prompts 16 --max-new-tokens 64 \
        --out benchmarks/results/openai-features/n_samples

For each HumanEval test prompt (the bench's loader and chat template), four modes on the default
model (SmolLM2, its GGUF read from its blocks: the bench's `-gguf` methods; drafts: `lookahead-adaptive`,
the server's default, with a cold trie), each on a fresh engine with `--n` seats, so that no mode
finds the prompt in a cache an earlier run filled:

  n          the `--n` samples as one call: requests of one `group` (what the OpenAI front end
             sends for `n`), which compute the prompt's full blocks once between them;
  split      the same samples (same seeds) as `--n` independent requests sent at once, prefix
             caching on (the default: cache-aware admission lets them share full blocks too);
  nocache    the same with prefix caching off: every request computes its whole prompt;
  n-nocache  `n` with prefix caching off: what the group alone shares.

Sample i has seed `--seed` + i and temperature `--temperature`, so every mode must give the same
tokens (compared with `n`'s: `identical_to_n`). Per mode: prompt rows computed (counted from the
steps' prompt chunks through `EngineCore.step_listeners`) against prompt tokens sent, output
tokens per second (all outputs over the summed wall time), and time to first token (from the
moment the samples are added to the step that gives a sample its first token; mean and p50 over
all samples).
The modes run in a rotated order per prompt, so drift on a shared machine falls on all alike;
compare the modes' ratios, not absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

MODES = ("n", "split", "nocache", "n-nocache")
GROUPED = ("n", "n-nocache")  # the samples are one call's (a `group`)
CACHE_OFF = ("nocache", "n-nocache")  # the engine runs with prefix caching off
METHOD = "lookahead-adaptive-gguf"  # the bench method whose engine settings every mode runs


@dataclass(slots=True)
class ModeRun:
    """One mode on one prompt."""

    outputs: list[list[int]]
    prompt_rows: int  # prompt tokens the steps computed, over all samples
    cached_tokens: int  # prompt tokens the samples took from the prefix cache
    seconds: float  # from adding the samples to the last one's finish
    ttfts: list[float]


@dataclass(slots=True)
class ModeTotals:
    """One mode over all prompts."""

    prompt_tokens: int = 0  # sent: samples x prompt length
    prompt_rows: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    ttfts: list[float] = field(default_factory=list)

    def add(self, run: ModeRun, prompt_len: int) -> None:
        self.prompt_tokens += prompt_len * len(run.outputs)
        self.prompt_rows += run.prompt_rows
        self.cached_tokens += run.cached_tokens
        self.output_tokens += sum(map(len, run.outputs))
        self.seconds += run.seconds
        self.ttfts += run.ttfts

    def summary(self, num_prompts: int) -> dict[str, Any]:
        return {
            "prompt_tokens_sent": self.prompt_tokens,
            "prompt_rows_computed": self.prompt_rows,
            "prompt_rows_per_prompt": round(self.prompt_rows / num_prompts, 1),
            "cached_prompt_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.output_tokens / self.seconds, 2),
            "ttft_mean_s": round(statistics.fmean(self.ttfts), 4),
            "ttft_p50_s": round(statistics.median(self.ttfts), 4),
        }


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=8, help="HumanEval test prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (and the engine's seats)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0, help="sample i is seeded seed + i")
    ap.add_argument("--out", default="benchmarks/results/openai-features/n_samples", help="folder for JSON + md")
    return ap.parse_args()


def _engine_factory(n: int) -> tuple[Any, Any]:
    """(a function that builds a fresh engine with n seats, prefix caching on or off; the
    tokenizer). The model's forward and its cost profile are built once and shared."""
    from batchserve.bench.methods import batchserve_method
    from batchserve.bench.runs import cost_profiles, method_engine
    from batchserve.runner import load_model

    model, tokenizer = load_model(None, "float32")
    m = batchserve_method(METHOD)
    assert m is not None
    profile = cost_profiles([METHOD], model, tokenizer)[m.kernels]

    def build(prefix_caching: bool) -> Any:
        cached = replace(m, prefix_caching=prefix_caching)
        return method_engine(model, tokenizer, cached, n, m.decoding_length or 16, profile, None).engine

    return build, tokenizer


def run_mode(engine: Any, prompt: list[int], params: list[Any], group: str) -> ModeRun:
    """The samples added at once (one `group`, or none: ""), stepped to the end."""
    rows = 0

    def count(out: Any, _phases: Any) -> None:
        nonlocal rows
        p = len(prompt)
        rows += sum(
            min(p, r.num_computed_tokens + len(r.token_ids)) - r.num_computed_tokens
            for r in out.requests
            if r.num_computed_tokens < p
        )

    engine.step_listeners.append(count)
    t0 = time.perf_counter()
    reqs = [engine.add_request(prompt, p, f"s{i}", group=group) for i, p in enumerate(params)]
    first: dict[str, float] = {}
    finish = t0
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
            if o.finished:
                finish = now
    engine.step_listeners.remove(count)
    return ModeRun(
        outputs=[list(r.output_token_ids) for r in reqs],
        prompt_rows=rows,
        cached_tokens=sum(r.stats.cached_prompt_tokens for r in reqs),
        seconds=finish - t0,
        ttfts=[first[r.request_id] - t0 for r in reqs],
    )


def _run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every prompt in every mode (rotated order), each on a fresh engine."""
    from batchserve import SamplingParams
    from batchserve.bench.runs import load_dataset

    build, tokenizer = _engine_factory(args.n)
    prompts = load_dataset("humaneval", args.num_prompts, tokenizer).prompts
    params = [
        SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed + i)
        for i in range(args.n)
    ]
    run_mode(build(True), prompts[0][:32], params[:2], "")  # warm-up: kernels, allocator; not measured
    totals = {mode: ModeTotals() for mode in MODES}
    identical = dict.fromkeys(MODES[1:], True)
    per_prompt = []
    for k, prompt in enumerate(prompts):
        runs: dict[str, ModeRun] = {}
        for mode in MODES[k % len(MODES) :] + MODES[: k % len(MODES)]:
            engine = build(mode not in CACHE_OFF)
            runs[mode] = run_mode(engine, prompt, params, f"call-{k}" if mode in GROUPED else "")
            del engine
            gc.collect()
            totals[mode].add(runs[mode], len(prompt))
        for mode in identical:
            identical[mode] = identical[mode] and runs[mode].outputs == runs["n"].outputs
        per_prompt.append({"prompt_tokens": len(prompt), **{m: _brief(r) for m, r in runs.items()}})
        print(f"prompt {k}: {len(prompt)} tokens, " + ", ".join(f"{m} {_brief(r)}" for m, r in runs.items()))
    return {
        "summary": {mode: totals[mode].summary(len(prompts)) for mode in MODES},
        "identical_to_n": identical,
        "per_prompt": per_prompt,
    }


def _brief(run: ModeRun) -> dict[str, Any]:
    return {
        "prompt_rows": run.prompt_rows,
        "output_tokens": sum(map(len, run.outputs)),
        "seconds": round(run.seconds, 3),
        "ttft_mean_s": round(statistics.fmean(run.ttfts), 4),
    }


def _markdown(result: dict[str, Any]) -> str:
    s, cfg = result["summary"], result["config"]
    lines = [
        f"# n={cfg['n']} samples against {cfg['n']} separate requests",
        "",
        f"{cfg['num_prompts']} HumanEval prompts, {cfg['max_new_tokens']} new tokens, temperature "
        f"{cfg['temperature']}, seeds {cfg['seed']}..{cfg['seed'] + cfg['n'] - 1}; `{METHOD}` engine settings, "
        f"{cfg['n']} seats, a fresh engine per (prompt, mode). Load average before/after: "
        f"{cfg['loadavg_before']} / {cfg['loadavg_after']}.",
        "",
        "| mode | prompt tokens sent | prompt rows computed | per prompt | cached | output tokens | tokens/s "
        "| vs split | TTFT mean (s) | TTFT p50 (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = s["split"]["tokens_per_s"]
    for mode in MODES:
        r = s[mode]
        lines.append(
            f"| {mode} | {r['prompt_tokens_sent']} | {r['prompt_rows_computed']} | {r['prompt_rows_per_prompt']} "
            f"| {r['cached_prompt_tokens']} | {r['output_tokens']} | {r['tokens_per_s']} "
            f"| {r['tokens_per_s'] / base:.3f}x | {r['ttft_mean_s']} | {r['ttft_p50_s']} |"
        )
    same = ", ".join(f"{m}: {'yes' if v else 'NO'}" for m, v in result["identical_to_n"].items())
    lines += ["", f"Outputs identical to `n`'s (same seeds, same tokens): {same}.", ""]
    return "\n".join(lines)


def main() -> None:
    args = _args()
    before = [round(x, 2) for x in os.getloadavg()]
    result = _run_all(args)
    result["config"] = {
        **vars(args),
        "method": METHOD,
        "loadavg_before": before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "report.md").write_text(_markdown(result))
    print(_markdown(result))


if __name__ == "__main__":
    main()
