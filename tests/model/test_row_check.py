"""The row-by-row invariance check catches a product that tiles rows (as oneDNN's bfloat16 on
AMX does), which a check of one row per call passed; and every verdict it gives holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchserve.model.layers import ROW_BUCKETS, Bf16Linear, PackedLinear, packed_products_variance
from batchserve.model.row_check import rows_variance


class TiledProduct:
    """x @ w, except that in a call of more than 16 rows the rows from 3 on are summed in another
    order (rounded once more): the first row of every call agrees with a call of one row."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.stack([row @ self.w for row in x])  # one product a row: row-wise
        if x.shape[0] > 16:
            out[3:] = out[3:] * (1 + 2**-20)  # [T - 3, out] another tile's rounding
        return out


def _first_row_only(product, x: torch.Tensor, counts) -> bool:
    """The check as it was: row 0 of each call against a call of one row."""
    ref = product(x[:1])
    return all(torch.equal(product(x[:n])[:1], ref) for n in counts)


def test_a_product_that_tiles_rows_fails_the_check_and_says_where():
    gen = torch.Generator().manual_seed(0)
    product = TiledProduct(torch.randn(64, 32, generator=gen))
    x = torch.randn(40, 64, generator=gen)
    counts = (1, 2, 4, 16, 17, 40)
    assert _first_row_only(product, x, counts)  # the old check passed it
    where = rows_variance(product, x, counts)
    assert where == "a call of 1 rows at offset 19: rows 0 differ from a call of 40"  # row 19 alone vs in 40


def test_a_row_wise_product_passes_at_every_count_and_offset():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 32, generator=gen)
    x = torch.randn(50, 64, generator=gen)
    assert rows_variance(lambda t: torch.stack([r @ w for r in t]), x, range(1, 51)) is None
    with pytest.raises(ValueError, match="outside"):
        rows_variance(lambda t: t, x, (51,))


def test_a_packed_product_layer_that_depends_on_its_row_count_is_refused():
    class RowCountDependent(PackedLinear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            if x.shape[0] > 16:  # another kernel for larger calls: rows past the first differ
                out[1:] = out[1:] * (1 + 2**-20)
            return out

    from batchserve.model.layers import prepack_available

    if not prepack_available():
        pytest.skip("this torch cannot prepack oneDNN weights")
    where = packed_products_variance(RowCountDependent)
    assert where is not None and "differ" in where


@pytest.mark.parametrize("layer_class", [PackedLinear, Bf16Linear])
def test_a_verdict_of_invariant_holds_for_every_row(layer_class):
    # A third-party kernel is asserted only through the check's verdict: where it says invariant,
    # every row of a real-width product has its bits in calls of every bucket at any offset; where
    # it says not, the engine does not use the kernel (tests/model/test_layers.py, test_cpu_weights.py).
    from batchserve.model.layers import bf16_prepack_available, prepack_available

    if not prepack_available() or (layer_class is Bf16Linear and not bf16_prepack_available()):
        pytest.skip("this torch or CPU cannot prepack these weights")
    if packed_products_variance(layer_class) is not None:
        pytest.skip(f"{layer_class.__name__} is not invariant here: {packed_products_variance(layer_class)}")
    gen = torch.Generator().manual_seed(3)
    layer = layer_class(nn.Linear(576, 1536, bias=False))
    x = torch.randn(160, 576, generator=gen)
    counts = [n for n in ROW_BUCKETS if n <= 160] + [5, 17, 33, 100]
    assert rows_variance(layer, x, counts) is None
