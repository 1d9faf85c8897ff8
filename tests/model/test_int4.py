"""The GGUF's Q4_1 layers: decoding the blocks, the row order, torch's int4 layer, loading the
default model on our kernel or torch's, the `auto` choice, the refusals. (Our kernel's own
layers are tested in test_quant.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchserve.model import bf16_fast_here, bf16_layer_class, choose_impl, our_q4_here
from batchserve.model.bf16 import KernelBf16Linear
from batchserve.model.int4 import (
    Int4Linear,
    decode_q4_1,
    decode_q8_0,
    int4_available,
    int4_products_invariant,
    unpermute_rows,
)
from batchserve.model.layers import PackedLinear
from batchserve.model.quant import Q4Linear, Q8Blocks, Q8Embedding, Q8Linear
from tests.conftest import make_tiny_model

needs_int4 = pytest.mark.skipif(not int4_available(), reason="this torch has no CPU int4 kernel")


def _blocks(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """ggml's Q4_1 layout, written independently: per block d, m (float16), then 16 bytes whose
    low nibbles hold values 0-15 and high nibbles values 16-31."""
    rows, cols = q.shape
    out = np.zeros((rows, cols // 32, 20), np.uint8)
    out[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:4] = m.astype(np.float16)[..., None].view(np.uint8)
    groups = q.reshape(rows, cols // 32, 32)
    out[..., 4:] = groups[..., :16] | (groups[..., 16:] << 4)
    return out.reshape(rows, -1)


def test_q4_1_blocks_decode_to_their_values_and_scales():
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (3, 64)).astype(np.uint8)
    d, m = rng.random((3, 2)).astype(np.float16), -rng.random((3, 2)).astype(np.float16)
    got_q, got_d, got_m = decode_q4_1(_blocks(q, d, m), 3, 64)
    assert (got_q == q).all() and (got_d == d.astype(np.float32)).all() and (got_m == m.astype(np.float32)).all()


def test_q8_0_blocks_decode_and_look_up_exactly_as_gguf_dequantizes_them():
    """Q8_0 blocks quantized by the gguf package itself; the embedding's rows are its values bit for bit."""
    import gguf

    rng = np.random.default_rng(2)
    weight = rng.normal(0, 0.05, (40, 96)).astype(np.float32)
    raw = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)  # [40, 96/32 * 34] bytes
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).astype(np.float32)
    q, d = decode_q8_0(raw, 40, 96)
    assert q.dtype == np.int8 and d.shape == (40, 3)
    embedding = Q8Embedding(Q8Blocks(q, d))  # 40 rows: padded to whole groups of 8 inside
    ids = torch.tensor([3, 0, 39, 3])
    assert torch.equal(embedding(ids), torch.from_numpy(expected)[ids])


def test_rows_in_llama_cpps_rotary_order_come_back_in_transformers_order():
    heads, head_dim = 3, 8
    rows = np.arange(heads * head_dim)[:, None] * np.ones((1, 4))
    # llama.cpp's converter: per head, the two halves' rows interleaved in pairs.
    stored = rows.reshape(heads, 2, head_dim // 2, 4).swapaxes(1, 2).reshape(rows.shape)
    assert (unpermute_rows(stored, heads) == rows).all()
    assert (unpermute_rows(stored[:, 0], heads) == rows[:, 0]).all()  # the per-row scales too


@needs_int4
def test_the_layer_computes_the_dequantized_product_and_its_rows_do_not_depend_on_their_company():
    rng = np.random.default_rng(1)
    q = rng.integers(0, 16, (48, 128)).astype(np.uint8)
    d = (rng.random((48, 4)) / 16).astype(np.float32)
    m = (-8 * d + rng.normal(0, 0.01, d.shape)).astype(np.float32)
    bias = torch.randn(48)
    layer = Int4Linear(q, d, m, bias, (32, 16))
    weight = torch.from_numpy(np.repeat(d, 32, axis=1) * q + np.repeat(m, 32, axis=1))
    x = torch.randn(20, 128)
    torch.testing.assert_close(layer(x), x @ weight.T + bias, rtol=2e-2, atol=2e-2)  # bfloat16 inside
    assert layer.sizes == (32, 16) and layer(x).shape == (20, 48)  # the merged parts' sizes, kept
    if int4_products_invariant():
        assert all(torch.equal(layer(x[:n])[0], layer(x[:1])[0]) for n in (2, 3, 8, 20))
    # Feeding the residual add alone it leaves in the kernel's bfloat16: the same values.
    bare = Int4Linear(q, d, m, None, (48,))
    narrow = Int4Linear(q, d, m, None, (48,), torch.bfloat16)(x)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow.float(), bare(x))
    assert Int4Linear(q, d, m, bias, (48,), torch.bfloat16)(x).dtype == torch.float32  # a bias: float32


