"""The batch-invariance contract checked on the loaded model at start-up, before READY.

The kernel checks (`kernels_invariant`, `packed_products_invariant`) run torch's kernels on toy
shapes; this runs the model itself, at its real shapes and the configured thread count, on two
compositions of the same request: alone (its prompt, then its root and a draft tree in a step
of their own), and mid-step among others (another request's prompt chunk beside its prompt, then
its rows between a request with a draft tree and a plain decode). Every kept row's logits must
have the same bits in both. A handful of forwards, on KV blocks no request holds yet.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from batchserve.records import ScheduledRequest, SchedulerOutput
from batchserve.request import SamplingParams
from batchserve.runner.runner import ModelRunner
from batchserve.trees import DraftTree

CHECK_ID = "#self-check"  # outside request ids' alphabet: no request can share its runner state
PROMPT = 16  # tokens of the checked request's prompt (the others' differ in length)
TREE = DraftTree((11, 12, 13, 14, 15, 16), (None, 0, 1, None, 3, 0))  # two branches, depth 3


class CheckResult(NamedTuple):
    invariant: bool  # checked, and every compared row had the same bits in both compositions
    rows: int  # rows compared
    seconds: float
    detail: str  # what was compared, or what differed (the log, GetModelInfo)
    layers: int = 0  # row-wise layers checked before (`layer_check`)
    finite: bool = True  # every checked output was finite (False: NaN or Inf somewhere, never served)


def _tokens(n: int, seed: int, vocab: int) -> tuple[int, ...]:
    return tuple((seed + 7 * i) % (vocab - 1) + 1 for i in range(n))


def _request(
    name: str, tokens: tuple[int, ...], cached: int, blocks: range, draft: DraftTree | None
) -> ScheduledRequest:
    return ScheduledRequest(f"{CHECK_ID}-{name}", tokens, cached, tuple(blocks), draft, True, SamplingParams())


def check_invariance(runner: ModelRunner, num_blocks: int) -> CheckResult:
    """Run the check on blocks [0, num_blocks) of the pool (free: nothing has been served yet)."""
    t0 = time.perf_counter()
    bs = runner.backend.block_size
    vocab = int(runner.model.config.vocab_size)
    per = -(-(3 * PROMPT + len(TREE) + 2) // bs)  # blocks for the longest request below
    if 4 * per > num_blocks:
        return CheckResult(False, 0, 0.0, f"not checked: the pool's {num_blocks} blocks are too few")
    blocks = [range(i * per, (i + 1) * per) for i in range(4)]
    prompt, root = _tokens(PROMPT, 3, vocab), _tokens(1, 5, vocab)  # root: the token after the prompt
    try:
        # Alone: the prompt, then the root and the tree.
        runner.logits(SchedulerOutput((_request("a", prompt, 0, blocks[0], None),), ()))
        alone = runner.logits(SchedulerOutput((_request("a", root, PROMPT, blocks[0], TREE),), ()))
        # Among others: a longer prompt chunk beside the same prompt, then the same rows mid-step.
        other, third = _tokens(PROMPT + 21, 9, vocab), _tokens(PROMPT // 2, 17, vocab)
        chain = DraftTree.chain(_tokens(5, 21, vocab))  # the request before it drafts too
        runner.logits(
            SchedulerOutput(
                (
                    _request("x", other, 0, blocks[1], None),
                    _request("b", prompt, 0, blocks[2], None),
                    _request("y", third, 0, blocks[3], None),
                ),
                (),
            )
        )
        mixed = runner.logits(
            SchedulerOutput(
                (
                    _request("x", root, len(other), blocks[1], chain),
                    _request("b", root, PROMPT, blocks[2], TREE),
                    _request("y", root, len(third), blocks[3], None),
                ),
                (),
            )
        )
    finally:
        runner.release([f"{CHECK_ID}-{n}" for n in "abxy"])
    start = 1 + len(chain)  # after x's root and its draft rows
    mine = mixed[start : start + 1 + len(TREE)]
    seconds = time.perf_counter() - t0
    bad = [i for i, row in enumerate(torch.cat((alone, mixed))) if not bool(torch.isfinite(row).all())]
    if bad:  # NaN != NaN: said as what it is, not as rows that differ
        rows = alone.shape[0] + mixed.shape[0]
        detail = f"the model's logits are not finite (NaN or Inf) in {len(bad)} of {rows} rows"
        return CheckResult(False, len(mine), seconds, detail, finite=False)
    same = [torch.equal(a, b) for a, b in zip(alone, mine)]
    detail = "" if all(same) else f"rows {[i for i, s in enumerate(same) if not s]} of {len(same)} differ"
    return CheckResult(all(same), len(same), seconds, detail)
