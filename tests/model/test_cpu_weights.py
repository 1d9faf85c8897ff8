"""What `cpu_weights=auto` takes on which CPU and why (`cpu_weights_choice`, with the CPU's facts
faked), what the engine serving the default file runs, and a GGUF loaded through transformers
with bfloat16 products: its token embedding read from the file's own blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchserve.model import bf16_fast_here, bf16_layer_class, choose_impl, cpu_weights_choice
from batchserve.model.bf16 import KernelBf16Linear
from tests.conftest import make_tiny_model


def _cpu(monkeypatch: pytest.MonkeyPatch, ours: bool, bf16: bool) -> None:
    """Fake the CPU: our kernels built and invariant (`ours`), AVX-512 (`bf16`: oneDNN's bfloat16
    products, and ours compiled for 16 columns)."""
    monkeypatch.setattr("batchserve.model.our_blocks_here", lambda: ours)
    monkeypatch.setattr("batchserve.model.our_bf16_here", lambda: ours)
    monkeypatch.setattr("batchserve.kernels.bf16_columns", lambda: 16 if bf16 else 8)
    monkeypatch.setattr("batchserve.model.bf16_prepack_available", lambda: bf16)
    monkeypatch.setattr("batchserve.model.packed_products_invariant", lambda layer_class: True)


def test_auto_reads_a_gguf_from_its_blocks_wherever_our_kernels_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    gguf, hf = tmp_path / "m.gguf", tmp_path / "hf"
    gguf.write_bytes(b"GGUF")  # the choice looks at the path only; the load reads the file
    hf.mkdir()
    (hf / "config.json").write_text("{}")

    def auto(path: Path, direct: bool = True) -> str:
        return cpu_weights_choice(True, str(path), direct).weights

    # Our kernels, AVX2 or AVX-512: a GGUF file straight from its blocks. Our bfloat16 kernel runs on
    # AVX2 too, but no faster than float32 from 4 rows on, so a directory stays float32 there.
    _cpu(monkeypatch, ours=True, bf16=False)
    assert auto(gguf) == "gguf" and "own blocks" in cpu_weights_choice(True, str(gguf)).why
    assert bf16_layer_class() is KernelBf16Linear and not bf16_fast_here()
    assert auto(hf) == "float32" and "directory" in cpu_weights_choice(True, str(hf)).why
    assert auto(gguf, direct=False) == "float32"  # a file transformers loaded (the engine could not read it)
    assert auto(tmp_path / "missing.gguf") == "float32"
    assert cpu_weights_choice(False, str(gguf)) == ("float32", "not on the CPU: the model keeps its dtype")
    _cpu(monkeypatch, ours=True, bf16=True)
    assert auto(gguf) == "gguf"
    assert auto(hf) == "bfloat16" and "our kernel" in cpu_weights_choice(True, str(hf)).why
    transformers_loaded = cpu_weights_choice(True, str(gguf), direct=False)
    assert transformers_loaded.weights == "bfloat16" and "through transformers" in transformers_loaded.why
    # Without our kernels (no compiler, or not invariant here): bfloat16 where oneDNN's runs invariantly, else float32.
    _cpu(monkeypatch, ours=False, bf16=True)
    choice = cpu_weights_choice(True, str(gguf))
    assert choice.weights == "bfloat16" and "oneDNN's" in choice.why and "block kernels do not run here" in choice.why
    monkeypatch.setattr("batchserve.model.packed_products_invariant", lambda layer_class: False)  # AMX tiles rows
    assert bf16_layer_class() is None and auto(gguf) == "float32" and auto(hf) == "float32"
    _cpu(monkeypatch, ours=False, bf16=False)
    assert auto(gguf) == "float32" and "no invariant bfloat16" in cpu_weights_choice(True, str(gguf)).why
    # A model handed in (not loaded from the path here) keeps its own weights under auto.
    _cpu(monkeypatch, ours=True, bf16=True)
    native = choose_impl(make_tiny_model(), "auto", cpu_weights="auto", path=str(gguf))
    assert native.cpu_weights == "float32" and "handed in" in native.cpu_weights_reason


@pytest.mark.slow
@pytest.mark.parametrize("seats", [16, 1])
def test_the_engine_serving_the_default_file_takes_what_auto_names_here(seats: int):
    """cpu_weights=auto, the shipped default: an engine that loads the default GGUF itself reads
    it straight from its blocks (every product a `BlockLinear`, the embedding's rows read from the
    file) at every seat count wherever our kernels run, AVX2 and AVX-512 alike; elsewhere
    transformers loads it (bfloat16 products where they run fast, else float32). The engine says
    which and why."""
    from batchserve import LLM
    from batchserve.model import choose_cpu_weights, our_blocks_here
    from batchserve.model.blocks import BlockLinear
    from batchserve.model.gguf_native import GGUFEmbedding

    llm = LLM(draft="none", max_num_seqs=seats)
    model = llm.engine.runner.model
    expected = choose_cpu_weights(True, None)
    assert model.cpu_weights == expected
    assert llm.engine.facts.forward.name.startswith(f"native {expected} weights")
    if our_blocks_here():
        assert expected == "gguf" and "our kernels" in llm.engine.facts.forward.weights.why
        assert isinstance(model.embed_tokens, GGUFEmbedding) and isinstance(model.lm_head, BlockLinear)
        assert all(isinstance(layer.mlp.down_proj, BlockLinear) for layer in model.layers)
        assert model.fused_layers is not None  # every layer in one call of our kernels
    else:
        assert expected == ("bfloat16" if bf16_fast_here() else "float32")
        assert (type(model.layers[0].mlp.down_proj) is bf16_layer_class()) == (expected == "bfloat16")


@pytest.mark.slow
def test_bfloat16_products_over_a_gguf_look_the_embedding_up_in_the_files_blocks():
    """cpu_weights=bfloat16 over the default GGUF loaded through transformers: the token embedding
    is the file's Q8_0 rows (`GGUFEmbedding`), exactly the values transformers loaded; an
    embedding that differs from the file's is kept as loaded (the rest of the model is that load's)."""
    from batchserve.model.gguf_native import GGUFEmbedding
    from batchserve.model.loader import load_model

    if bf16_layer_class() is None:
        pytest.skip("no invariant bfloat16 products here")
    hf, _ = load_model(None, "float32")
    weight = hf.model.embed_tokens.weight
    native = choose_impl(hf, "auto", cpu_weights="bfloat16")
    assert isinstance(native.embed_tokens, GGUFEmbedding) and native.embed_tokens.view.qtype == 8  # Q8_0
    ids = torch.tensor([0, 7, 100, 49151, 100])
    assert torch.equal(native.embed_tokens(ids), weight[ids])
    with torch.no_grad():
        weight[100, 7] += 1e-3
    assert isinstance(choose_impl(hf, "auto", cpu_weights="bfloat16").embed_tokens, torch.nn.Embedding)
