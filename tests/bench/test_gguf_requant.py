"""A model's own weights written again in another mix: blocks every reader decodes to the weights."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, dequantize
from gguf import GGMLQuantizationType as Q

from batchserve.bench.gguf_requant import quantize_rows, write_requantized
from batchserve.bench.gguf_write import default_gguf
from batchserve.model.gguf_file import GGUFTensors
from batchserve.model.gguf_read import read_gguf


@pytest.mark.parametrize(
    ("qtype", "worst", "correlation"),
    [
        (Q.Q4_K, 0.12, 0.99),
        (Q.Q5_K, 0.06, 0.99),
        (Q.Q6_K, 0.03, 0.99),
        (Q.Q5_0, 0.06, 0.99),
        (Q.IQ4_NL, 0.12, 0.99),
        (Q.IQ4_XS, 0.12, 0.99),
        (Q.Q3_K, 0.18, 0.985),  # measured 0.160, 0.988: 8 levels
        (Q.Q2_K, 0.31, 0.955),  # measured 0.285, 0.962: 4 levels
    ],
)
def test_blocks_decode_to_the_weights_within_their_precision(qtype, worst, correlation):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((24, 768)) * 0.05).astype(np.float32)  # 3 super-blocks a row
    x[3, 5] = 0.9  # an outlier: its sub-block's scale, not its neighbours'
    x[7] = 0.0  # an all-zero row: zero scales, no division by zero
    data = quantize_rows(x, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    assert data.shape == (24, 768 // block * size) and data.dtype == np.uint8
    y = np.asarray(dequantize(data, qtype)).reshape(x.shape)
    assert np.all(np.isfinite(y)) and np.all(y[7] == 0)
    assert np.abs(y - x).mean() / np.abs(x).mean() < worst
    assert np.corrcoef(x.ravel(), y.ravel())[0, 1] > correlation
    assert abs(y[3, 5] - 0.9) < 0.9 * worst


def _on_the_grid(qtype: Q, rows: int, rng: np.random.Generator) -> np.ndarray:
    """Weights [rows, 768] that Q2_K or Q3_K holds exactly, random codes and scales in every
    position, each sub-block reaching its extreme codes and each super-block its largest scales
    (what the quantizer searches for), so a block decodes to them only if every field is where
    gguf-py reads it."""
    n = rows * 3
    d = rng.integers(256, 2048, n) * 2.0**-16  # float16 values: every product is exact in float32
    if qtype == Q.Q3_K:  # w = d * sc * q, q in [-4, 3], the peak at -4
        sc = rng.integers(-31, 32, (n, 16))
        sc[sc == 0] = 1
        sc[np.arange(n), rng.integers(0, 16, n)] = -32
        q = rng.integers(-3, 4, (n, 16, 16))
        q[:, :, 0] = -4
        w = d[:, None, None] * sc[..., None] * q
    else:  # Q2_K: w = d * sc * q - dmin * mn, q in [0, 3]
        dmin = rng.integers(256, 2048, n) * 2.0**-16
        sc, mn = rng.integers(1, 16, (n, 16)), rng.integers(0, 16, (n, 16))
        sc[np.arange(n), rng.integers(0, 16, n)] = 15
        mn[np.arange(n), rng.integers(0, 16, n)] = 15
        q = rng.integers(0, 4, (n, 16, 16))
        q[:, :, 0], q[:, :, 1] = 0, 3
        w = d[:, None, None] * sc[..., None] * q - (dmin[:, None] * mn)[..., None]
    # The extremes in random positions of each sub-block.
    w = np.take_along_axis(w, rng.permuted(np.tile(np.arange(16), (n, 16, 1)), axis=2), axis=2)
    return w.astype(np.float32).reshape(rows, 768)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K])
def test_low_bit_k_blocks_are_in_the_layout_gguf_py_reads(qtype):
    x = _on_the_grid(qtype, 8, np.random.default_rng(1))
    y = np.asarray(dequantize(quantize_rows(x, qtype), qtype)).reshape(x.shape)
    assert np.array_equal(y, x)  # every code, scale and min read back from its own bits


def test_smollm2_in_a_mix_has_the_mix_types_its_overrides_and_its_metadata(tmp_path):
    # As llama-quantize's --tensor-type: on blk.1's ffn_down (1536-wide rows), not on a 576-wide row.
    overrides = {r"blk\.1\.ffn_down": Q.Q2_K, r"blk\.2\.ffn_down": Q.Q3_K, r"attn_q": Q.Q2_K}
    out = write_requantized(default_gguf(), tmp_path / "q4km.gguf", "Q4_K_M", overrides)
    written = GGUFTensors(out)
    types = {t.name: Q(t.qtype) for t in written.tensors.values()}
    assert types["blk.0.attn_q.weight"] == Q.Q5_0 and types["token_embd.weight"] == Q.Q8_0  # 576-wide fallbacks
    assert types["blk.0.ffn_down.weight"] == Q.Q6_K and types["blk.3.ffn_down.weight"] == Q.Q4_K  # use_more_bits
    assert types["blk.1.ffn_down.weight"] == Q.Q2_K and types["blk.2.ffn_down.weight"] == Q.Q3_K
    assert read_gguf(out).metadata["tokenizer.ggml.model"].value == "gpt2"
    source = GGUFTensors(default_gguf())
    for name, least in [(f"blk.{i}.ffn_down.weight", 0.98) for i in (0, 2, 3)] + [
        ("blk.5.attn_v.weight", 0.98),
        ("blk.1.ffn_down.weight", 0.94),  # Q2_K: 4 levels
    ]:
        a = np.asarray(dequantize(source[name].data, Q(source[name].qtype)), np.float32)
        b = np.asarray(dequantize(written[name].data, Q(written[name].qtype)), np.float32)
        assert a.shape == b.shape == source[name].shape and np.corrcoef(a.ravel(), b.ravel())[0, 1] > least, name