def test_q4_1_weights_need_the_native_model_on_cpu():
    with pytest.raises(ValueError, match="q4_1"):
        choose_impl(make_tiny_model(), "transformers", cpu_weights="q4_1")
    from batchserve.config import ModelConfig

    with pytest.raises(ValueError, match="cpu_weights"):
        ModelConfig(cpu_weights="q8")


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["ours", "torch"])
def test_smollm2_runs_on_its_own_q4_1_blocks(kernel, monkeypatch):
    """Every layer product of the default model becomes the file's Q4_1 blocks (each checked
    against what transformers dequantized from them), on our kernel (the LM head on the file's
    Q8_0 blocks, shared with the embedding) or, where ours cannot run, torch's int4 kernel; drafts
    leave the output unchanged."""
    from batchserve import LLM, SamplingParams
    from batchserve.runner import load_model

    if kernel == "ours" and not our_q4_here():
        pytest.skip("our kernels cannot run here")
    if kernel == "torch":
        if not int4_available():
            pytest.skip("this torch has no CPU int4 kernel")
        monkeypatch.setattr("batchserve.model.our_q4_here", lambda: False)  # as without a compiler
    model, tokenizer = load_model(None, "float32")
    prompts = ["def fibonacci(n):", "The capital of France is"]
    outs = {}
    for draft in ("none", "lookahead"):
        llm = LLM(hf_model=model, tokenizer=tokenizer, cpu_weights="q4_1", draft=draft, adaptive=False)
        native = llm.engine.runner.model
        layer_class = Q4Linear if kernel == "ours" else Int4Linear
        assert sum(isinstance(m, layer_class) for m in native.modules()) == 4 * 30
        assert isinstance(native.embed_tokens, Q8Embedding)  # the file's Q8_0 blocks
        head = native.lm_head
        if kernel == "ours":
            assert isinstance(head, Q8Linear) and head.blocks is native.embed_tokens.blocks  # one copy
        else:  # bfloat16 where this CPU runs it invariantly (half float32's bytes), else float32
            assert type(head) is (bf16_layer_class() if bf16_fast_here() else PackedLinear)
            assert {m.out_dtype for m in native.layers[3].modules() if isinstance(m, Int4Linear)} == {
                torch.float32,
                torch.bfloat16,  # o_proj and down_proj feed the residual add alone
            }
        outs[draft] = [r.token_ids for r in llm.generate(prompts, SamplingParams(max_new_tokens=24))]
    assert outs["none"] == outs["lookahead"] and all(len(t) > 0 for t in outs["none"])
    # A block that does not match what transformers loaded fails the load, and no layer is swapped.
    from batchserve.model import native_from_hf
    from batchserve.model.int4 import load_gguf_int4
    from batchserve.model.loader import default_model_path

    native = native_from_hf(model)
    with torch.no_grad():
        native.layers[17].mlp.down_proj.weight[3, 5] += 1e-3
    with pytest.raises(ValueError, match=r"mlp\.down_proj"):
        load_gguf_int4(native, default_model_path())
    assert not any(isinstance(m, Int4Linear) for m in native.modules())
    # The same for the embedding: its Q8_0 rows must be transformers' values exactly.
    from batchserve.model.int4 import load_gguf_embedding

    with torch.no_grad():
        native.embed_tokens.weight[100, 7] += 1e-3
    with pytest.raises(ValueError, match="token embedding"):
        load_gguf_embedding(native, default_model_path())
    assert isinstance(native.embed_tokens, torch.nn.Embedding)


