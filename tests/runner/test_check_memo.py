"""The start-up check's verdict for a model handed in, kept in this process for that object as it
stands: a second engine over the same unchanged model and engine shape reuses it; a weight changed
in place, another module, or another shape is checked again; a refusal is refused again."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from batchserve import LLM
from batchserve.runner import build
from batchserve.runner.build import StartupCheckFailed
from tests.conftest import make_tiny_model, make_tiny_tokenizer


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every check that ran (the runner each was called on)."""
    ran: list[Any] = []
    real = build.check_contract

    def counted(runner: Any, *args: Any) -> Any:
        ran.append(runner)
        return real(runner, *args)

    monkeypatch.setattr(build, "check_contract", counted)
    return ran


def _llm(model: Any, **kw: Any) -> LLM:
    return LLM(hf_model=model, tokenizer=make_tiny_tokenizer(), model_impl="native", draft="none", **kw)


def test_an_unchanged_model_in_the_same_shape_is_checked_once(checks):
    model = make_tiny_model()
    first = _llm(model)
    assert len(checks) == 1 and first.engine.facts.check is not None
    second = _llm(model)
    assert len(checks) == 1 and second.engine.facts.check == first.engine.facts.check
    _llm(model, max_num_seqs=3)  # another engine shape: its own row counts
    assert len(checks) == 2
    _llm(make_tiny_model())  # another object, whatever its values
    assert len(checks) == 3


def test_a_weight_changed_in_place_or_a_module_swapped_is_checked_again(checks):
    model = make_tiny_model()
    _llm(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.0)  # the same values, but written: its version moved
    _llm(model)
    assert len(checks) == 2
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()  # another module's class
    _llm(model)
    assert len(checks) == 3


def test_a_refused_model_is_refused_again_without_a_check(checks, monkeypatch):
    model = make_tiny_model()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    for _ in range(2):
        with pytest.raises(StartupCheckFailed, match="NaN or Inf"):
            _llm(model)
    assert len(checks) == 1
