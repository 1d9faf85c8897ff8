"""The start-up check of the batch-invariance contract on the loaded model."""

from __future__ import annotations

import logging
from typing import Any

from batchserve import SamplingParams
from batchserve.admission import Submission
from batchserve.attention import INVARIANT_BACKENDS
from batchserve.config import DraftConfig, EngineConfig, ModelConfig
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


def test_a_model_whose_rows_move_with_the_batch_fails_the_check_and_says_so(caplog):
    model = _row_count_leaks(per_row())
    with caplog.at_level(logging.WARNING, logger="batchserve"):
        core = core_of(model)
    check = core.facts.check
    assert not check.invariant and not core.facts.batch_invariant
    # Every layer passed (the leak is past them): the model-level comparison caught it.
    assert check.layers == 16 and check.detail.startswith("every layer passed, but the model's logits")
    assert "batch invariance: FAILED" in caplog.text
    # No other attention here is known to be invariant: the forward stays as chosen, and says so.
    assert core.facts.forward.attention.choice == "kernel" and core.facts.forward.impl.choice == "native"
    core.add_request(Submission([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True)))
    while core.has_work():  # and the engine serves
        core.step()


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