@pytest.mark.slow
@pytest.mark.parametrize("seats", [16, 1])
def test_the_engine_serving_the_default_file_takes_the_fast_reduced_weights_of_this_cpu(seats):
    """cpu_weights=auto, the shipped default: an engine that loads the default GGUF itself reads
    it straight from its blocks (`gguf`: every product a `BlockLinear`, the embedding's rows read
    from the file) at every seat count wherever our kernels build, AVX2 and AVX-512 alike;
    elsewhere transformers loads it and the Q4_1 layers run on torch's int4 kernel (up to two
    seats where bfloat16 products run). The engine says which and why."""
    from batchserve import LLM
    from batchserve.model import Q4_1_MAX_SEATS, choose_cpu_weights, int4_fast_here, our_blocks_here
    from batchserve.model.blocks import BlockLinear
    from batchserve.model.gguf_native import GGUFEmbedding

    llm = LLM(draft="none", max_num_seqs=seats)
    model = llm.engine.runner.model
    expected = choose_cpu_weights(True, None, seats)
    if our_blocks_here():
        assert expected == "gguf"
        assert "our kernels" in llm.engine.facts.forward.weights.why
        assert isinstance(model.embed_tokens, GGUFEmbedding) and isinstance(model.lm_head, BlockLinear)
        assert all(isinstance(layer.mlp.down_proj, BlockLinear) for layer in model.layers)
    elif bf16_fast_here():
        assert expected == ("q4_1" if seats <= Q4_1_MAX_SEATS and int4_fast_here() else "bfloat16")
    elif int4_fast_here():
        assert expected == "q4_1"
    assert model.cpu_weights == expected
    assert llm.engine.facts.forward.name.startswith(f"native {expected} weights")
    if expected == "gguf":
        return
    assert any(isinstance(m, Int4Linear) for m in model.modules()) == (expected == "q4_1")
    bf16 = bf16_layer_class()  # ours where our kernels build, else oneDNN's where invariant
    assert (type(model.layers[0].mlp.down_proj) is bf16) == (expected == "bfloat16")
    assert (type(model.lm_head) is bf16) == (expected == "bfloat16" or (expected == "q4_1" and bf16_fast_here()))
    assert isinstance(model.embed_tokens, Q8Embedding) == (expected != "float32")


