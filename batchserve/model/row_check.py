"""Batch invariance of a product, checked row by row: every row of every call the engine makes.

A kernel is batch-invariant when a row's result has the same bits whatever rows share its call:
how many (the engine calls products with its row buckets, and prompt chunks of any size up to
the token budget) and where in the call the row sits. Comparing one row of each call (as this
module's callers once did) misses kernels that tile rows: oneDNN's bfloat16 product on AMX gave
rows 3-19 of a 17-row call other bits than the same rows in a 40-row call, while row 0 agreed.
So every row of every call is compared with the same row in one call over all of them, at the
first and last offsets (a row's place in the call) and one between.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

Product = Callable[[torch.Tensor], torch.Tensor]


def rows_variance(product: Product, x: torch.Tensor, row_counts: Iterable[int]) -> str | None:
    """Where `product` ([T, in] -> [T, out]) gives a row other bits in a call of another row count
    or at another place than in one call over all of `x` ([M, in]): None where it never does,
    else the first such call and its differing rows (for the log)."""
    with torch.no_grad():
        whole = product(x)  # [M, out]
        m = x.shape[0]
        for n in sorted(set(row_counts)):
            if not 0 < n <= m:
                raise ValueError(f"row count {n} outside 1..{m}")
            for start in sorted({0, (m - n) // 2, m - n}):
                part = product(x[start : start + n])  # [n, out]
                same = (part == whole[start : start + n]).all(dim=-1)  # [n]
                if not bool(same.all()):
                    bad = (~same).nonzero().flatten().tolist()
                    return f"a call of {n} rows at offset {start}: rows {_span(bad)} differ from a call of {m}"
    return None


def _span(rows: list[int]) -> str:
    return f"{rows[0]}-{rows[-1]} ({len(rows)} of them)" if len(rows) > 1 else str(rows[0])
