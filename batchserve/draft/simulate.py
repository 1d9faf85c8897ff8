"""Target-guided simulation (LLMA's Algorithm 2, generalized to trees).

Replays decoding as if the model produced a known output: each step the drafter proposes a
tree, the walk accepts the children that match the known continuation, and one more token
(the model's own) is emitted. Counting steps measures a drafter's step compression without
running the model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from batchserve.draft.base import Drafter
from batchserve.request import tokens_per_step
from batchserve.trees import DraftTree, walk


@dataclass(slots=True)
class SimulationResult:
    tokens: int = 0
    steps: int = 0
    draft_tokens: int = 0
    step_seconds: list[float] = field(default_factory=list)  # propose + update time per step

    @property
    def tokens_per_step(self) -> float:
        return tokens_per_step(self.tokens, self.steps)

    def merge(self, other: SimulationResult) -> None:
        self.tokens += other.tokens
        self.steps += other.steps
        self.draft_tokens += other.draft_tokens
        self.step_seconds.extend(other.step_seconds)


def simulate(
    drafter: Drafter,
    request_id: str,
    prompt: Sequence[int],
    output: Sequence[int],
    decoding_length: int,
    references: Sequence[Sequence[int]] = (),
) -> SimulationResult:
    """Steps a drafter needs to produce `output` after `prompt` (drafter state is updated
    exactly as in serving: start, accepted tokens each step, finish); `references`: the
    request's predicted output, as token ids."""
    res = SimulationResult()
    tokens = list(prompt)
    drafter.on_request_start(request_id, prompt, references=references)
    done = 0
    try:
        while done < len(output):
            t0 = time.perf_counter()
            budget = min(decoding_length, len(output) - done - 1)
            tree = drafter.propose(request_id, tokens, budget) if budget > 0 else None
            res.draft_tokens += len(tree) if tree is not None else 0
            # The model's choice after a node is the reference token at the node's depth.
            emitted, _ = walk(tree, lambda node, tree=tree, done=done: _reference(output, done, tree, node))
            tokens.extend(emitted)
            drafter.on_tokens_accepted(request_id, emitted)
            res.step_seconds.append(time.perf_counter() - t0)
            done += len(emitted)
            res.steps += 1
            res.tokens += len(emitted)
    finally:
        drafter.on_request_finish(request_id)
    return res


def _reference(output: Sequence[int], done: int, tree: DraftTree | None, node: int | None) -> int | None:
    """The reference token after `node`, or None past the end of the output."""
    i = done + (0 if node is None or tree is None else tree.depths[node])
    return output[i] if i < len(output) else None