def _gguf_of(path, types: dict[str, str]) -> str:
    """A GGUF file holding layer 0's products as `types` says (F32 or Q4_1), data all zeros."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        kind = types.get(name, "Q4_1")
        if kind == "F32":
            writer.add_tensor(f"blk.0.{name}.weight", np.zeros((4, 32), np.float32))
        else:
            raw = np.zeros((4, 20), np.uint8)  # 4 rows of one Q4_1 block: [rows, bytes]
            writer.add_tensor(f"blk.0.{name}.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_auto_weights_take_q4_1_only_for_a_q4_1_gguf_loaded_here(tmp_path, monkeypatch):
    from batchserve.model import choose_cpu_weights, int4

    assert int4.gguf_has_q4_1(_gguf_of(tmp_path / "q4.gguf", {}))
    assert not int4.gguf_has_q4_1(_gguf_of(tmp_path / "mixed.gguf", {"ffn_down": "F32"}))
    q4, mixed, hf = str(tmp_path / "q4.gguf"), str(tmp_path / "mixed.gguf"), str(tmp_path / "hf")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")

    def cpu(ours: bool, int4_fast: bool, bf16: bool) -> None:
        """Fake the CPU: our kernels built, torch's int4 fast, AVX-512 (oneDNN's bfloat16, and
        ours compiled for 16 columns)."""
        monkeypatch.setattr("batchserve.model.our_q4_here", lambda: ours)
        monkeypatch.setattr("batchserve.model.our_blocks_here", lambda: ours)
        monkeypatch.setattr("batchserve.model.our_bf16_here", lambda: ours)
        monkeypatch.setattr("batchserve.kernels.bf16_columns", lambda: 16 if bf16 else 8)
        monkeypatch.setattr("batchserve.model.int4_fast_here", lambda: int4_fast)
        monkeypatch.setattr("batchserve.model.bf16_prepack_available", lambda: bf16)
        monkeypatch.setattr("batchserve.model.packed_products_invariant", lambda layer_class: True)

    from batchserve.model import cpu_weights_choice

    def transformers_loaded(path: str, seats: int | None = None) -> str:
        """What auto takes for a model transformers loaded from `path` (the engine could not read it)."""
        return cpu_weights_choice(True, path, seats, direct=False).weights

    # Wherever our kernels build, the engine reads any GGUF straight from its blocks.
    cpu(ours=True, int4_fast=False, bf16=False)
    assert [choose_cpu_weights(True, p, seats) for p in (q4, mixed) for seats in (None, 1, 64)] == ["gguf"] * 6
    assert choose_cpu_weights(False, q4) == "float32"  # not on CPU
    # An AVX2 CPU with our kernels, a model transformers loaded: Q4_1 for every seat count, for a
    # Q4_1 file only; our bfloat16 kernel runs there, but no faster than float32 from 4 rows on, so
    # `auto` does not take it.
    assert [transformers_loaded(q4, seats) for seats in (None, 1, 2, 3, 16, 64)] == ["q4_1"] * 6
    assert bf16_layer_class() is KernelBf16Linear and not bf16_fast_here()
    assert transformers_loaded(mixed) == "float32"
    assert choose_cpu_weights(False, q4) == "float32"  # not on CPU
    assert choose_cpu_weights(True, str(tmp_path / "missing.gguf")) == "float32"
    assert choose_cpu_weights(True, hf) == "float32"  # a model directory
    # Without our kernels (no compiler): torch's int4 kernel where it is fast, else float32.
    cpu(ours=False, int4_fast=True, bf16=False)
    assert choose_cpu_weights(True, q4, 16) == "q4_1"
    cpu(ours=False, int4_fast=False, bf16=False)
    assert choose_cpu_weights(True, q4) == "float32"
    # An AVX-512 CPU (bfloat16 products) with our kernels: Q4_1 at every seat count on a Q4_1 file
    # (measured there: 2.07x bfloat16 at one request, 1.75x at 16), bfloat16 for any other model.
    cpu(ours=True, int4_fast=False, bf16=True)
    assert [transformers_loaded(q4, seats) for seats in (None, 1, 2, 3, 16, 64)] == ["q4_1"] * 6
    assert choose_cpu_weights(True, hf) == "bfloat16" and choose_cpu_weights(True, hf, max_num_seqs=1) == "bfloat16"
    # Without our kernels, torch's int4: bfloat16 past two seats, Q4_1 for one or two at a time.
    cpu(ours=False, int4_fast=True, bf16=True)
    assert choose_cpu_weights(True, q4) == "bfloat16"
    assert choose_cpu_weights(True, hf) == "bfloat16"
    assert [choose_cpu_weights(True, q4, seats) for seats in (1, 2, 3)] == ["q4_1", "q4_1", "bfloat16"]
    assert choose_cpu_weights(True, hf, max_num_seqs=1) == "bfloat16"  # no Q4_1 file
    # Each choice says why.
    assert "torch's int4" in cpu_weights_choice(True, q4, 1).why and "2 seats" in cpu_weights_choice(True, q4, 3).why
    assert "no Q4_1 layers" in cpu_weights_choice(True, hf).why
    cpu(ours=False, int4_fast=False, bf16=True)
    assert choose_cpu_weights(True, q4, max_num_seqs=1) == "bfloat16"
    cpu(ours=True, int4_fast=False, bf16=True)
    monkeypatch.setattr("batchserve.model.packed_products_invariant", lambda layer_class: False)
    assert transformers_loaded(q4) == "q4_1"
    # oneDNN's bfloat16 not invariant here (AMX tiles rows): ours, invariant by construction, is taken.
    assert bf16_layer_class() is KernelBf16Linear
    assert choose_cpu_weights(True, hf) == "bfloat16" and "our kernel" in cpu_weights_choice(True, hf).why
    # ... and without our kernels, neither.
    cpu(ours=False, int4_fast=False, bf16=True)
    monkeypatch.setattr("batchserve.model.packed_products_invariant", lambda layer_class: False)
    assert bf16_layer_class() is None and choose_cpu_weights(True, hf) == "float32"
    assert choose_cpu_weights(False, q4) == "float32"
    # A model handed in (not loaded from the path here) keeps its own weights under auto.
    native = choose_impl(make_tiny_model(), "auto", cpu_weights="auto", path=q4)
    assert native.cpu_weights == "float32" and not any(isinstance(m, (Int4Linear, Q4Linear)) for m in native.modules())
