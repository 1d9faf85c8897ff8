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

import numpy as np
import torch

from batchserve.request import TokenLogprob
from batchserve.scheduler.output import ScheduledRequest
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


def token_logprobs(raw: torch.Tensor, rows: list[int], tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's logprob at its row of `raw` (logits [R, V]) and the row's `top` most likely
    tokens. One thread: torch splits a vocabulary-wide reduction between threads when few rows
    share a call, which would make a row's sums depend on its company."""
    with torch_threads(1):
        lp = torch.log_softmax(raw[torch.tensor(rows, device=raw.device)].float(), dim=-1)  # [N, V]
        chosen = lp.gather(1, torch.tensor(tokens, device=raw.device)[:, None])[:, 0].tolist()
        if top:
            values, indices = lp.topk(top, dim=-1)
            best = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        else:
            best = [()] * len(rows)
    return [TokenLogprob(t, lp_t, b) for t, lp_t, b in zip(tokens, chosen, best)]
