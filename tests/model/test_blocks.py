"""Our kernels over GGUF blocks of every native type (BlockLinear): the product against float64
products of gguf-py's dequantized weights within the activations' quantization error, mixed-part
products, bit-identical rows whatever the call's rows, their place and the thread count, Q4_1's
and Q8_0's bits against an exact emulation of their float32 arithmetic, and a tensor read from a
GGUF file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter, quants
from gguf import GGMLQuantizationType as T

from batchserve import kernels, native_build
from batchserve.model.blocks import (
    MIN_FIELD,
    NATIVE_TYPES,
    BlockLinear,
    BlockPart,
    block_products_invariant,
    random_blocks,
)

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}")

TYPES = sorted(NATIVE_TYPES)
SMALL = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)  # 32-value blocks; gguf-py quantizes these
MIN_FIELDS = MIN_FIELD  # byte offset of m / dmin in a block


def _cols(qtype: int) -> int:
    return 32 * 7 if qtype in SMALL else 256 * 3


def _dequantized(raw: np.ndarray, qtype: int) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw, T(qtype))).double()  # [rows, cols]


def _scaled_part(raw: np.ndarray, qtype: int) -> torch.Tensor:
    """The part of each weight the kernel multiplies by the quantized activations: the weight
    without its block's min (m, dmin * mn), which multiplies the float sum of x instead."""
    if qtype not in MIN_FIELDS:
        return _dequantized(raw, qtype)
    size = GGML_QUANT_SIZES[T(qtype)][1]
    blocks = raw.copy().reshape(raw.shape[0], -1, size)
    blocks[:, :, MIN_FIELDS[qtype] : MIN_FIELDS[qtype] + 2] = 0
    return _dequantized(blocks.reshape(raw.shape), qtype)


def _bound(x: torch.Tensor, raw: np.ndarray, qtype: int) -> torch.Tensor:
    """|y - x @ W.T| allowed [T, N]: each activation is off by at most d_x / 2 (d_x = max|x| / 127
    of its block of 32), so by sum over blocks of d_x / 2 * sum |scaled weight|; 1% on top of it and
    a float32 rounding term for the sums."""
    xb = x.double().view(x.shape[0], -1, 32)  # [T, K/32, 32]
    dx = xb.abs().amax(-1) / 127  # [T, K/32]
    # Every weight multiplies quantized activations, its min included (d_x * sum(q_x), as llama.cpp).
    a = _dequantized(raw, qtype).abs().view(raw.shape[0], -1, 32).sum(-1)  # [N, K/32]
    rounding = 1e-5 * (x.double().abs() @ _dequantized(raw, qtype).abs().T) + 1e-6
    return 1.01 * (dx / 2) @ a.T + rounding


