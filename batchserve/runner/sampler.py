"""Token selection and draft-tree verification for one request."""

from __future__ import annotations

import torch

from batchserve.draft.tree import DraftTree
from batchserve.request import SamplingParams


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p. logits: [V] -> [V] float32."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = (cum - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs / probs.sum()


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Exactly one uniform draw per token (inverse CDF), so a seeded request consumes its
    random stream identically whether or not drafts are verified alongside."""
    probs = warp_probs(logits, params)
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    cdf = torch.cumsum(probs.double(), dim=0)
    target = torch.tensor(u * cdf[-1].item(), dtype=torch.float64, device=cdf.device)
    idx = int(torch.searchsorted(cdf, target, right=True))
    idx = min(idx, probs.shape[0] - 1)
    while probs[idx] == 0:  # never land on a token the warp removed (float edge of the CDF)
        idx -= 1
    return idx


def verify(
    logits: torch.Tensor,
    draft: DraftTree | None,
    params: SamplingParams,
    generator: torch.Generator | None,
    argmax: list[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Walk the tree from the root and return (emitted tokens, accepted draft node indices).

    logits: [1 + len(draft), V], row 0 for the root, row 1 + i for draft node i. At each
    node the model's own choice (argmax, or one seeded draw) is taken; if a child carries it
    the walk moves there, else it stops. The last emitted token is always the model's own.
    `argmax`, when given, holds the greedy choice of every row (computed batched).
    """
    emitted: list[int] = []
    accepted: list[int] = []
    row = 0
    children = draft.children if draft is not None else ({},)
    while True:
        if params.greedy:
            tok = argmax[row] if argmax is not None else int(torch.argmax(logits[row]))
        else:
            assert generator is not None
            tok = sample_token(logits[row], params, generator)
        emitted.append(tok)
        child = children[row].get(tok)
        if child is None:
            return emitted, accepted
        accepted.append(child)
        row = child + 1
