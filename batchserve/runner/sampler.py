"""Token choice for every kept row of a step at once, and the draft-tree walk.

Greedy rows take the argmax. Sampled rows warp their logits (temperature, top-k, top-p) and
invert the CDF at one uniform each: a row at depth d of a request's tree uses the request's
d-th unused uniform, so every emitted token consumes exactly one uniform of the request's
own seeded stream, in order, with or without drafts. All choices come back in one
device-to-host copy; the walk itself is a few dict lookups per accepted token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchserve.draft.tree import DraftTree, walk


@dataclass(frozen=True, slots=True)
class SampledRows:
    """Per-row sampling parameters of the kept rows that sample (not greedy)."""

    rows: torch.Tensor  # [S] int64: which kept rows sample
    temperature: torch.Tensor  # [S] float32
    top_k: torch.Tensor  # [S] int64, 0 = no cut
    top_p: torch.Tensor  # [S] float32
    uniform: torch.Tensor  # [S] float64 in [0, 1)


def warp_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, row by row. [S, V] -> [S, V] float32."""
    x = logits.float() / temperature[:, None]
    vocab = x.shape[-1]
    cut_k = (top_k > 0) & (top_k < vocab)
    if bool(cut_k.any()):
        kmax = int(top_k[cut_k].max())
        kth = x.topk(kmax, dim=-1).values.gather(1, (top_k.clamp(1, kmax) - 1)[:, None])  # [S, 1]
        x = x.masked_fill(cut_k[:, None] & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    cut_p = top_p < 1.0
    if bool(cut_p.any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = ((sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]) & cut_p[:, None]
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs / probs.sum(dim=-1, keepdim=True)


def apply_token_masks(logits: torch.Tensor, masks: list[tuple[int, np.ndarray]]) -> None:
    """Structured output: set to -inf, in place, every logit a row's grammar forbids. `masks`:
    (first row, [R, W] int32 bitmask of rows first..first+R-1; bit t % 32 of word t // 32 allows
    token t). Every choice after this, argmax or a draw, is among the allowed tokens."""
    rows = torch.from_numpy(np.concatenate([np.arange(start, start + len(m)) for start, m in masks]))
    words = torch.from_numpy(np.concatenate([m for _, m in masks]))  # [R, W]
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(len(rows), -1)[:, : logits.shape[-1]].bool()  # [R, V]
    rows, allowed = rows.to(logits.device), allowed.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def choose_tokens(logits: torch.Tensor, sampled: SampledRows | None) -> list[int]:
    """The model's choice at every kept row: argmax, or one inverse-CDF draw. logits: [K, V]."""
    choice = logits.argmax(dim=-1)  # [K]
    if sampled is not None:
        probs = warp_rows(logits[sampled.rows], sampled.temperature, sampled.top_k, sampled.top_p)  # [S, V]
        cdf = probs.double().cumsum(dim=-1)
        target = (sampled.uniform * cdf[:, -1])[:, None]  # [S, 1]
        idx = torch.searchsorted(cdf, target, right=True).clamp(max=probs.shape[-1] - 1)  # [S, 1]
        # Never land on a token the warp removed (float edge of the CDF): step back to a kept one.
        positions = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
        last_kept = torch.where(probs > 0, positions, -1).cummax(dim=-1).values  # [S, V]
        choice[sampled.rows] = last_kept.gather(1, idx).squeeze(1)
    return choice.tolist()


def verify(draft: DraftTree | None, choices: list[int]) -> tuple[list[int], list[int]]:
    """Walk the tree from the root; return (emitted tokens, accepted draft node indices).

    `choices[0]` is the model's token after the root, `choices[1 + i]` after draft node i. At
    each node the model's choice is taken; if a child carries it the walk moves there, else it
    stops. The last emitted token is always the model's own.
    """
    return walk(draft, lambda node: choices[0 if node is None else 1 + node])
