"""What learning one step late costs in tokens per step: the trie drafter with its output-trie
insertion deferred (as under the engine: a step's accepted tokens reach the scope's trie while
the next step's forward runs, after that step's proposals) against inserting at once.

    python benchmarks/learn_lag.py [--concurrent 1,16] [--length 16] [--num-samples 400]

A target-guided simulation (no model: the datasets' reference outputs are the model's), many
requests in flight in one scope, the trie warmed on the dev split as the bench does. Each step
every running request proposes, the walk accepts what matches, then the step commits.
"""

from __future__ import annotations

import argparse
from collections import deque

from batchserve.bench.datasets import humaneval, sharegpt, split
from batchserve.bench.samples import Encoded, encode
from batchserve.config import DraftConfig
from batchserve.draft import TrieDrafter
from batchserve.model.loader import load_tokenizer
from batchserve.trees import walk


def tokens_per_step(warm: list[list[int]], test: list[Encoded], concurrent: int, length: int, late: bool) -> float:
    """Mean tokens a request-step over `test`, `concurrent` requests in flight."""
    drafter = TrieDrafter(DraftConfig(method="lookahead"))
    drafter.warm_up(warm)
    if late:
        drafter.defer_learning()
    waiting = deque(enumerate(test))
    running: dict[str, tuple[list[int], list[int], int]] = {}  # id -> (text, output, done)
    tokens = steps = 0
    while waiting or running:
        while waiting and len(running) < concurrent:
            i, sample = waiting.popleft()
            drafter.on_request_start(f"r{i}", sample.prompt)
            running[f"r{i}"] = (list(sample.prompt), sample.output, 0)
        emitted: dict[str, list[int]] = {}
        for rid, (text, output, done) in running.items():  # schedule: every proposal
            budget = min(length, len(output) - done - 1)
            tree = drafter.propose(rid, text, budget) if budget > 0 else None

            def choose(node: int | None, tree=tree, output=output, done=done) -> int | None:
                i = done + (0 if node is None or tree is None else tree.depths[node])
                return output[i] if i < len(output) else None

            emitted[rid] = walk(tree, choose)[0]
        if late:
            drafter.learn()  # the last step's tokens, while this step's forward runs
        for rid, toks in emitted.items():  # commit
            text, output, done = running[rid]
            text.extend(toks)
            drafter.on_tokens_accepted(rid, toks)
            tokens, steps = tokens + len(toks), steps + 1
            if done + len(toks) >= len(output):
                drafter.on_request_finish(rid)
                del running[rid]
            else:
                running[rid] = (text, output, done + len(toks))
    return tokens / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrent", default="1,16")
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--num-samples", type=int, default=400)
    args = parser.parse_args()
    tokenizer = load_tokenizer()
    print("| dataset | in flight | at once | one step late | late / at once |")
    print("|---|---|---|---|---|")
    for name in ("humaneval", "sharegpt"):
        samples = humaneval() if name == "humaneval" else sharegpt(args.num_samples)
        dev, test = split(samples[: args.num_samples])
        warm = [e.output for e in encode(dev, tokenizer)]
        test_e = [e for e in encode(test, tokenizer) if e.output]
        for c in (int(x) for x in args.concurrent.split(",")):
            now = tokens_per_step(warm, test_e, c, args.length, late=False)
            late = tokens_per_step(warm, test_e, c, args.length, late=True)
            print(f"| {name} | {c} | {now:.3f} | {late:.3f} | {late / now:.4f} |")


if __name__ == "__main__":
    main()
