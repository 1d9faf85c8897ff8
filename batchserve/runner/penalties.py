"""Penalties, bias and logprobs on a step's kept rows, each row with its own history.

A row's history is its request's output so far followed by the draft tokens on the row's path
from the root (the node's own token included: the row predicts the token after it), so a draft
node sees exactly what plain decoding sees at that position. With c_t the count of token t in
the history, each kept row's logits l are changed, in this order (vLLM's):

    logit bias (OpenAI's):        l_t = l_t + b_t
    repetition penalty (vLLM's):  l_t = l_t / r if l_t > 0 else l_t * r, for t in the prompt or the history
    frequency and presence (OpenAI's): l_t = l_t - c_t * f - (c_t > 0) * p

Each is elementwise on a row's own logits, so a row's bits never depend on the rows beside it.
Logprobs are the model's raw distribution at the row that chose a token (log-softmax of the
logits before any of the above, grammar masks or temperature: vLLM's `raw_logprobs`)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import TypeAlias

import numpy as np
import torch

from batchserve.records import ScheduledRequest
from batchserve.request import TokenLogprob
from batchserve.threads import torch_threads


def tree_paths(r: ScheduledRequest) -> list[tuple[int, ...]]:
    """The draft tokens on each kept row's path: the root's (empty), then each node's."""
    paths: list[tuple[int, ...]] = [()]
    if r.draft is not None:
        for token, parent in zip(r.draft.tokens, r.draft.parents):
            paths.append((paths[0 if parent is None else parent + 1]) + (token,))
    return paths


def _row_pairs(
    r: ScheduledRequest, base: tuple[np.ndarray, np.ndarray], path: tuple[int, ...]
) -> tuple[np.ndarray, ...]:
    """(token ids, bias, counts, seen) for one row: every token a penalty or the bias touches.
    `base`: the output's distinct tokens and their counts (once per request, not per row)."""
    p = r.params
    tokens = np.concatenate((base[0], np.array(path, np.int64)))
    counted, inverse = np.unique(tokens, return_inverse=True)
    counts = np.bincount(inverse, weights=np.concatenate((base[1], np.ones(len(path)))), minlength=len(counted))
    prompt = np.unique(np.array(r.prompt_ids, np.int64))
    bias_ids = np.array([t for t, _ in p.logit_bias], np.int64)
    ids = np.unique(np.concatenate((counted, prompt, bias_ids)))
    count = np.zeros(len(ids), np.int64)
    count[np.searchsorted(ids, counted)] = counts.astype(np.int64)
    bias = np.zeros(len(ids), np.float64)
    bias[np.searchsorted(ids, bias_ids)] = [b for _, b in p.logit_bias]
    seen = (count > 0) | np.isin(ids, prompt)
    return ids, bias, count, seen


def penalize(logits: torch.Tensor, requests: list[tuple[int, ScheduledRequest]]) -> None:
    """Apply each request's penalties and bias to its root's and draft nodes' rows, in place.
    `requests`: (the root's kept row, the request) of the penalized sampling requests."""
    rows, ids, bias, count, seen, scalars = [], [], [], [], [], []
    for start, r in requests:
        p = r.params
        base = np.unique(np.array(r.output_ids, np.int64), return_counts=True)
        for k, path in enumerate(tree_paths(r)):
            t, b, c, s = _row_pairs(r, base, path)
            rows.append(np.full(len(t), start + k, np.int64))
            ids.append(t)
            bias.append(b)
            count.append(c)
            seen.append(s)
            scalars.append(np.tile([p.repetition_penalty, p.frequency_penalty, p.presence_penalty], (len(t), 1)))
    if not rows:
        return
    dev, dtype = logits.device, logits.dtype

    def on_device(parts: list[np.ndarray], kind: torch.dtype | None = None) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts)).to(dev, kind)

    row, tok = on_device(rows), on_device(ids)
    rep, freq, pres = on_device(scalars, dtype).unbind(1)
    x = logits[row, tok] + on_device(bias, dtype)  # [P]
    x = torch.where(on_device(seen), torch.where(x > 0, x / rep, x * rep), x)
    c = on_device(count)
    x = x - c.to(dtype) * freq - (c > 0).to(dtype) * pres
    logits[row, tok] = x


# A request's logprobs asked of one step: (request id, its rows in the raw logits, the tokens
# those rows chose, how many top alternatives)
LogprobsAsk: TypeAlias = tuple[str, list[int], list[int], int]


