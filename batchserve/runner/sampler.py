"""Token choice for every kept row of a step at once, and the draft trees' acceptance.

Greedy rows take the argmax. Sampled rows warp their logits (temperature, top-k, top-p) and
invert the CDF at one uniform each: a row at depth d of a request's tree uses the request's
d-th unused uniform, so every emitted token consumes exactly one uniform of the request's
own seeded stream, in order, with or without drafts.

Acceptance runs on the device too (`accept`): a node is accepted when it and each of its
ancestors carry the token the model chose at their parent; each request's deepest accepted
node ends its walk. One small device-to-host copy per step brings back, per request, that
node and the model's token after it (and the window rows' tokens): never the logits. Nothing
in here reads a device value on the host before that copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from batchserve.threads import torch_threads
from batchserve.trees import DraftTree


@dataclass(frozen=True, slots=True)
class SampledRows:
    """Per-row sampling parameters of the kept rows that sample (not greedy)."""

    rows: torch.Tensor  # [S] int64: which kept rows sample
    temperature: torch.Tensor  # [S] float32
    top_k: torch.Tensor  # [S] int64, 0 = no cut
    top_p: torch.Tensor  # [S] float32
    uniform: torch.Tensor  # [S] float64 in [0, 1)
    # From the host's own parameters, so that warping reads nothing back from the device:
    # The largest top-k below the vocabulary among the rows (0: none cuts; None: read it from top_k).
    max_top_k: int | None = None
    any_top_p: bool = True  # some row cuts by top-p


def warp_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    max_top_k: int | None = None,
    any_top_p: bool = True,
) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, row by row. [S, V] -> [S, V] float32.
    `max_top_k` (the largest cut among the rows, 0 for none) and `any_top_p` come from the host's
    parameters; without `max_top_k` it is read from `top_k` (a device-to-host copy). One thread:
    see `choose_on_device`."""
    with torch_threads(1):
        return _warp(logits, temperature, top_k, top_p, max_top_k, any_top_p)


