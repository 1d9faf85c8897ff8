"""`bench --write-gguf`: random-block GGUF files of a shape in a llama.cpp mix. Types per tensor
against `shared/notes/gguf-blocks.md` section 3, metadata read back, transformers reading the config
and tokenizer, finite dequantized weights of the shape's scale, a finite forward, seeded bytes.
Tiny shapes only (the real ones: their planned sizes)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from batchserve.bench import shapes
from batchserve.bench.gguf_write import (
    QUANTS,
    default_gguf,
    plan,
    planned_bytes,
    read_gguf,
    tensor_types,
    type_counts,
    use_more_bits,
    write_gguf,
)
from batchserve.bench.shapes import ModelShape
from batchserve.cli import main

SMOL_VOCAB = 49152
# 256 wide (every row a K-quant row), 8 layers (more bits on 0, 3, 6, 7), untied, a padded vocabulary.
LLAMA = ModelShape("gguf-llama", 256, 8, 4, 2, 64, 512, SMOL_VOCAB + 64, init_std=0.02)
# 96 wide: every K-quant falls back; tied and with q/k/v biases.
QWEN = ModelShape("gguf-qwen", 96, 2, 3, 1, 32, 256, SMOL_VOCAB, arch="qwen2", tied_embeddings=True, qkv_bias=True)
# SmolLM2-135M's sizes: the notes' worked example of the 576-wide fallbacks.
SMOL = ModelShape("smollm2-135m", 576, 30, 9, 3, 64, 1536, SMOL_VOCAB, rope_theta=1e5, tied_embeddings=True)
PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def test_use_more_bits_is_the_notes_layers() -> None:
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(30) if use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]


# mix -> (the default type, output.weight's, attn_v/ffn_down's on the more-bits layers), 256-wide rows.
MIX_TABLE = {
    "Q4_K_M": (Q.Q4_K, Q.Q6_K, Q.Q6_K),
    "Q5_K_M": (Q.Q5_K, Q.Q6_K, Q.Q6_K),
    "Q6_K": (Q.Q6_K, Q.Q6_K, Q.Q6_K),
    "Q8_0": (Q.Q8_0, Q.Q8_0, Q.Q8_0),
    "Q4_0": (Q.Q4_0, Q.Q6_K, Q.Q4_0),
    "Q4_1": (Q.Q4_1, Q.Q6_K, Q.Q4_1),
    "Q5_0": (Q.Q5_0, Q.Q6_K, Q.Q5_0),
    "Q5_1": (Q.Q5_1, Q.Q6_K, Q.Q5_1),
    "Q4_K": (Q.Q4_K, Q.Q4_K, Q.Q4_K),  # pure
    "Q5_K": (Q.Q5_K, Q.Q5_K, Q.Q5_K),
    "F16": (Q.F16, Q.F16, Q.F16),
    "BF16": (Q.BF16, Q.BF16, Q.BF16),
    "F32": (Q.F32, Q.F32, Q.F32),
    "MXFP4_MOE": (Q.Q8_0, Q.Q8_0, Q.Q8_0),  # a dense model has no experts to write in MXFP4 (test_moe)
}


LOW_BIT = ("Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL")  # their own bumps (attn_v, ffn_down, attn_output)


def test_every_mix_is_tested() -> None:
    assert set(QUANTS) == set(MIX_TABLE) | set(LOW_BIT)


@pytest.mark.parametrize("quant", list(MIX_TABLE))
def test_each_mix_types_each_tensor_as_llama_quantize(quant: str) -> None:
    default, output, bumped = MIX_TABLE[quant]
    types = tensor_types(LLAMA, quant)
    expected = {"token_embd.weight": default, "output_norm.weight": Q.F32, "output.weight": output}
    for i in range(LLAMA.num_hidden_layers):
        more = i in (0, 3, 6, 7)
        expected |= {f"blk.{i}.{p}.weight": bumped if more and p in ("attn_v", "ffn_down") else default for p in PROJ}
        expected |= {f"blk.{i}.attn_norm.weight": Q.F32, f"blk.{i}.ffn_norm.weight": Q.F32}
    assert types == expected
    assert list(types)[:2] == ["token_embd.weight", "blk.0.attn_norm.weight"]
    assert list(types)[-2:] == ["output_norm.weight", "output.weight"]


def test_the_low_bit_mixes_bump_as_llama_quantize() -> None:
    """llama-quantize's rules (src/llama-quant.cpp) on the 8-layer shape (2 query heads a KV head)."""
    for quant, v, down, out_proj in (
        ("Q2_K", [Q.Q3_K] * 8, [Q.Q3_K] * 8, Q.Q3_K),
        ("Q3_K_M", [Q.Q5_K] * 2 + [Q.Q4_K] * 6, [Q.Q4_K] * 8, Q.Q4_K),  # no layer below 8 / 16
        ("IQ4_XS", [Q.IQ4_XS] * 8, [Q.Q5_K] + [Q.IQ4_XS] * 7, Q.IQ4_XS),  # the first eighth's ffn_down
    ):
        types = tensor_types(LLAMA, quant)
        assert [types[f"blk.{i}.attn_v.weight"] for i in range(8)] == v, quant
        assert [types[f"blk.{i}.ffn_down.weight"] for i in range(8)] == down, quant
        assert {types[f"blk.{i}.attn_output.weight"] for i in range(8)} == {out_proj}, quant
        assert types["output.weight"] == Q.Q6_K and types["blk.5.attn_q.weight"] == QUANTS[quant].default
    wide = ModelShape("gqa4", 256, 8, 8, 2, 32, 512, SMOL_VOCAB + 64)  # 4 query heads a KV head
    assert tensor_types(wide, "Q2_K")["blk.4.attn_v.weight"] == Q.Q4_K
    assert tensor_types(wide, "IQ4_NL")["blk.4.attn_v.weight"] == Q.Q5_K


