"""The start-up check of the batch-invariance contract on the loaded model."""

from __future__ import annotations

from typing import Any

import pytest

from batchserve.attention import INVARIANT_BACKENDS
from batchserve.config import DraftConfig, EngineConfig, ModelConfig
from batchserve.runner.build import StartupCheckFailed
from tests.conftest import make_tiny_model, make_tiny_tokenizer
from tests.runner.products import core_of, native, per_row


def _row_count_leaks(model: Any) -> Any:
    """The model with logits that move with the step's row count: not batch-invariant."""
    forward = model.forward

    def leaky(input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        out = forward(input_ids, *args, **kwargs)
        out.logits.add_(1e-3 * input_ids.shape[1])
        return out

    model.forward = leaky
    return model


def test_the_check_passes_where_the_model_is_invariant_and_says_so():
    core = core_of(per_row())  # products invariant by construction (the shipped ones are oneDNN's here)
    assert core.facts.attention_backend in INVARIANT_BACKENDS
    check = core.facts.check
    assert check.invariant and check.rows == 7 and check.layers == 16 and check.seconds > 0
    assert check.detail.startswith("16 layers at up to ") and check.detail.endswith("bit for bit the same")
    assert core.facts.batch_invariant and core.facts.invariance_why == check.detail
    # The check's requests left nothing behind in the runner.
    assert not core.runner._tables._row and not core.runner._generators


def test_the_shipped_model_is_invariant_only_where_its_check_says_so():
    core = core_of(native())
    assert core.facts.batch_invariant == (core.facts.check is not None and core.facts.check.invariant)
    assert core.facts.invariance_why


def test_a_model_whose_rows_move_with_the_batch_fails_the_check_and_never_serves():
    model = _row_count_leaks(per_row())
    with pytest.raises(StartupCheckFailed) as failed:
        core_of(model)
    # Every layer passed (the leak is past them): the model-level comparison caught it.
    assert "every layer passed, but the model's logits alone and among others differ: rows" in str(failed.value)
    assert "Not serving" in str(failed.value)


def test_a_pool_too_small_to_check_keeps_the_backend_and_claims_nothing():
    core = core_of(per_row(), num_blocks=8)
    assert core.facts.attention_backend in INVARIANT_BACKENDS
    assert core.facts.check.rows == 0 and "not checked" in core.facts.check.detail
    assert not core.facts.batch_invariant


def test_no_check_where_no_invariance_is_claimed():
    from batchserve.engine import EngineCore

    config = EngineConfig(model=ModelConfig(attention_backend="torch"), draft=DraftConfig(method="none"))
    core = EngineCore(config, make_tiny_model(), make_tiny_tokenizer())
    assert core.facts.check is None and not core.facts.batch_invariant
    assert core.facts.invariance_why.startswith("not checked: the torch attention claims no batch invariance")