def requests_logprobs(raw: torch.Tensor, asks: list[LogprobsAsk]) -> dict[str, list[TokenLogprob]]:
    """`token_logprobs` of several requests' rows of `raw`, in one call per `top` (not one per
    request): a row's values never depend on the rows beside it, so each request gets the bits
    a call of its own would give it."""
    out: dict[str, list[TokenLogprob]] = {}
    for top in sorted({a[3] for a in asks}):
        group = [a for a in asks if a[3] == top]
        values = token_logprobs(raw, [k for a in group for k in a[1]], [t for a in group for t in a[2]], top)
        at = 0
        for rid, rows, _, _ in group:
            out[rid], at = values[at : at + len(rows)], at + len(rows)
    return out


def token_logprobs(raw: torch.Tensor, rows: list[int], tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's logprob at its row of `raw` (logits [R, V]) and the row's `top` most likely
    tokens. One thread: torch splits a vocabulary-wide reduction between threads when few rows
    share a call, which would make a row's sums depend on its company. Rows that are one run
    (a step without drafts, a prompt's rows) are read in place, the others copied out first."""
    with torch_threads(1):
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):
            picked = raw[rows[0] : rows[0] + len(rows)]
        else:
            picked = raw[torch.tensor(rows, device=raw.device, dtype=torch.long)]
        lp = torch.log_softmax(picked.float(), dim=-1)  # [N, V]
        chosen = lp.gather(1, torch.tensor(tokens, device=raw.device)[:, None])[:, 0].tolist()
        best = top_logprobs(lp, top) if top else [()] * len(rows)
    return [TokenLogprob(t, lp_t, b) for t, lp_t, b in zip(tokens, chosen, best)]


TOP_GROUPS = 64  # entries per column of a row seen as [TOP_GROUPS, V / TOP_GROUPS] (CPU top-k)


def top_logprobs(lp: torch.Tensor, k: int) -> list[tuple[tuple[int, float], ...]]:
    """Each row's `lp.topk(k)` as (token id, logprob) pairs, with the same bits and order, on
    CPU without a full top-k of each row (which costs more than the log-softmax): the row seen
    as a grid of TOP_GROUPS rows, the k + 1 columns with the largest maxima hold entries that
    are at least every entry outside them, so the k + 1 largest of those columns are the row's.
    Where they strictly decrease, the row's top k is those k, in that order, whatever a
    top-k does with ties; a row with a tie (or a NaN) among them takes the full top-k."""
    n, v = lp.shape
    width = v // TOP_GROUPS
    if lp.device.type != "cpu" or v % TOP_GROUPS or width < k + 1 or not lp.is_contiguous():
        values, indices = lp.topk(k, dim=-1)
        return [tuple(zip(i, x)) for i, x in zip(indices.tolist(), values.tolist())]
    grid = lp.view(n, TOP_GROUPS, width)  # column c: entries c, c + width, c + 2 * width, ...
    columns = grid.amax(1).topk(k + 1, dim=-1).indices  # [n, k + 1]
    cells = grid.gather(2, columns[:, None, :].expand(-1, TOP_GROUPS, -1)).view(n, -1)  # [n, G * (k + 1)]
    values, at = cells.topk(k + 1, dim=-1)
    best = []
    for row, (xs, cell, cols) in enumerate(zip(values.tolist(), at.tolist(), columns.tolist())):
        if all(a > b for a, b in pairwise(xs)):  # cell g * (k + 1) + j: grid row g of column cols[j]
            best.append(tuple((c // (k + 1) * width + cols[c % (k + 1)], x) for c, x in zip(cell[:k], xs[:k])))
        else:
            values_r, indices_r = lp[row].topk(k)
            best.append(tuple(zip(indices_r.tolist(), values_r.tolist())))
    return best


def prompt_logprobs(requests: Sequence[ScheduledRequest], scored: torch.Tensor) -> dict[str, list[TokenLogprob]]:
    """Each scoring request's prompt logprobs from `scored` ([N, V]: their rows, request by request)."""
    out: dict[str, list[TokenLogprob]] = {}
    at = 0
    for r in requests:
        if r.score_targets:
            n = len(r.score_targets)
            out[r.request_id] = token_logprobs(
                scored, list(range(at, at + n)), list(r.score_targets), r.params.prompt_logprobs or 0
            )
            at += n
    return out
