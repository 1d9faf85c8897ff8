"""Full decode steps at batch 16, ShareGPT against HumanEval, alternating, in one process.

    python benchmarks/results/cpu-attention/decode_ratio.py

A full decode step runs 16 requests and no prompt chunk. The pool (2 GiB) holds 16 long
ShareGPT requests at once, which the bench's 0.5 GiB pool does not.
"""

from __future__ import annotations

from typing import Any

from batchserve import LLM, SamplingParams
from batchserve.bench.runs import load_dataset
from batchserve.runner import load_model


def main() -> None:
    model, tokenizer = load_model(None, "float32")
    for dataset in ("sharegpt", "humaneval", "sharegpt", "humaneval"):
        work = load_dataset(dataset, 32, tokenizer)
        llm = LLM(
            draft="none", adaptive=False, max_num_seqs=16, hf_model=model, tokenizer=tokenizer, kv_cache_memory_gb=2.0
        )
        walls: list[float] = []

        def listen(out: Any, phases: Any, walls: list[float] = walls) -> None:
            if len(out.requests) == 16 and all(len(r.token_ids) == 1 for r in out.requests):
                walls.append(phases.wall)

        llm.engine.step_listeners.append(listen)
        llm.generate(work.prompts[:32], SamplingParams(max_new_tokens=64), use_tqdm=False)
        mean = 1e3 * sum(walls) / max(1, len(walls))
        print(f"{dataset}: {len(walls)} full decode steps, {mean:.1f} ms each", flush=True)


if __name__ == "__main__":
    main()
