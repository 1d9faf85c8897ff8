"""A model's own weights written again in another mix: blocks every reader decodes to the weights."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, dequantize

from batchserve.bench.gguf_requant import quantize_rows, write_requantized
from batchserve.bench.gguf_write import default_gguf


@pytest.mark.parametrize(
    ("qtype", "worst"),
    [(Q.Q4_K, 0.12), (Q.Q5_K, 0.06), (Q.Q6_K, 0.03), (Q.Q5_0, 0.06), (Q.IQ4_NL, 0.12), (Q.IQ4_XS, 0.12)],
)
def test_blocks_decode_to_the_weights_within_their_precision(qtype, worst):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((24, 768)) * 0.05).astype(np.float32)
    x[3, 5] = 0.9  # an outlier: its sub-block's scale, not its neighbours'
    x[7] = 0.0  # an all-zero row: zero scales, no division by zero
    y = np.asarray(dequantize(quantize_rows(x, qtype), qtype)).reshape(x.shape)
    assert np.all(np.isfinite(y)) and np.all(y[7] == 0)
    assert np.abs(y - x).mean() / np.abs(x).mean() < worst
    assert np.corrcoef(x.ravel(), y.ravel())[0, 1] > 0.99
    assert abs(y[3, 5] - 0.9) < 0.9 * worst


def test_smollm2_in_a_mix_has_the_mix_types_and_its_metadata(tmp_path):
    out = write_requantized(default_gguf(), tmp_path / "q4km.gguf", "Q4_K_M")
    reader = GGUFReader(out)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == Q.Q5_0 and types["token_embd.weight"] == Q.Q8_0  # 576-wide fallbacks
    assert types["blk.0.ffn_down.weight"] == Q.Q6_K and types["blk.3.ffn_down.weight"] == Q.Q4_K  # use_more_bits
    assert str(reader.fields["tokenizer.ggml.model"].contents()) == "gpt2"
    source = {t.name: t for t in GGUFReader(default_gguf()).tensors}
    for name in ("blk.0.ffn_down.weight", "blk.3.ffn_down.weight", "blk.5.attn_v.weight"):
        t = next(t for t in reader.tensors if t.name == name)
        a = np.asarray(dequantize(source[name].data, source[name].tensor_type), np.float32)
        b = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.98, name
