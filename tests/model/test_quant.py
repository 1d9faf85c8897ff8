"""Our kernels over the file's quantized blocks (Q4Linear, Q8Linear, Q8Embedding): the product
against float64 references, bit-identical rows whatever the call's rows, their place and the
thread count, and the layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchserve import kernels
from batchserve.model.quant import (
    Q4Linear,
    Q8Blocks,
    Q8Embedding,
    Q8Linear,
    group_q4_1,
    quant_products_invariant,
    random_q4_1,
)

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}")


def _quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The activations as the kernel quantizes them, computed independently in torch: per row and
    block of 32, d = max|x| / 127 and q = round(x * (127 / max|x|)) (float32, ties to even), and
    the block's quantized sum d * sum(q) -> q [T, K/32, 32], d, s [T, K/32] (float64)."""
    blocks = x.view(x.shape[0], -1, 32)
    mx = blocks.abs().amax(-1)  # [T, K/32] float32
    mul = torch.where(mx > 0, torch.tensor(127.0) / mx, torch.zeros(()))
    q = torch.round(blocks * mul[..., None])
    d = (mx / 127.0).double()
    return q.double(), d, d * q.double().sum(-1)


def _q4_reference(x: torch.Tensor, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's arithmetic in float64 from the quantized activations, the exact float64
    product of x and the dequantized weight)."""
    n, k = q.shape
    wq = torch.from_numpy(q).double().view(n, k // 32, 32)
    wd, wm = torch.from_numpy(d).double(), torch.from_numpy(m).double()
    xq, xd, xs = _quantized(x)
    dots = torch.einsum("tbi,nbi->tnb", xq, wq)  # [T, N, K/32] integer sums
    emulated = (dots * xd[:, None, :] * wd[None]).sum(-1) + xs @ wm.T
    exact = x.double() @ (wq * wd[..., None] + wm[..., None]).view(n, k).T
    return emulated, exact


@pytest.mark.parametrize(("n", "k"), [(8, 32), (40, 96), (24, 160), (136, 576)])
def test_q4_1_product_equals_the_dequantized_blocks_product(n, k):
    gen = torch.Generator().manual_seed(n * k)
    q, d, m = random_q4_1(n, k, gen)
    layer = Q4Linear(q, d, m, None, (n,))
    for rows in (1, 2, 3, 5, 17, 64):
        x = torch.randn(rows, k, generator=gen) * torch.rand(1, k, generator=gen) * 4  # uneven channels
        y = layer(x)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        emulated, exact = _q4_reference(x, q, d, m)
        # The kernel's own arithmetic up to float32 rounding of the per-block sums ...
        torch.testing.assert_close(y.double(), emulated, rtol=1e-5, atol=1e-4 * emulated.abs().max().item())
        # ... and within 8-bit activations' error of the exact product.
        assert ((y.double() - exact).norm() / exact.norm()).item() < 0.02


def test_q4_1_bias_and_merged_sizes():
    gen = torch.Generator().manual_seed(3)
    q, d, m = random_q4_1(48, 64, gen)
    bias = torch.randn(48, generator=gen)
    x = torch.randn(5, 64, generator=gen)
    layer = Q4Linear(q, d, m, bias, (32, 16))
    assert layer.sizes == (32, 16)
    assert torch.equal(layer(x), Q4Linear(q, d, m, None, (48,))(x) + bias)
    with pytest.raises(ValueError, match="N % 8"):
        Q4Linear(q[:44], d[:44], m[:44], None, (44,))


def test_q8_0_head_and_embedding_share_one_copy_and_compute_the_dequantized_product():
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-128, 128, (1003, 96), generator=gen, dtype=torch.int8).numpy()  # not whole groups of 8
    d = (torch.rand(1003, 3, generator=gen) / 64).half().float().numpy()
    blocks = Q8Blocks(q, d)
    head, embedding = Q8Linear(blocks), Q8Embedding(blocks)
    weight = torch.from_numpy(q).double().view(1003, 3, 32) * torch.from_numpy(d).double()[..., None]
    ids = torch.tensor([0, 7, 8, 1002, 500])
    assert torch.equal(embedding(ids), weight.view(1003, 96)[ids].float())  # exactly the file's values
    x = torch.randn(9, 96, generator=gen)
    y = head(x)
    xq, xd, _ = _quantized(x)
    emulated = (torch.einsum("tbi,nbi->tnb", xq, torch.from_numpy(q).double().view(1003, 3, 32)) * xd[:, None]
                * torch.from_numpy(d).double()[None]).sum(-1)  # fmt: skip
    assert y.shape == (9, 1003)
    torch.testing.assert_close(y.double(), emulated, rtol=1e-5, atol=1e-4 * emulated.abs().max().item())
    exact = x.double() @ weight.view(1003, 96).T
    assert ((y.double() - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_a_row_has_the_same_bits_whatever_the_calls_rows_its_place_and_the_thread_count(threads):
    gen = torch.Generator().manual_seed(5)
    q, d, m = random_q4_1(200, 160, gen)  # 25 column groups: full tiles and a single-group tail
    q4 = Q4Linear(q, d, m, None, (200,))
    q8 = Q8Linear(Q8Blocks(torch.randint(-128, 128, (200, 160), generator=gen, dtype=torch.int8).numpy(),
                           (torch.rand(200, 5, generator=gen) / 64).half().float().numpy()))  # fmt: skip
    x = torch.randn(70, 160, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = {layer: torch.cat([layer(x[i : i + 1]) for i in range(70)]) for layer in (q4, q8)}
        torch.set_num_threads(threads)
        for layer in (q4, q8):
            for start, rows in ((0, 70), (0, 64), (3, 5), (66, 4), (9, 1), (20, 33)):
                assert torch.equal(layer(x[start : start + rows]), alone[layer][start : start + rows])
    finally:
        torch.set_num_threads(before)
    assert quant_products_invariant()


def test_the_layout_keeps_the_files_values_scales_and_mins():
    gen = torch.Generator().manual_seed(6)
    q, d, m = random_q4_1(16, 64, gen)
    nibbles, scales, mins = group_q4_1(q, d, m)
    assert nibbles.shape == (2, 2, 4, 32) and nibbles.dtype == torch.uint8
    assert scales.dtype == torch.float16 and scales.shape == (2, 2, 8)
    # Column 8g + j, block b, value 8p + 4h + r sits in chunk p, byte 4j + r, nibble h.
    g, j, b, p, h, r = 1, 5, 1, 2, 1, 3
    byte = int(nibbles[g, b, p, 4 * j + r])
    assert (byte >> 4 if h else byte & 15) == q[8 * g + j, 32 * b + 8 * p + 4 * h + r]
    assert scales[g, b, j].item() == d[8 * g + j, b] and mins[g, b, j].item() == m[8 * g + j, b]
    with pytest.raises(ValueError, match="float16"):
        group_q4_1(q, d + 1e-7, m)  # not a float16 value: not the file's scale


def test_a_build_that_cannot_run_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHSERVE_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx", "sse4_2"})
    with pytest.raises(kernels.KernelUnavailable, match="lacks avx2, fma, f16c"):
        kernels.build()
    monkeypatch.undo()
    monkeypatch.setenv("BATCHSERVE_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with pytest.raises(kernels.KernelUnavailable, match="failed to build"):
        kernels.build()
    assert not list((tmp_path / "kernels").iterdir())  # no half-built file left behind
    monkeypatch.delenv("CXX")
    built = kernels.build()
    assert built.parent == tmp_path / "kernels" and built.stat().st_size > 0
    stamp = built.stat().st_mtime_ns
    assert kernels.build() == built and built.stat().st_mtime_ns == stamp  # built once, then reused


def test_a_column_has_the_same_bits_in_a_wide_tile_and_a_narrow_one():
    """Where AVX-512 runs, pairs of column groups take 512-bit tiles of 8 rows and a group left over
    takes the 256-bit tiles of 4: the same column gives the same bits either way (on AVX2 both
    layers take the 256-bit tiles)."""
    gen = torch.Generator().manual_seed(6)
    q, d, m = random_q4_1(16, 96, gen)
    q8 = torch.randint(-128, 128, (16, 96), generator=gen, dtype=torch.int8).numpy()
    d8 = (torch.rand(16, 3, generator=gen) / 64).half().float().numpy()
    x = torch.randn(19, 96, generator=gen)  # two 8-row tiles and a 3-row one; four 4-row tiles and a 3-row one
    pair, single = Q4Linear(q, d, m, None, (16,)), Q4Linear(q[8:], d[8:], m[8:], None, (8,))
    assert torch.equal(pair(x)[:, 8:], single(x))
    pair8, single8 = Q8Linear(Q8Blocks(q8, d8)), Q8Linear(Q8Blocks(q8[8:], d8[8:]))
    assert torch.equal(pair8(x)[:, 8:], single8(x))
