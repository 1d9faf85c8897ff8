"""The samples of one call: sample 0 alone scores a prompt, and every other sample's first output
shows its scores, in whatever order the outputs come."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from batchserve import SamplingParams
from batchserve.server.samples import samples_of, share_prompt_scores


@dataclass
class Out:
    text: str
    prompt_logprobs: list[float] | None = None


async def _items(items: list[tuple[int, Out]]) -> AsyncIterator[tuple[int, Out]]:
    for item in items:
        yield item


async def _shared(items: list[tuple[int, Out]], n: int) -> list[tuple[int, str, list[float] | None]]:
    return [(i, o.text, o.prompt_logprobs) async for i, o in share_prompt_scores(_items(items), n)]  # type: ignore[arg-type]


def test_only_the_first_sample_scores_and_seeds_step_by_one() -> None:
    samples = samples_of("r", SamplingParams(seed=7, prompt_logprobs=2, temperature=1.0), 3)
    assert [(rid, s.seed, s.prompt_logprobs) for rid, s in samples] == [
        ("r-0", 7, 2),
        ("r-1", 8, None),
        ("r-2", 9, None),
    ]


async def test_a_sample_ahead_of_the_first_waits_for_its_scores() -> None:
    # Two prompts of two samples: 1 and 3 come before their prompt's sample 0 and 2.
    items = [(1, Out("b")), (3, Out("d")), (1, Out("b2")), (0, Out("a", [0.5])), (2, Out("c", [0.25])), (3, Out("d2"))]
    assert await _shared(items, 2) == [
        (0, "a", [0.5]), (1, "b", [0.5]), (1, "b2", None), (2, "c", [0.25]), (3, "d", [0.25]), (3, "d2", None),
    ]  # fmt: skip


async def test_outputs_held_for_a_first_sample_that_never_answers_still_come() -> None:
    assert await _shared([(1, Out("b")), (1, Out("b2"))], 2) == [(1, "b", None), (1, "b2", None)]