# What llama-quantize (llama.cpp 11434, `--allow-requantize` from the shipped Q4_1 file) wrote for
# SmolLM2-135M in each mix: its 2-D tensors by type. The plan matched those files tensor by tensor.
SMOL_WRITTEN = {
    "Q3_K_M": {"Q8_0": 1, "Q4_0": 120, "Q5_0": 58, "Q5_1": 2, "Q5_K": 1, "Q4_K": 29},
    "Q2_K": {"Q8_0": 1, "Q4_0": 180, "Q3_K": 30},
    "IQ4_XS": {"Q8_0": 1, "IQ4_NL": 180, "Q5_K": 3, "IQ4_XS": 27},
    "IQ4_NL": {"Q8_0": 1, "IQ4_NL": 207, "Q5_K": 3},
    "Q4_K_M": {"Q8_0": 15, "Q5_0": 166, "Q6_K": 14, "Q4_K": 16},
}


@pytest.mark.parametrize("quant", list(SMOL_WRITTEN))
def test_smollm2s_plan_has_the_types_llama_quantize_wrote(quant: str) -> None:
    written = Counter(t.qtype.name for t in plan(SMOL, quant) if len(t.shape) == 2)
    assert written == SMOL_WRITTEN[quant]


def test_the_576_wide_smollm2_falls_back_as_the_notes_say() -> None:
    """Q4_K_M on 576-wide rows: attn and ffn_gate/up Q5_0 (attn_v Q8_0 where Q6_K was planned),
    ffn_down (1536-wide rows) Q4_K/Q6_K, the tied token_embd Q8_0, no output.weight."""
    types = tensor_types(SMOL, "Q4_K_M")
    assert types["token_embd.weight"] == Q.Q8_0 and "output.weight" not in types
    more = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
    for i in range(30):
        for p in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{p}.weight"] == Q.Q5_0
        assert types[f"blk.{i}.attn_v.weight"] == (Q.Q8_0 if i in more else Q.Q5_0)
        assert types[f"blk.{i}.ffn_down.weight"] == (Q.Q6_K if i in more else Q.Q4_K)
    # Q5_K -> Q5_1, Q6_K -> Q8_0; the tied output is Q8_0 in every K mix, Q6_K -> Q8_0 under Q4_0.
    assert tensor_types(SMOL, "Q5_K_M")["blk.3.attn_q.weight"] == Q.Q5_1
    assert set(tensor_types(SMOL, "Q6_K").values()) == {Q.Q6_K, Q.Q8_0, Q.F32}
    assert tensor_types(SMOL, "Q6_K")["blk.3.ffn_down.weight"] == Q.Q6_K
    assert tensor_types(SMOL, "Q4_0")["token_embd.weight"] == Q.Q8_0
    assert tensor_types(SMOL, "Q4_1")["token_embd.weight"] == Q.Q8_0  # as the local SmolLM2 Q4_1 file
    # Rows not a multiple of 32 either: F16.
    odd = ModelShape("odd", 80, 1, 2, 1, 40, 256, SMOL_VOCAB)
    assert tensor_types(odd, "Q4_K_M")["blk.0.attn_q.weight"] == Q.F16


