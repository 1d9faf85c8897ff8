"""Logprobs' top alternatives on CPU without a full top-k per row: the same bits and order as
`topk`, ties and NaN included, and the same values whether a step's rows are read in place."""

from __future__ import annotations

import pytest
import torch

from batchserve.runner.penalties import TOP_GROUPS, requests_logprobs, token_logprobs, top_logprobs

V = 64 * TOP_GROUPS  # a vocabulary the grid takes


def _topk(lp: torch.Tensor, k: int) -> list[tuple[tuple[int, float], ...]]:
    values, indices = lp.topk(k, dim=-1)
    return [tuple(zip(i, x)) for i, x in zip(indices.tolist(), values.tolist())]


def _bits(pairs: tuple[tuple[int, float], ...]) -> list[int]:
    return torch.tensor([x for _, x in pairs], dtype=torch.float32).view(torch.int32).tolist()


def _rows(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(12, V, generator=gen) * 4
    logits[1] = logits[1].bfloat16().float()  # coarse values: ties among the best
    logits[2, :7] = logits[2].max() + 1  # seven equal best
    width = V // TOP_GROUPS
    logits[3, 100::width][:30] = logits[3].max() + torch.arange(30.0)  # the 30 best in one column
    logits[4, 100::width] = logits[4].max() + 1  # equal best, all in one column
    logits[9, 100:130] = logits[9].max() + torch.arange(30.0)  # the 30 best in one grid row
    logits[5, 3] = float("nan")
    logits[6, 9] = float("inf")
    logits[7, 5:] = float("-inf")  # five finite entries: the sixth best is -inf, tied
    logits[8] = 0.0  # all equal
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("k", [1, 2, 5, 20])
@pytest.mark.parametrize("seed", range(4))
def test_the_grid_gives_topk_bit_for_bit_ties_and_nan_included(k: int, seed: int) -> None:
    lp = _rows(seed)
    got, want = top_logprobs(lp, k), _topk(lp, k)
    for g, w in zip(got, want):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert _bits(g) == _bits(w)  # NaN included


def test_a_vocabulary_off_the_grid_takes_topk() -> None:
    lp = torch.log_softmax(torch.randn(3, V + 1, generator=torch.Generator().manual_seed(1)), dim=-1)
    assert top_logprobs(lp, 5) == _topk(lp, 5)


def test_rows_in_place_or_copied_and_several_requests_at_once_give_the_same_bits() -> None:
    raw = torch.randn(10, V, generator=torch.Generator().manual_seed(2)) * 5
    run = token_logprobs(raw, [3, 4, 5, 6], [1, 2, 3, 4], 5)  # one run: read in place
    apart = [token_logprobs(raw[r : r + 1].clone(), [0], [t], 5)[0] for r, t in zip(range(3, 7), range(1, 5))]
    assert run == apart == token_logprobs(raw, [6, 3, 4, 5], [4, 1, 2, 3], 5)[1:] + token_logprobs(raw, [6], [4], 5)
    both = requests_logprobs(raw, [("a", [3, 4], [1, 2], 5), ("b", [8], [7], 2), ("c", [5, 6], [3, 4], 5)])
    assert both["a"] + both["c"] == run and both["b"] == token_logprobs(raw[8:9].clone(), [0], [7], 2)
