"""Judge a GPU row against its engine's own `none`: where outputs differ, how near a tie, the verdict."""

from __future__ import annotations

from typing import Any, NamedTuple

from batchserve.bench.methods import Row, load_point, method_rank

# A near-tie's bound, in ulps of the top logit (`near_tie_bound`).
NEAR_TIE_ULPS = 4


def near_tie_bound(top1: float, eps: float) -> float:
    """The largest top-1 minus top-2 logit margin that kernels differing only in how they round can
    flip: NEAR_TIE_ULPS x eps x max(|top1|, 1), eps the model dtype's (bfloat16: 2^-7).

    bfloat16 keeps 8 significant bits (unit roundoff u = 2^-8): the spacing of values near z (one
    ulp) lies between 2^-8 |z| and 2^-7 |z| = eps |z|. A logit is a dot product of the final hidden
    state with a row of the LM head over hidden_size terms, which a GEMM accumulates in an order its
    tiling and split-K set (both move with the batch's row count) and rounds to bfloat16: two such
    kernels can land the same logit on neighbouring values, an ulp on each of top-1 and top-2, two
    on their difference. The hidden state was itself rounded to bfloat16 by every layer, by GEMMs
    and attention whose order also moves with the row count, so it arrives a few ulps apart, and
    moves each logit by about as many ulps of its size: two more. 4 ulps is 1/32 of |top1|, 0.6 at
    a logit of 20. The floor of 1: a dot product's rounding error scales with its terms, not its
    sum, so a logit near 0 (by cancellation) is no more exact than one of size 1. A wrong mask or
    KV page moves logits by whole units and breaks outputs at margins far beyond this, mostly
    early; a flip within it is a choice greedy decoding could make either way under rounding."""
    return NEAR_TIE_ULPS * eps * max(abs(top1), 1.0)


class Divergence(NamedTuple):
    """Where one prompt's output first differs from its reference, and how near a tie the
    reference model's choice there was."""

    prompt: int  # the prompt's index in the run
    position: int  # the first output position where the two differ
    top1: float  # the model's best logit there
    margin: float  # its top-1 minus top-2 logit there
    bound: float  # `near_tie_bound` at top1

    @property
    def near_tie(self) -> bool:
        return self.margin <= self.bound


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (the shorter's length where it is the longer's
    prefix); None where they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def divergences(
    model: Any, prompts: list[list[int]], outputs: list[list[int]], reference: list[list[int]]
) -> list[Divergence]:
    """Each prompt whose output differs from its reference: where, and the margin there, from one
    forward of `model` (its dtype, its device) over the prompt and the reference's output before
    that position. `model` is HF's forward on the engine's weights and dtype: not the engine's
    kernels, another rounding of the same numbers, so it measures the margin to within a few ulps."""
    import torch

    eps = torch.finfo(model.dtype).eps
    found = []
    for i, (prompt, out, ref) in enumerate(zip(prompts, outputs, reference)):
        pos = first_difference(out, ref)
        if pos is None:
            continue
        ids = torch.tensor([prompt + ref[:pos]], device=model.device)
        with torch.no_grad():
            logits = model(ids).logits[0, -1].float()  # [vocab], as the model rounded them
        top1, top2 = torch.topk(logits, 2).values.tolist()
        found.append(Divergence(i, pos, top1, top1 - top2, near_tie_bound(top1, eps)))
    return found


def judge(row: Row, found: list[Divergence]) -> None:
    """A row's verdict from its differing prompts (`divergences`): none, lossless; every one a
    near-tie, `near_ties` (how many) and lossless None, neither proven nor broken; any beyond its
    bound, lossless False (a bug). The details go with the row."""
    row.divergences = [d._asdict() for d in found] or None
    row.near_ties = len(found) if found and all(d.near_tie for d in found) else None
    row.lossless = None if row.near_ties else not found


def _divergences(r: Row) -> list[Divergence]:
    return [Divergence(**d) for d in r.divergences or []]  # type: ignore[arg-type]


def _worst(r: Row) -> Divergence | None:
    """The differing prompt furthest from a tie: the largest margin for its bound."""
    return max(_divergences(r), key=lambda d: d.margin / d.bound, default=None)


def _at(d: Divergence) -> str:
    return f"prompt {d.prompt} at token {d.position}: margin {d.margin:.3g}, bound {d.bound:.3g}"


def lossless_cell(r: Row) -> str:
    """yes; near-ties (how many prompts); **NO** with the worst prompt where it was measured; -."""
    if r.near_ties:
        return f"near-ties ({r.near_ties})"
    if r.lossless is None:
        return "-"
    if r.lossless:
        return "yes"
    worst = _worst(r)
    return "**NO**" if worst is None else f"**NO** ({_at(worst)})"


def divergence_lines(rows: list[Row]) -> list[str]:
    """Each row's prompts that differ from the same engine's `none` (GPU rows), and why they do or do
    not count as rounding."""
    judged = [r for r in rows if r.divergences]
    if not judged:
        return []
    lines = [
        "\nOutputs that differ from the same engine's `none` (on a GPU its kernels round otherwise at other row "
        "counts): per prompt, the first differing token and `none`'s top-1 minus top-2 logit there (HF's forward "
        f"on the same weights and dtype). A margin within {NEAR_TIE_ULPS} ulps of the top logit (bound = "
        f"{NEAR_TIE_ULPS} x eps x max(|top1|, 1), bf16 eps = 2^-7) is a near-tie that rounding can flip; one "
        "beyond it is a bug.\n"
    ]
    for r in sorted(judged, key=lambda r: (r.batch_size, r.request_rate or 0.0, method_rank(r.method))):
        parts = "; ".join(_at(d) + ("" if d.near_tie else " **beyond**") for d in _divergences(r))
        lines.append(f"- {r.method} {load_point(r)}: {parts}")
    return lines