def test_the_real_shapes_plan_the_sizes_of_real_files() -> None:
    """Planned without writing: tensor data within a few MB of bartowski's/llama-quantize's files
    (Meta-Llama-3-8B Q4_K_M 4.92 GB, Q8_0 8.54 GB; Qwen2.5-1.5B Q4_K_M 0.99 GB; Llama-3.2-3B 2.02 GB)."""
    assert 4.85e9 < planned_bytes("llama3-8b", "Q4_K_M") < 4.95e9
    assert 8.45e9 < planned_bytes("llama3-8b", "Q8_0") < 8.6e9
    assert 0.95e9 < planned_bytes("qwen2.5-1.5b", "Q4_K_M") < 1.0e9
    assert 1.98e9 < planned_bytes("llama3.2-3b", "Q4_K_M") < 2.05e9
    counts = type_counts(plan("llama3-8b", "Q4_K_M"))
    assert counts == {"Q4_K": 193, "F32": 65, "Q6_K": 33}  # 16 attn_v + 16 ffn_down + output
    qwen = tensor_types("qwen2.5-0.5b", "Q4_K_M")  # 896 wide: Q5_0 / Q8_0, ffn_down 4864 = 19 x 256
    assert qwen["token_embd.weight"] == Q.Q8_0 and qwen["blk.0.attn_q.bias"] == Q.F32
    assert qwen["blk.0.attn_q.weight"] == Q.Q5_0 and qwen["blk.0.ffn_down.weight"] == Q.Q6_K


