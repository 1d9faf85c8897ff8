"""oneDNN's linear kernel on CPU: switched on and off in place, same greedy choices."""

from __future__ import annotations

import pytest
import torch

from batchserve.model.layers import ROW_BUCKETS, row_bucket
from batchserve.runner.cpu_linear import OneDNNLinear, onednn_available, use_onednn_linear
from tests.conftest import make_tiny_model
from tests.rounding import assert_rounds_like, float64_logits

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")


@needs_onednn
def test_onednn_linear_switches_in_place_and_keeps_the_models_choices():
    model = make_tiny_model()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    exact, scale = float64_logits(model, ids.tolist())
    with torch.no_grad():
        plain = model(ids).logits
        weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert use_onednn_linear(model, "onednn") is True
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(type(m) is OneDNNLinear for m in linears)  # a layer class of its own
        assert [m.weight for m in linears] == weights  # over the same parameters (tied ones stay tied)
        fast = model(ids).logits
        # Two float32 orders of the same products: each held to the exact logits by what torch's is off.
        assert_rounds_like(fast[0], plain[0], exact, scale)
        assert torch.equal(fast.argmax(-1), plain.argmax(-1))
        assert use_onednn_linear(model, "torch") is False
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert all(type(m) is torch.nn.Linear for m in linears)  # torch's own layer again
        assert [m.weight for m in linears] == weights
        assert torch.equal(model(ids).logits, plain)


@needs_onednn
def test_auto_is_the_default_and_takes_onednn_for_a_float32_cpu_model():
    from batchserve.config import ModelConfig

    assert ModelConfig().cpu_linear == "auto"
    model = make_tiny_model()
    assert use_onednn_linear(model, "auto") is True
    assert all(type(m) is OneDNNLinear for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_onednn_linear_is_refused_where_it_cannot_run():
    half = make_tiny_model(dtype=torch.bfloat16)
    assert use_onednn_linear(half, "torch") is False
    assert use_onednn_linear(half, "auto") is False  # auto falls back to torch's kernels
    with pytest.raises(ValueError, match="float32"):
        use_onednn_linear(half, "onednn")
    with pytest.raises(ValueError, match="cpu_linear"):
        use_onednn_linear(half, "fast")


def test_rows_are_padded_to_few_buckets():
    assert [row_bucket(n) for n in (1, 2, 3, 5, 7, 9, 13, 33, 100, 513)] == [1, 2, 3, 6, 8, 10, 14, 40, 112, 640]
    assert all(row_bucket(n) <= n * 1.25 for n in range(3, ROW_BUCKETS[-1]))  # at most a quarter again as many rows
    assert row_bucket(5000) == 5000  # beyond the largest bucket: as it is


@needs_onednn
def test_the_linear_layer_calls_onednn_with_padded_rows_and_returns_the_real_ones(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    assert use_onednn_linear(model, "onednn")
    layer = model[0]
    real = torch.ops.mkldnn._linear_pointwise
    seen: list[int] = []

    class Spy:  # torch.ops.mkldnn's attributes are read-only ops: stand in for the namespace
        def _linear_pointwise(self, x, *args):
            seen.append(x.shape[-2])
            return real(x, *args)

    monkeypatch.setattr(torch.ops, "mkldnn", Spy())
    for rows in (1, 5, 7, 9, 100):
        x = torch.randn(1, rows, 8)
        out = layer(x)
        assert out.shape == (1, rows, 4)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert seen == [row_bucket(n) for n in (1, 5, 7, 9, 100)] == [1, 6, 8, 10, 112]


@needs_onednn
def test_every_linear_of_an_engine_step_runs_on_bucket_rows(monkeypatch):
    """The whole path: the runner switches the model to oneDNN by default, and each linear of
    each step (a prefill of 13 rows, then decode steps and the LM head's kept rows) reaches
    oneDNN with a bucket's row count, never the raw one."""
    from batchserve import SamplingParams
    from tests.conftest import tiny_llm

    llm = tiny_llm(None)
    assert llm.engine.runner.onednn_linear
    real = torch.ops.mkldnn._linear_pointwise
    seen: set[int] = set()

    class Spy:
        def _linear_pointwise(self, x, *args):
            seen.add(x.shape[-2])
            return real(x, *args)

    monkeypatch.setattr(torch.ops, "mkldnn", Spy())
    prompt = list(range(3, 16))  # 13 tokens: one prefill step of 13 rows, padded to 14
    out = llm.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert len(out.token_ids) == 12
    assert 14 in seen and 13 not in seen and seen <= set(ROW_BUCKETS), sorted(seen)
