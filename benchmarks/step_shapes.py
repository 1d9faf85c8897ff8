"""Whole engine steps of chosen shapes on the default model: ms per step (the fastest of 15).

    python benchmarks/step_shapes.py

Two questions, on the default CPU forward (SmolLM2 as `LLM()` loads it, the invariant attention):
- what a few draft trees among many decode roots cost with the attention grouping requests by
  row count (today's) and with one group per key count (each root padded to a tree's rows);
- how the step grows past 16 rows (torch's int4 kernel, the earlier Q4_1 path, worked in 16-row
  blocks), which is why the cost profile measures 17, 33 and 65 rows.
Each request has a 220-token context; draft trees are random, rooted at the request's token.
"""

from __future__ import annotations

import random
import time

import batchserve.attention.invariant_plan as invariant
from batchserve.llm import LLM
from batchserve.records import ScheduledRequest, SchedulerOutput
from batchserve.request import SamplingParams
from batchserve.trees import DraftTree

CONTEXT = 220
# (label, requests, draft nodes of the first requests)
GROUPING = (
    ("16 roots", 16, ()),
    ("16 roots, one with a tree of 5", 16, (5,)),
    ("16 roots, two with trees of 3", 16, (3, 3)),
    ("4 roots, one with a tree of 4", 4, (4,)),
)
ROWS = (8, 16, 17, 20, 32, 33)  # decode roots only


def random_tree(rng: random.Random, size: int) -> DraftTree:
    parents: list[int | None] = [rng.choice([None, *range(i)]) for i in range(size)]
    return DraftTree(tuple(rng.randrange(1, 900) + 900 * i for i in range(size)), tuple(parents))


def step(block_size: int, num_seqs: int, drafts: tuple[int, ...], rng: random.Random) -> SchedulerOutput:
    reqs, first = [], 0
    for i in range(num_seqs):
        nodes = drafts[i] if i < len(drafts) else 0
        blocks = -(-(CONTEXT + nodes + 1) // block_size)
        reqs.append(
            ScheduledRequest(
                request_id=f"shape-{i}",
                token_ids=(1,),
                num_computed_tokens=CONTEXT,
                block_ids=tuple(range(first, first + blocks)),
                draft=random_tree(rng, nodes) if nodes else None,
                sample=True,
                params=SamplingParams(max_new_tokens=nodes + 2),
            )
        )
        first += blocks
    return SchedulerOutput(requests=tuple(reqs), finished_request_ids=())


def step_ms(runner: object, out: SchedulerOutput) -> float:
    t0 = time.perf_counter()
    runner.execute(out)  # type: ignore[attr-defined]
    return (time.perf_counter() - t0) * 1e3


def fastest_ms(runner: object, out: SchedulerOutput, repeats: int = 15) -> float:
    step_ms(runner, out), step_ms(runner, out)  # warm-up
    return min(step_ms(runner, out) for _ in range(repeats))


def grouping_ms(runner: object, out: SchedulerOutput, repeats: int = 25) -> tuple[float, float]:
    """(one group per key count, grouped by rows too): the fastest of `repeats`, the two
    alternating so that the machine's drift falls on both alike."""
    by_rows = invariant.split_by_rows
    splits = (lambda members, q_len: [members], by_rows)
    times: tuple[list[float], list[float]] = ([], [])
    try:
        for i in range(repeats + 2):  # the first two: warm-up
            for variant, split in enumerate(splits):
                invariant.split_by_rows = split
                ms = step_ms(runner, out)
                if i >= 2:
                    times[variant].append(ms)
    finally:
        invariant.split_by_rows = by_rows
    return min(times[0]), min(times[1])


def main() -> None:
    llm = LLM(draft="none", max_num_seqs=64)
    runner = llm.engine.runner
    block_size = runner.backend.block_size
    print("| step | one group per key count (ms) | grouped by rows too (ms) |\n|---|---|---|")
    for label, num_seqs, drafts in GROUPING:
        single, by_rows = grouping_ms(runner, step(block_size, num_seqs, drafts, random.Random(0)))
        print(f"| {label} | {single:.1f} | {by_rows:.1f} |")
    print("\n| decode roots | ms |\n|---|---|")
    for n in ROWS:
        print(f"| {n} | {fastest_ms(runner, step(block_size, n, (), random.Random(0))):.1f} |")


if __name__ == "__main__":
    main()