def test_the_written_file_reads_back(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "llama.gguf", LLAMA, "Q4_K_M")
    meta = {k: v.value for k, v in read_gguf(path).metadata.items()}
    assert meta["general.architecture"] == "llama" and meta["general.file_type"] == 15  # MOSTLY_Q4_K_M
    sizes = {k: meta[f"llama.{k}"] for k in ("block_count", "embedding_length", "feed_forward_length", "vocab_size")}
    assert sizes == {"block_count": 8, "embedding_length": 256, "feed_forward_length": 512, "vocab_size": 49216}
    assert meta["llama.attention.head_count"] == 4 and meta["llama.attention.head_count_kv"] == 2
    assert meta["llama.rope.freq_base"] == 500_000.0 and meta["llama.context_length"] == 8192
    assert meta["llama.rope.dimension_count"] == 64 and "llama.attention.key_length" not in meta  # 256 / 4
    # gguf-py's reader agrees with ours, on the types planned and the ne order (row length first).
    reader = GGUFReader(path)
    assert {t.name: t.tensor_type for t in reader.tensors} == tensor_types(LLAMA, "Q4_K_M")
    ours = [(t.name, t.ne, t.qtype, t.offset) for t in read_gguf(path).tensors]
    assert ours == [(t.name, tuple(t.shape.tolist()), t.tensor_type, t.data_offset) for t in reader.tensors]
    ne = {t.name: t.shape.tolist() for t in reader.tensors}
    assert ne["blk.0.attn_k.weight"] == [256, 128] and ne["output.weight"] == [256, SMOL_VOCAB + 64]
    assert reader.fields["tokenizer.ggml.eos_token_id"].types == [GGUFValueType.UINT32]
    assert path.stat().st_size - reader.tensors[0].data_offset == planned_bytes(LLAMA, "Q4_K_M")
    # The tokenizer: SmolLM2's, padded with UNUSED tokens to the vocabulary (as llama.cpp pads).
    source = {k: v.value for k, v in read_gguf(default_gguf()).metadata.items()}
    tokens, token_type = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(token_type) == SMOL_VOCAB + 64 and tokens[-1] == f"[PAD{SMOL_VOCAB + 63}]"
    assert tokens[:SMOL_VOCAB] == source["tokenizer.ggml.tokens"] and set(token_type[SMOL_VOCAB:]) == {5}
    assert token_type[:SMOL_VOCAB] == source["tokenizer.ggml.token_type"]
    tokenizer_keys = {k for k in source if k.startswith("tokenizer.")}
    assert tokenizer_keys == {k for k in meta if k.startswith("tokenizer.")}
    for key in tokenizer_keys - {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type"}:
        assert meta[key] == source[key], key


def test_transformers_reads_the_config_and_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    odd_heads = ModelShape("gguf-llama-hd", 128, 2, 4, 1, 64, 256, SMOL_VOCAB + 8)  # head_dim 64, not 128/4
    configs = {}
    for shape in (odd_heads, QWEN):
        path = write_gguf(tmp_path / f"{shape.name}.gguf", shape, "Q8_0")
        config = configs[path.name] = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
        assert config.model_type == shape.arch and config.vocab_size == shape.vocab_size
        assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (
            shape.hidden_size, shape.num_hidden_layers, shape.intermediate_size,
        )  # fmt: skip
        assert config.num_key_value_heads == shape.num_key_value_heads
        assert config.tie_word_embeddings == shape.tied_embeddings
        assert getattr(config, "head_dim", None) in (shape.head_dim, None)
        tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
        assert len(tok) == shape.vocab_size and tok.chat_template
        ids = tok("Hello world").input_ids
        assert tok.decode(ids) == "Hello world"
        if shape.vocab_size > SMOL_VOCAB:  # a pad is a plain vocabulary entry, not a special token
            assert tok.decode([shape.vocab_size - 1]) == f"[PAD{shape.vocab_size - 1}]"
            assert f"[PAD{shape.vocab_size - 1}]" not in tok.all_special_tokens
    assert configs["gguf-llama-hd.gguf"].head_dim == 64  # read once above (transformers' GGUF read: ~3 s)


def _weights(path: Path, rows: int = 4096) -> dict[str, np.ndarray]:
    """Every tensor dequantized (at most its first `rows` rows), in numpy order (ne reversed)."""
    out = {}
    for t in read_gguf(path).tensors:
        block, size = GGML_QUANT_SIZES[t.qtype]
        n = min(rows, int(np.prod(t.ne[1:], dtype=np.int64)))
        raw = np.memmap(path, np.uint8, "r", t.offset, (n, t.ne[0] // block * size))
        w = dequantize(np.array(raw), t.qtype).astype(np.float64)
        out[t.name] = w.reshape(n, t.ne[0]) if len(t.ne) > 1 else w.reshape(-1)
    return out


@pytest.mark.parametrize("quant", list(QUANTS))
def test_dequantized_weights_are_finite_and_of_init_std(tmp_path: Path, quant: str) -> None:
    shape = ModelShape("gguf-llama-2", 256, 2, 4, 2, 64, 512, SMOL_VOCAB, init_std=0.05)
    for name, w in _weights(write_gguf(tmp_path / "m.gguf", shape, quant)).items():
        assert np.isfinite(w).all(), name
        if name.endswith("norm.weight"):
            assert abs(w.mean() - 1) < 0.01 and w.std() < 0.05, name
        else:
            assert 0.85 * 0.05 < w.std() < 1.15 * 0.05, (name, w.std())
            assert abs(w.mean()) < 0.1 * 0.05, (name, w.mean())


def _rms_norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w


def _forward(w: dict[str, np.ndarray], s: ModelShape, ids: list[int]) -> np.ndarray:
    """A plain Llama/Qwen2 forward (causal attention, GQA, SwiGLU; no rope: finiteness only)."""
    x = w["token_embd.weight"][ids]
    n, h, kv, d = len(ids), s.num_attention_heads, s.num_key_value_heads, s.head_dim
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(s.num_hidden_layers):
        b = f"blk.{i}."
        a = _rms_norm(x, w[b + "attn_norm.weight"])
        q, k, v = (a @ w[f"{b}attn_{p}.weight"].T + w.get(f"{b}attn_{p}.bias", 0) for p in "qkv")
        q, k, v = (
            q.reshape(n, h, d),
            np.repeat(k.reshape(n, kv, d), h // kv, 1),
            np.repeat(v.reshape(n, kv, d), h // kv, 1),
        )
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d) + mask
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", p, v).reshape(n, h * d) @ w[b + "attn_output.weight"].T
        f = _rms_norm(x, w[b + "ffn_norm.weight"])
        gate, up = f @ w[b + "ffn_gate.weight"].T, f @ w[b + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[b + "ffn_down.weight"].T
    head = w.get("output.weight", w["token_embd.weight"])
    return _rms_norm(x, w["output_norm.weight"]) @ head.T


@pytest.mark.parametrize(("shape", "quant"), [(LLAMA, "Q4_K_M"), (QWEN, "Q5_K_M"), (LLAMA, "Q4_0")])
def test_a_forward_over_the_dequantized_weights_is_finite(tmp_path: Path, shape: ModelShape, quant: str) -> None:
    logits = _forward(
        _weights(write_gguf(tmp_path / "m.gguf", shape, quant), 1 << 20), shape, [1, 200, 3000, 17, 42, 49151]
    )
    assert np.isfinite(logits).all() and 0.05 < logits.std() < 5.0


def test_the_same_seed_writes_the_same_bytes(tmp_path: Path) -> None:
    a = write_gguf(tmp_path / "a.gguf", QWEN, "Q4_K_M", seed=3).read_bytes()
    assert a == write_gguf(tmp_path / "b.gguf", QWEN, "Q4_K_M", seed=3).read_bytes()
    assert a != write_gguf(tmp_path / "c.gguf", QWEN, "Q4_K_M", seed=4).read_bytes()


def test_the_cli_writes_a_named_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(shapes.SHAPES, QWEN.name, QWEN)
    out = tmp_path / "q.gguf"
    assert main(["bench", "--write-gguf", str(out), "--shape", QWEN.name, "--quant", "Q6_K", "--seed", "1"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "(13 Q8_0, 11 F32, 2 Q6_K)" in printed  # 96-wide rows fall back
    assert {t.qtype for t in read_gguf(out).tensors} == {Q.Q8_0, Q.Q6_K, Q.F32}
    # A vocabulary smaller than the tokenizer's, an unknown mix: refused.
    assert main(["bench", "--write-gguf", str(tmp_path / "t.gguf"), "--shape", "llama3-tiny"]) == 2
    assert main(["bench", "--write-gguf", str(out), "--shape", QWEN.name, "--quant", "Q1_X"]) == 2
    assert "unknown quantization" in capsys.readouterr().err
