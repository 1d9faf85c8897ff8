"""The layer-by-layer start-up check: every row-wise layer at every row count the engine runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchserve import SamplingParams
from batchserve.admission import Submission
from batchserve.model.layers import ROW_BUCKETS
from batchserve.runner.build import StartupCheckFailed
from batchserve.runner.layer_check import CHUNK_SIZES, check_layers, row_counts, row_layers
from tests.runner.products import TILE, PerRow, core_of, native, per_row, swap, tiling


def test_row_counts_are_the_buckets_and_chunk_sizes_up_to_the_budget():
    counts = row_counts(100)
    assert set(counts) == {c for c in (*ROW_BUCKETS, *CHUNK_SIZES) if c <= 100} | {99}
    assert counts == tuple(sorted(counts)) and counts[-1] == 100
    assert row_counts(1) == (1,)


def test_every_row_wise_layer_is_checked_in_the_models_order():
    model = per_row()
    names = [layer.name for layer in row_layers(model, model.config.intermediate_size)]
    assert names[0] == "layers.0.self_attn.qkv_proj" and names[-1] == "lm_head"
    assert {"layers.1.mlp.act", "layers.1.mlp.down_proj", "layers.1.input_layernorm", "norm"} <= set(names)
    verdict = check_layers(model, max_rows=64, max_kept_rows=40)
    assert verdict.invariant and verdict.detail == "" and verdict.layers == len(names)
    assert verdict.counts == len(row_counts(64))


def test_a_product_that_tiles_rows_fails_and_is_named():
    model = tiling(per_row(), "layers.1.mlp.down_proj")
    verdict = check_layers(model, max_rows=64, max_kept_rows=40)
    assert not verdict.invariant
    assert verdict.detail.startswith("layer layers.1.mlp.down_proj (TilesRows, 128 -> 64, float32 out): a call of ")
    assert "differ from a call of 64" in verdict.detail
    # Row 0 of every call of a tile or more agrees: a check of row 0 alone would pass it there.
    x = torch.randn(64, 128)
    layer = model.get_submodule("layers.1.mlp.down_proj")
    with torch.no_grad():
        whole = layer(x)
        assert all(torch.equal(layer(x[:n])[0], whole[0]) for n in (16, 17, 33, 40))


def test_a_head_that_tiles_rows_is_checked_up_to_the_kept_rows_only():
    model = tiling(per_row(), "lm_head")
    assert check_layers(model, max_rows=64, max_kept_rows=TILE - 1).invariant  # no call of a whole tile
    verdict = check_layers(model, max_rows=64, max_kept_rows=40)
    assert not verdict.invariant and verdict.detail.startswith("layer lm_head (TilesRows")


def test_a_failed_check_of_a_claimed_invariance_never_serves():
    """The invariant attention claims it: a layer that breaks it stops the engine, named."""
    with pytest.raises(StartupCheckFailed, match=r"batch invariance does not hold\): layer layers.0.self_attn.o_proj"):
        core_of(tiling(per_row(), "layers.0.self_attn.o_proj"))
    core = core_of(per_row())  # the same model with that layer invariant serves
    core.add_request(Submission([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True)))
    while core.has_work():
        core.step()


class NaNAfter(nn.Module):
    """A product whose outputs turn NaN from row `first` of a call on (a dequantized fallback gone
    wrong on some activations): finite for the first rows, as a one-row probe would see it."""

    def __init__(self, linear: nn.Module, first: int = 0) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.inner, self.first = linear, first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.inner(row) for row in x.split(1)])  # [T, out]
        y[self.first :] = float("nan")
        return y


def test_a_layer_with_nan_outputs_is_named_and_never_serves():
    model = per_row()
    swap(model, "layers.1.mlp.gate_up_proj", NaNAfter)
    verdict = check_layers(model, max_rows=64, max_kept_rows=40)
    assert not verdict.invariant and not verdict.finite
    assert verdict.detail.startswith("layer layers.1.mlp.gate_up_proj (NaNAfter): NaN or Inf")
    with pytest.raises(StartupCheckFailed, match=r"NaN or Inf outputs\): layer layers.1.mlp.gate_up_proj"):
        core_of(model)


def test_nan_logits_never_serve_claimed_or_not():
    """Every row-wise layer finite on random inputs, but the model's logits NaN on real tokens (an
    embedding row gone wrong): refused where invariance is claimed and where auto claims nothing
    (the products' probe failed, the torch attention runs), though a variant layer is only reported
    there."""
    model = tiling(per_row(), "layers.1.self_attn.qkv_proj")
    model.batch_invariant_linears = False
    assert core_of(model).facts.attention_backend == "torch"  # reported, served
    for claimed in (True, False):
        model = per_row()
        model.batch_invariant_linears = claimed
        with torch.no_grad():
            model.embed_tokens.weight[:] = float("nan")
        with pytest.raises(StartupCheckFailed, match=r"NaN or Inf outputs\): the model's logits are not finite"):
            core_of(model)


def test_the_check_runs_where_auto_chose_no_invariant_attention_and_names_the_layer(monkeypatch):
    """Where the products' probe fails, auto takes the torch attention (no claim): the check runs
    anyway, to say which layer is to blame."""
    model = tiling(per_row(), "layers.1.self_attn.qkv_proj")
    model.batch_invariant_linears = False  # as where oneDNN's probe failed
    core = core_of(model)
    assert core.facts.attention_backend == "torch" and not core.facts.batch_invariant
    assert core.facts.invariance_why.startswith("layer layers.1.self_attn.qkv_proj (TilesRows")


@pytest.mark.parametrize("threads", [1, 2])
def test_a_pass_on_the_shipped_layers_means_every_row_agrees(threads):
    """The shipped products are third-party kernels (oneDNN): asserted through the verdict only.
    Where it says invariant, every layer's rows agree in calls the check did not make too."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = native()
        verdict = check_layers(model, max_rows=96, max_kept_rows=48)
        if not verdict.invariant:
            assert verdict.detail.startswith("layer ") and "differ" in verdict.detail
            pytest.skip(f"not invariant on this CPU, and the check says so: {verdict.detail}")
        gen = torch.Generator().manual_seed(7)
        for layer in row_layers(model, model.config.intermediate_size):
            x = torch.randn(96 if not layer.head else 48, layer.width, generator=gen)
            with torch.no_grad():
                whole = layer.call(x)
                for start, n in ((1, 11), (9, 30), (20, 27)):
                    assert torch.equal(layer.call(x[start : start + n]), whole[start : start + n]), layer.name
    finally:
        torch.set_num_threads(before)


def test_a_block_product_is_checked_per_mix_of_types_up_to_the_rows_its_tiles_need(monkeypatch):
    from gguf import GGMLQuantizationType as T
    from torch import nn

    from batchserve import kernels
    from batchserve.model.blocks import BlockLinear, BlockPart, random_blocks
    from batchserve.runner import layer_check

    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    gen = torch.Generator().manual_seed(0)

    def block(qtype: int) -> BlockLinear:
        return BlockLinear([BlockPart(random_blocks(qtype, 24, 256, gen), qtype, 256)])

    model = nn.Module()
    model.q4k, model.q6k, model.again = block(T.Q4_K), block(T.Q6_K), block(T.Q4_K)
    model.plain = PerRow(nn.Linear(256, 24))  # no `check_rows`: up to the step's budget
    calls: list[tuple[int, tuple[int, ...]]] = []
    real = layer_check.rows_variance

    def spy(call, x, wanted):
        calls.append((x.shape[0], wanted))
        return real(call, x, wanted)

    monkeypatch.setattr(layer_check, "rows_variance", spy)
    kinds = [layer.kind for layer in row_layers(model)]
    assert kinds[0] == ("BlockLinear[Q4_K]", 256, 24, "float32") and kinds[1][0] == "BlockLinear[Q6_K]"
    verdict = check_layers(model, max_rows=512, max_kept_rows=16)
    assert verdict.invariant and verdict.layers == 4
    # Each type's first product at every count up to 64; the second Q4_K one spot-checked; the
    # other product up to the budget.
    assert calls == [(64, row_counts(64)), (64, row_counts(64)), (64, (1, 3, 17)), (512, row_counts(512))]