def _warp(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    max_top_k: int | None,
    any_top_p: bool,
) -> torch.Tensor:
    x = logits.float() / temperature[:, None]
    vocab = x.shape[-1]
    cut_k = (top_k > 0) & (top_k < vocab)
    kmax = max_top_k if max_top_k is not None else int(top_k.masked_fill(~cut_k, 0).max())
    if kmax > 0:
        kth = x.topk(kmax, dim=-1).values.gather(1, (top_k.clamp(1, kmax) - 1)[:, None])  # [S, 1]
        x = x.masked_fill(cut_k[:, None] & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    cut_p = top_p < 1.0
    if any_top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = ((sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]) & cut_p[:, None]
        drop[:, 0] = False  # a top_p that rounds to 0 in float32 would drop even the first
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


def choose_on_device(logits: torch.Tensor, sampled: SampledRows | None) -> torch.Tensor:
    """[K] the model's choice at every kept row, left on the logits' device."""
    choice = logits.argmax(dim=-1)  # [K]
    if sampled is not None:
        # One thread: torch splits a reduction over a vocabulary-wide row between threads when few
        # rows share the call, so a row's sums would depend on the rows beside it.
        with torch_threads(1):
            choice[sampled.rows] = _draw(logits, sampled)
    return choice


def _draw(logits: torch.Tensor, sampled: SampledRows) -> torch.Tensor:
    """[S] one inverse-CDF draw per sampled row."""
    probs = warp_rows(
        logits[sampled.rows],
        sampled.temperature,
        sampled.top_k,
        sampled.top_p,
        sampled.max_top_k,
        sampled.any_top_p,
    )  # [S, V]
    cdf = probs.double().cumsum(dim=-1)
    target = (sampled.uniform * cdf[:, -1])[:, None]  # [S, 1]
    idx = torch.searchsorted(cdf, target, right=True).clamp(max=probs.shape[-1] - 1)  # [S, 1]
    # Never land on a token the warp removed (float edge of the CDF): step back to a kept one.
    positions = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
    last_kept = torch.where(probs > 0, positions, -1).cummax(dim=-1).values  # [S, V]
    return last_kept.gather(1, idx).squeeze(1)


@dataclass(frozen=True, slots=True)
class TreeRows:
    """Where each sampling request's tree sits among the step's kept rows (host arrays, int64).

    Request j's root is kept row `roots[j]`, its draft node i is row `roots[j] + 1 + i`; its window
    rows (if any) follow its tree and are listed in `window`.
    """

    roots: np.ndarray  # [S] kept row of each sampling request's root
    node_rows: np.ndarray  # [N] kept row of every draft node of the step
    node_parent: np.ndarray  # [N] kept row of each node's parent (a root child: its root)
    node_token: np.ndarray  # [N] the token each node carries
    node_depth: np.ndarray  # [N] depth below the root (root children: 1)
    node_request: np.ndarray  # [N] which sampling request (index into roots)
    pair_node: np.ndarray  # [P] index into the nodes ...
    pair_ancestor: np.ndarray  # [P] ... and one of its ancestors-or-self (as a node index)
    window: np.ndarray  # [W] kept rows whose choice is returned as it is (window outputs)

    @classmethod
    def of(cls, trees: list[tuple[int, DraftTree | None, int]]) -> TreeRows:
        """From (root row, draft, window rows after the tree) per sampling request: Python lists
        gathered over the step's trees, one array each at the end (a step holds dozens of trees)."""
        roots, rows, parents, tokens, depths, owners, window = ([] for _ in range(7))
        pair_n: list[np.ndarray] = []
        pair_a: list[np.ndarray] = []
        first = 0  # node index of the request's first node
        for j, (root, tree, num_window) in enumerate(trees):
            roots.append(root)
            n = 0 if tree is None else len(tree)
            if tree is not None and n:
                rows += range(root + 1, root + 1 + n)
                parents += [root if q is None else root + 1 + q for q in tree.parents]
                tokens += tree.tokens
                depths += tree.depths
                owners += [j] * n
                node, ancestor = np.nonzero(tree.mask)  # [n, n] ancestor-or-self
                pair_n.append(node + first)
                pair_a.append(ancestor + first)
                first += n
            if num_window:
                window += range(root + 1 + n, root + 1 + n + num_window)

        def ints(values: list[int]) -> np.ndarray:
            return np.array(values, np.int64)

        def cat(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

        return cls(
            ints(roots), ints(rows), ints(parents), ints(tokens), ints(depths), ints(owners),
            cat(pair_n), cat(pair_a), ints(window),
        )  # fmt: skip


def accept(
    choices: torch.Tensor, tree: TreeRows, upload: Callable[..., list[torch.Tensor]] | None = None
) -> torch.Tensor:
    """Greedy or sampled acceptance of every tree of the step, on the choices' device.

    choices: [K] the model's token at each kept row. Returns [2 S + W] int64: each request's deepest
    accepted row (its root where no node is accepted), the model's token after it (the bonus
    token), then the window rows' tokens. Node i is accepted iff every node on its path carries
    the token chosen at its parent; siblings carry distinct tokens, so the accepted nodes of a
    tree form one path from its root and the deepest one ends it. `upload` brings the tree's
    host arrays to the device in one copy (the runner's `Upload`); by default, one copy each.
    """
    dev = choices.device
    arrays = (
        tree.roots, tree.node_rows, tree.node_parent, tree.node_token, tree.node_depth, tree.node_request,
        tree.pair_node, tree.pair_ancestor, tree.window,
    )  # fmt: skip
    on_device = upload(*arrays) if upload is not None else [torch.from_numpy(a).to(dev) for a in arrays]
    roots, node_rows, parent, token, depth, request, pair_node, pair_ancestor, window = on_device
    deepest = roots.clone()
    if len(tree.node_rows):
        k = len(choices)
        match = token == choices[parent]  # [N]
        misses = torch.zeros(len(node_rows), dtype=torch.int64, device=dev)
        misses.index_add_(0, pair_node, (~match[pair_ancestor]).long())  # [N] mismatches on each node's path
        key = torch.where(misses == 0, depth * k + node_rows, -1)  # deeper wins; a root's key is its row
        deepest = deepest.scatter_reduce(0, request, key, "amax")
        deepest = deepest % k
    return torch.cat((deepest, choices[deepest], choices[window]))


class Verdict(NamedTuple):
    """`accept`'s result brought to the host, read by name: per sampling request its deepest
    accepted row and the model's token after it (the bonus token), then the window rows' tokens."""

    deepest: list[int]  # [S]
    bonus: list[int]  # [S]
    windows: list[int]  # [W]

    @classmethod
    def of(cls, flat: list[int], num_requests: int) -> Verdict:
        """From `accept`'s [2 S + W] result brought to the host (`staging.Readback`; empty where
        no request sampled)."""
        s = num_requests
        return cls(flat[:s], flat[s : 2 * s], flat[2 * s :])


def accepted_path(tree: DraftTree | None, root: int, deepest: int) -> list[int]:
    """The accepted node indices, root first, from the deepest accepted kept row."""
    node = deepest - root - 1 if deepest != root else None
    path: list[int] = []
    while node is not None:
        assert tree is not None
        path.append(node)
        node = tree.parents[node]
    path.reverse()
    return path
