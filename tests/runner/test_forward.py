"""The forward chosen once: one record of every part and why, read by the runner, the log and the APIs."""

from __future__ import annotations

import logging

import pytest
import torch

from batchserve.config import CacheConfig, EngineConfig, ModelConfig
from batchserve.runner.forward import PARTS, ForwardChoice, Part, choose_forward
from tests.conftest import make_tiny_model, make_tiny_tokenizer


def _config(**model: str) -> EngineConfig:
    return EngineConfig(model=ModelConfig(**model), cache=CacheConfig(block_size=4, num_blocks=64))


def test_auto_on_a_cpu_names_every_part_and_why():
    model, choice = choose_forward(make_tiny_model(), _config(), loaded_from_path=False)
    assert getattr(model, "native", False)  # the tiny Llama runs natively
    parts = choice.parts()
    assert list(parts) == list(PARTS) and all(p.choice and p.why for p in parts.values())
    assert parts["impl"] == Part("native", "auto: llama runs natively on cpu")
    assert parts["weights"].choice == "float32" and "handed in" in parts["weights"].why  # only a file has others
    assert parts["graphs"].choice == "off" and "CUDA device" in parts["graphs"].why
    assert parts["attention"].choice in ("kernel", "invariant", "torch") and parts["attention"].why.startswith("auto")
    # The products' classes, and whether they are batch-invariant (what the attention choice read).
    invariant = bool(getattr(model, "batch_invariant_linears", False))
    assert parts["linear"].why.endswith("; batch-invariant" if invariant else "; not batch-invariant")
    assert (parts["attention"].choice == "torch") or invariant  # an invariant attention only beside invariant products
    line = choice.line()
    assert all(f"{name} {p.choice} (" in line for name, p in parts.items())
    assert choice.name == f"native float32 weights, {parts['attention'].choice} attention"


def test_asked_for_parts_say_so_and_the_transformers_forward_is_named_by_its_dtype():
    _, choice = choose_forward(
        make_tiny_model(), _config(model_impl="transformers", attention_backend="torch", cuda_graphs="eager"), False
    )
    assert choice.impl == Part("transformers", "model_impl=transformers was asked for")
    assert choice.attention == Part("torch", "attention_backend=torch was asked for")
    assert choice.graphs == Part("eager", "cuda_graphs=eager was asked for")
    assert choice.fused == Part("off", "only the native model's layers fuse")
    assert choice.name == "transformers float32, torch attention"


def test_a_fallback_changes_one_part_and_says_why():
    _, choice = choose_forward(make_tiny_model(), _config(attention_backend="torch"), False)
    after = choice.fallback("attention", "torch", "the check failed")
    assert after.attention == Part("torch", "the check failed") and after.weights == choice.weights
    with pytest.raises(ValueError, match="no forward part"):
        choice.fallback("kernel", "x", "y")
    with pytest.raises(AttributeError):  # frozen: a change is a new record
        choice.impl = Part("x", "y")  # type: ignore[misc]


def test_settings_that_cannot_run_here_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="cuda_graphs=on: CUDA graphs need a CUDA device"):
        choose_forward(make_tiny_model(), _config(cuda_graphs="on"), False)
    with pytest.raises(ValueError, match="flashinfer attention backend needs CUDA"):
        choose_forward(make_tiny_model(), _config(attention_backend="flashinfer"), False)


def test_the_engine_is_built_from_the_record_and_logs_it_in_one_line(caplog):
    from batchserve.engine import EngineCore

    config = _config().with_settings(draft="none")
    with caplog.at_level(logging.INFO, logger="batchserve"):
        core = EngineCore(config, make_tiny_model(), make_tiny_tokenizer())
    assert isinstance(core.facts.forward, ForwardChoice)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("forward: ")]
    assert lines == [f"forward: {core.facts.forward.line()}"]
    # The runner runs what the record says.
    backend = type(core.runner.backend).__name__
    expected = {"kernel": "KernelBackend", "invariant": "InvariantBackend", "torch": "TorchReferenceBackend"}
    assert backend == expected[core.facts.forward.attention.choice] and core.runner.graphs is None
    assert core.facts.attention_backend == core.facts.forward.attention.choice and core.facts.graphs == "off"
    assert next(core.runner.model.parameters()).dtype == torch.float32
