"""The host side of an engine step (schedule + prepare + verify + commit), without a forward.

    python benchmarks/host_side.py [--num-prompts 32] [--max-new-tokens 128] [--points 1:16,16:8]

The engine runs the default model's tokenizer on HumanEval prompts with a stand-in forward that
costs nothing (`batchserve.bench.host`): what a step costs here is what the host adds to every
GPU step. Each point is requests in flight : draft tokens per request (fixed, trie drafts).
Medians over the steps with every seat taken and no prompt chunk.
"""

from __future__ import annotations

import argparse

from batchserve.bench.datasets import humaneval
from batchserve.bench.host import HOST_PHASES, time_host
from batchserve.model.loader import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--points", default="1:16,16:8", help="requests:decoding_length, comma-separated")
    args = parser.parse_args()
    tokenizer = load_tokenizer()
    prompts = [tokenizer.encode(s.prompt) for s in humaneval()[: args.num_prompts]]
    points = [tuple(int(x) for x in p.split(":")) for p in args.points.split(",")]
    stats = time_host(prompts, tokenizer, len(tokenizer), points, args.max_new_tokens)
    print("| requests | draft tokens | steps | rows/step | tokens/step | " + " | ".join(HOST_PHASES) + " | host ms |")
    print("|---" * (6 + len(HOST_PHASES)) + "|")
    for (requests, length), s in zip(points, stats):
        cells = " | ".join(f"{s.phase_ms[n]:.2f}" for n in HOST_PHASES)
        head = f"| {requests} | {length} | {s.steps} | {s.rows:.1f} | {s.tokens_per_step:.2f}"
        print(f"{head} | {cells} | **{s.host_ms:.2f}** |")


if __name__ == "__main__":
    main()
