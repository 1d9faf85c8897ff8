"""The start-up check of the batch-invariance contract on the loaded model."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from batchserve import SamplingParams
from batchserve.attention import INVARIANT_BACKENDS
from batchserve.config import CacheConfig, DraftConfig, EngineConfig, ModelConfig
from tests.conftest import make_tiny_model, make_tiny_tokenizer


def _native() -> Any:
    from batchserve.model import choose_impl

    return choose_impl(make_tiny_model(), "auto", max_num_seqs=16)


def _core(model: Any, num_blocks: int = 256) -> Any:
    from batchserve.engine import EngineCore

    config = EngineConfig(
        model=ModelConfig(), cache=CacheConfig(block_size=4, num_blocks=num_blocks), draft=DraftConfig(method="none")
    )
    return EngineCore(config, model, make_tiny_tokenizer())


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
    core = _core(_native())
    if core.attention_backend not in INVARIANT_BACKENDS:
        pytest.skip("this CPU's kernels fail the batch-invariance check (see attention/invariant.py)")
    check = core.invariance_check
    assert check.invariant and check.rows == 7 and check.detail == "" and check.seconds > 0
    assert core.batch_invariant
    # The check's requests left nothing behind in the runner.
    assert not core.runner._tables._row and not core.runner._generators


def test_a_model_whose_rows_move_with_the_batch_fails_the_check_and_falls_back(caplog):
    model = _row_count_leaks(_native())
    with caplog.at_level(logging.WARNING, logger="batchserve"):
        core = _core(model)
    if core.invariance_check is None:
        pytest.skip("this CPU's kernels fail the batch-invariance check: the invariant attention never ran")
    assert not core.invariance_check.invariant and "differ" in core.invariance_check.detail
    assert not core.batch_invariant and core.attention_backend == "torch"  # the reference attention, as auto's fallback
    assert "batch invariance: FAILED" in caplog.text
    # The fallback is in the record, with its reason; the other parts stand as chosen.
    assert core.forward.attention.choice == "torch" and "failed its check on the model" in core.forward.attention.why
    assert core.forward.impl.choice == "native" and core.forward.name.endswith("torch attention")
    core.add_request([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True))
    while core.has_work():  # and the engine serves
        core.step()


def test_a_pool_too_small_to_check_keeps_the_backend_and_claims_nothing():
    core = _core(_native(), num_blocks=8)
    if core.attention_backend not in INVARIANT_BACKENDS:
        pytest.skip("this CPU's kernels fail the batch-invariance check (see attention/invariant.py)")
    assert core.invariance_check.rows == 0 and "not checked" in core.invariance_check.detail
    assert not core.batch_invariant


def test_no_check_where_no_invariance_is_claimed():
    from batchserve.engine import EngineCore

    config = EngineConfig(model=ModelConfig(attention_backend="torch"), draft=DraftConfig(method="none"))
    core = EngineCore(config, make_tiny_model(), make_tiny_tokenizer())
    assert core.invariance_check is None and not core.batch_invariant
