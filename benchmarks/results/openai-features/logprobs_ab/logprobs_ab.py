"""A/B of logprobs' cost: `lookahead-adaptive-q4` with and without `+logprobs` (top 5), in
alternating order per round (AB, BA, ...), each run's generation wall time and this process's
CPU time (less moved by other work on a shared machine than the wall time).

    .venv/bin/python benchmarks/results/openai-features/logprobs_ab/logprobs_ab.py \
        --batch 16 --num-prompts 32 --rounds 6 --out benchmarks/results/openai-features/logprobs_ab/b16.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import batchserve.bench.runs as runs
from batchserve.bench.methods import batchserve_method
from batchserve.runner import load_model

NAMES = ("lookahead-adaptive-q4", "lookahead-adaptive-q4+logprobs")


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def _ratio(rows: list[dict[str, Any]], time_key: str) -> float:
    """tokens/s of the logprobs runs over those of the plain runs, all rounds summed."""
    rate = {n: sum(r["tokens"] for r in rows if r["method"] == n) for n in NAMES}
    secs = {n: sum(r[time_key] for r in rows if r["method"] == n) for n in NAMES}
    return (rate[NAMES[1]] / secs[NAMES[1]]) / (rate[NAMES[0]] / secs[NAMES[0]])


def main() -> None:
    args = _args()
    model, tokenizer = load_model(None, "float32")
    method = batchserve_method(NAMES[0])
    assert method is not None
    profile = runs.cost_profiles(list(NAMES), model, tokenizer)[method.kernels]
    work = runs.load_dataset("humaneval", args.num_prompts, tokenizer)
    cpu: dict[str, float] = {}
    closed_loop = runs._closed_loop

    def timed(*a: Any, **k: Any) -> Any:  # the generation only, as the bench's seconds
        c0 = time.process_time()
        out = closed_loop(*a, **k)
        cpu["s"] = time.process_time() - c0
        return out

    runs._closed_loop = timed  # type: ignore[assignment]
    rows: list[dict[str, Any]] = []
    reference = None
    for rnd in range(args.rounds):
        for name in NAMES if rnd % 2 == 0 else NAMES[::-1]:
            m = batchserve_method(name)
            assert m is not None
            prompts = work.prompts[: args.num_prompts]
            run = runs.run_batchserve(
                model, tokenizer, prompts, args.max_new_tokens, args.batch, m, work.warm, 16, profile
            )
            reference = reference or run.outputs
            tokens, steps = sum(map(len, run.outputs)), run.phases.steps
            rows.append(
                {
                    "round": rnd,
                    "method": name,
                    "tokens": tokens,
                    "wall_s": run.seconds,
                    "cpu_s": cpu["s"],
                    "tok_per_s": tokens / run.seconds,
                    "same_tokens": run.outputs == reference,
                    "verify_ms": run.phases.seconds["verify"] * 1e3 / steps,
                    "step_wall_ms": run.phases.seconds["wall"] * 1e3 / steps,
                }
            )
            print(rows[-1], flush=True)
    per_round = []
    for rnd in range(args.rounds):
        plain, asked = (next(r for r in rows if r["round"] == rnd and r["method"] == n) for n in NAMES)
        wall = asked["tok_per_s"] / plain["tok_per_s"]
        per_round.append({"round": rnd, "wall": wall, "cpu": plain["cpu_s"] / asked["cpu_s"]})
    summary = {
        **vars(args),
        "median_wall_ratio": statistics.median(r["wall"] for r in per_round),
        "median_cpu_ratio": statistics.median(r["cpu"] for r in per_round),
        "total_wall_ratio": _ratio(rows, "wall_s"),
        "total_cpu_ratio": _ratio(rows, "cpu_s"),
        "all_same_tokens": all(r["same_tokens"] for r in rows),
    }
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "ratios": per_round, "runs": rows}, f, indent=2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