def _emulated(x: torch.Tensor, raw: np.ndarray, qtype: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's arithmetic in float64, its float32 rounding allowance) [T, N]: the activations
    quantized as the kernel does (per row and block of 32, d = max|x| / 127, q = round(x * 127 /
    max|x|) in float32, ties to even) times the scaled weights, plus the mins times the quantized
    activations' sums (d_x * sum(q_x), as llama.cpp's Q8_1 and Q8_K carry them).
    Tight enough that one value decoded a step off fails it, where the bound above may not."""
    blocks = x.view(x.shape[0], -1, 32)
    mx = blocks.abs().amax(-1, keepdim=True)  # [T, K/32, 1] float32
    q = torch.round(blocks * torch.where(mx > 0, torch.tensor(127.0) / mx, torch.zeros(())))
    xq = (q.double() * (mx / 127.0).double()).view(x.shape)  # [T, K]
    a = _scaled_part(raw, qtype)  # [N, K]
    mins = _dequantized(raw, qtype) - a  # [N, K]: the min of each block of 32 (or 16), repeated
    emulated = xq @ a.T + xq @ mins.T
    return emulated, 1e-5 * (xq.abs() @ a.abs().T + xq.abs() @ mins.abs().T) + 1e-7


def _check(layer: BlockLinear, parts: list[tuple[np.ndarray, int]], x: torch.Tensor) -> None:
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], sum(raw.shape[0] for raw, _ in parts))
    col = 0
    for raw, qtype in parts:
        want = x.double() @ _dequantized(raw, qtype).T
        got = y[:, col : col + raw.shape[0]].double()
        excess = (got - want).abs() - _bound(x, raw, qtype)
        assert excess.max().item() <= 0, f"{T(qtype).name}: off by {excess.max().item()} beyond the bound"
        emulated, allowance = _emulated(x, raw, qtype)
        excess = (got - emulated).abs() - allowance
        assert excess.max().item() <= 0, f"{T(qtype).name}: off the emulation by {excess.max().item()}"
        col += raw.shape[0]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: T(q).name)
def test_each_type_is_the_dequantized_product_within_the_activations_error(qtype):
    gen = torch.Generator().manual_seed(qtype)
    k = _cols(qtype)
    raw = random_blocks(qtype, 37, k, gen)  # 37 rows: two pairs of groups (a tile reads 0 with 2) and a padded one
    layer = BlockLinear([BlockPart(raw, qtype, k)])
    for rows in (1, 3, 17):
        x = torch.randn(rows, k, generator=gen) * torch.rand(1, k, generator=gen) * 4  # uneven channels
        _check(layer, [(raw, qtype)], x)


@pytest.mark.parametrize("qtype", SMALL, ids=lambda q: T(q).name)
def test_blocks_gguf_py_quantizes_run_too(qtype):
    gen = torch.Generator().manual_seed(10 + qtype)
    w = (torch.randn(21, 32 * 9, generator=gen) * 0.05).numpy()
    raw = quants.quantize(w, T(qtype))  # [21, row bytes], as llama.cpp's reference quantizer writes
    layer = BlockLinear([BlockPart(raw, qtype, w.shape[1])])
    _check(layer, [(raw, qtype)], torch.randn(5, w.shape[1], generator=gen))


def test_a_mixed_product_is_its_parts_side_by_side_bit_for_bit():
    gen = torch.Generator().manual_seed(7)
    k = 512
    kinds = ((T.Q4_K, 24), (T.Q6_K, 5), (T.Q5_0, 19), (T.Q8_0, 8), (T.Q5_K, 3), (T.Q4_1, 1), (T.Q4_0, 9), (T.Q5_1, 17))
    parts = [BlockPart(random_blocks(q, rows, k, gen), q, k) for q, rows in kinds]
    bias = torch.randn(sum(rows for _, rows in kinds), generator=gen)
    mixed = BlockLinear(parts, bias, sizes=(40, 46))
    assert mixed.sizes == (40, 46) and mixed.out_features == 86 and mixed.in_features == k
    assert BlockLinear(parts).sizes == tuple(rows for _, rows in kinds)
    x = torch.randn(11, k, generator=gen)
    alone = torch.cat([BlockLinear([part])(x) for part in parts], dim=1)
    assert torch.equal(mixed(x), alone + bias)
    _check(BlockLinear(parts), [(p.raw, p.qtype) for p in parts], x)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_row_has_the_same_bits_whatever_the_calls_rows_its_place_and_the_thread_count(threads):
    gen = torch.Generator().manual_seed(8)
    k = 768
    layers = [BlockLinear([BlockPart(random_blocks(q, 43, k, gen), q, k)]) for q in TYPES]  # 5 groups + 3 rows
    x = torch.randn(70, k, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [torch.cat([layer(x[i : i + 1]) for i in range(70)]) for layer in layers]
        torch.set_num_threads(threads)
        for layer, want in zip(layers, alone, strict=True):
            for start, rows in ((0, 70), (0, 64), (3, 5), (66, 4), (9, 1), (20, 33), (1, 17)):
                assert torch.equal(layer(x[start : start + rows]), want[start : start + rows]), layer
    finally:
        torch.set_num_threads(before)
    assert block_products_invariant()


def test_the_avx2_path_gives_every_type_the_bits_of_this_cpus_path(monkeypatch):
    """Built without AVX-512 (so without VNNI: vpmaddubsw, and Q8_0's and the IQ4 tables' values
    signed), every type's product has the same bits: every integer sum is exact either way."""
    if "avx512f" not in kernels.cpu_flags():
        pytest.skip("this CPU runs the AVX2 path already")
    flags, cpu = (*kernels.FLAGS, "-mno-avx512f"), " ".join(sorted(kernels.cpu_flags())).encode()
    lib = native_build.build("our kernels (avx2)", "kernels", "batchserve_cpu_avx2", kernels.SOURCES,
                             kernels.HEADERS, flags, cpu)  # fmt: skip
    gen = torch.Generator().manual_seed(9)
    k = 768
    layers = [BlockLinear([BlockPart(random_blocks(q, 43, k, gen), q, k)]) for q in TYPES]
    x = torch.randn(13, k, generator=gen) * 3
    here = [layer(x) for layer in layers]
    monkeypatch.setattr(kernels, "_load", lambda: native_build.load(kernels.MODULE, lib))
    assert not kernels.block_wide()
    for layer, want in zip(layers, here, strict=True):
        layer._desc_base = -1
        assert torch.equal(layer(x), want), layer


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fma(a, b, c), rounded once, as the kernels' FMA instructions do: a * b is exact in
    float64 and TwoSum gives the float64 sum's error, which decides the one case where rounding
    the float64 sum to float32 rounds twice (the sum lands exactly halfway between two floats)."""
    p, c64 = a.double() * b.double(), c.double()
    s = p + c64
    bp = s - p
    err = (p - (s - bp)) + (c64 - bp)  # s + err == p + c exactly
    f = s.float()
    other = torch.nextafter(f, torch.where(f.double() > s, -torch.inf, torch.inf).float())  # the float past s
    halfway = (f.double() + other.double()) / 2 == s
    exact_beyond = (err != 0) & ((err > 0) == (other.double() > f.double()))  # p + c lies on other's side of s
    return torch.where(halfway & exact_beyond, other, f)


def _exact(x: torch.Tensor, raw: np.ndarray, qtype: int) -> torch.Tensor:
    """A Q4_1 or Q8_0 product bit for bit, as block_gemm.cpp's header states its float32
    arithmetic: per row and block of 32, d_x = max|x| / 127, q_x = round(x * (127 / max|x|)) (ties
    to even), s_x = d_x * sum(q_x); per column, block by block in order, acc = fma(isum, d_w * d_x,
    acc) with isum the exact integer dot product of the stored values and q_x, then for Q4_1
    acc = fma(m_w, s_x, acc)."""
    rows, k = x.shape
    size = GGML_QUANT_SIZES[T(qtype)][1]
    blocks = raw.reshape(raw.shape[0], k // 32, size)
    d_w = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32))  # [N, K/32]
    if qtype == T.Q4_1:
        m_w = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        nibbles = blocks[:, :, 4:]  # value j in the low nibble of byte j, value j + 16 in its high one
        q_w = torch.from_numpy(np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.int64))
    else:
        q_w = torch.from_numpy(blocks[:, :, 2:].copy().view(np.int8).astype(np.int64))  # [N, K/32, 32]
    xb = x.view(rows, k // 32, 32)
    mx = xb.abs().amax(-1)  # [T, K/32] float32
    d_x = mx / 127.0
    q_x = torch.round(xb * torch.where(mx > 0, 127.0 / mx, torch.zeros(()))[..., None]).long()
    s_x = d_x * q_x.sum(-1).float()
    acc = torch.zeros(rows, raw.shape[0])
    for b in range(k // 32):
        isum = (q_x[:, b] @ q_w[:, b].T).float()  # [T, N], exact: |isum| < 2^24
        acc = _fma32(isum, d_w[None, :, b] * d_x[:, b, None], acc)
        if qtype == T.Q4_1:
            acc = _fma32(m_w[None, :, b].expand_as(acc), s_x[:, b, None].expand_as(acc), acc)
    return acc


def test_the_emulated_fma_rounds_once():
    one = torch.tensor([1.0])
    # (2^-24 + 2^-47)(1 - 2^-23) + (1 + 2^-23) = 1 + 3 * 2^-24 - 2^-70: just below halfway between
    # 1 + 2^-23 and 1 + 2^-22. Rounded to float64 first it lands on the midpoint and goes to even.
    a, b, c = torch.tensor([2.0**-24 + 2.0**-47]), torch.tensor([1 - 2.0**-23]), torch.tensor([1 + 2.0**-23])
    assert (a.double() * b.double() + c.double()).float().item() == 1 + 2.0**-22  # rounded twice
    assert _fma32(a, b, c).item() == 1 + 2.0**-23
    assert _fma32(-a, b, -c).item() == -(1 + 2.0**-23)
    assert _fma32(torch.tensor([2.0**-24]), one, one).item() == 1.0  # exactly halfway: to even
    assert _fma32(torch.tensor([3.0]), torch.tensor([5.0]), torch.tensor([-2.0])).item() == 13.0


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0], ids=lambda q: T(q).name)
def test_q4_1_and_q8_0_give_the_bits_of_their_stated_arithmetic(qtype):
    """The GGUF types the default model stores, against an exact emulation of the kernels' float32
    arithmetic: every output bit, for tiles of every size (8, 4, 2 and 1 rows) and a part beside
    another type in one call."""
    gen = torch.Generator().manual_seed(9)
    k, n = 160, 40
    raw = random_blocks(qtype, n, k, gen)
    layer = BlockLinear([BlockPart(raw, qtype, k)])
    mixed = BlockLinear([BlockPart(random_blocks(T.Q5_0, 8, k, gen), T.Q5_0, k), BlockPart(raw, qtype, k)])
    for rows in (1, 3, 8, 19):
        x = torch.randn(rows, k, generator=gen) * torch.rand(1, k, generator=gen) * 4  # uneven channels
        x[0, :32] = 0  # a block of zeros: d_x = 0
        want = _exact(x, raw, qtype)
        assert torch.equal(layer(x), want)
        assert torch.equal(mixed(x)[:, 8:], want)


def test_the_packed_weights_stay_within_three_percent_of_the_files_bytes():
    """MXFP4 within 6%: its one-byte exponent is a two-byte float16 scale in the kernel's records
    (18 bytes a block of 32 against the file's 17)."""
    gen = torch.Generator().manual_seed(11)
    for qtype in TYPES:
        raw = random_blocks(qtype, 64, 512, gen)
        layer = BlockLinear([BlockPart(raw, qtype, 512)])
        assert layer.packed.dtype == torch.uint8 and [b for b in layer.buffers()] == [layer.packed]
        bound = 18 / 17 if qtype == T.MXFP4 else 1.03
        assert raw.nbytes <= layer.packed.numel() <= bound * raw.nbytes, T(qtype).name


def test_a_tensor_read_from_a_gguf_file(tmp_path):
    """GGUFReader's `tensor.data` (a read-only memmap [rows, row bytes]) is what the loader passes."""
    gen = torch.Generator().manual_seed(12)
    raw = random_blocks(T.Q5_K, 10, 512, gen)
    path = tmp_path / "t.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("w", raw, raw_dtype=T.Q5_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = GGUFReader(str(path)).tensors[0]
    assert not tensor.data.flags.writeable and tensor.tensor_type == T.Q5_K
    layer = BlockLinear([BlockPart(tensor.data, int(tensor.tensor_type), int(tensor.shape[0]))])
    x = torch.randn(3, 512, generator=gen)
    assert torch.equal(layer(x), BlockLinear([BlockPart(raw, T.Q5_K, 512)])(x))


def test_parts_our_kernels_do_not_take_are_refused():
    gen = torch.Generator().manual_seed(13)
    raw = random_blocks(T.Q4_K, 8, 256, gen)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        BlockLinear([BlockPart(np.zeros((8, 66), np.uint8), T.IQ2_XXS, 256)])
    with pytest.raises(ValueError, match="whole blocks of 256"):
        BlockLinear([BlockPart(raw, T.Q4_K, 224)])
    with pytest.raises(ValueError, match=r"uint8 \[rows >= 1, 288\]"):
        BlockLinear([BlockPart(raw, T.Q4_K, 512)])
    with pytest.raises(ValueError, match="in_features differ"):
        BlockLinear([BlockPart(raw, T.Q4_K, 256), BlockPart(random_blocks(T.Q8_0, 8, 512, gen), T.Q8_0, 512)])
    with pytest.raises(ValueError, match="add up"):
        BlockLinear([BlockPart(raw, T.Q4_K, 256)], sizes=(4, 5))


def test_a_product_of_huge_pages_is_the_dequantized_product():
    from batchserve.model.blocks import HUGE_PAGE

    gen = torch.Generator().manual_seed(3)
    raw = random_blocks(T.Q8_0, 2056, 1024, gen)  # 2.2 MB packed: anonymous memory asked for in huge pages
    layer = BlockLinear([BlockPart(raw, T.Q8_0, 1024)])
    assert layer.packed.numel() >= HUGE_PAGE and layer.packed.data_ptr() % 4096 == 0
    _check(layer, [(raw, T.Q8_0)], torch.randn(3, 1024, generator=gen))
