"""Our bfloat16 kernel (KernelBf16Linear, csrc/bf16_gemm.cpp): the product against a brute-force
reference, the activations rounded as torch rounds them, both output dtypes and the bias, rows
bit-identical whatever the call's rows, their place and the thread count (on this CPU's path and,
on an AVX512-BF16 CPU, on the AVX-512F and AVX2 paths too), and the model choosing it for
bfloat16 weights where it builds (oneDNN's only behind its check where it does not)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from batchserve import kernels, native_build
from batchserve.model.bf16 import KernelBf16Linear, kernel_bf16_variance
from batchserve.model.layers import ROW_BUCKETS, MergedLinear
from batchserve.model.row_check import rows_variance
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}")

COUNTS = (*ROW_BUCKETS, 3, 5, 17, 33, 100)


def _linear(n: int, k: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
        if bias:
            linear.bias.copy_(torch.randn(n, generator=gen))
    return linear


def _reference(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The product of the bfloat16-rounded operands in float64 [T, N], and the sum of its terms'
    magnitudes [T, N]: a float32 sum in any order is within a few float32 ulps of that."""
    xb, wb = x.to(torch.bfloat16).double(), w.to(torch.bfloat16).double()
    return xb @ wb.T, xb.abs() @ wb.abs().T


# Where this CPU has AVX512-BF16, the same sources built without it (the AVX-512F path of Skylake-SP
# to Ice Lake) and without AVX-512 (the AVX2 path): the flags that turn each off.
VARIANTS = {"avx512": ("-mno-avx512bf16",), "avx2": ("-mno-avx512f",)}


def _variant(name: str) -> Any:
    """Our kernels built with VARIANTS[name] (cached beside this CPU's build)."""
    if "avx512_bf16" not in kernels.cpu_flags():
        pytest.skip("the other paths are checked on a CPU with AVX512-BF16")
    flags, cpu = (*kernels.FLAGS, *VARIANTS[name]), " ".join(sorted(kernels.cpu_flags())).encode()
    built = native_build.build(f"our kernels ({name})", "kernels", f"batchserve_cpu_{name}", kernels.SOURCES,
                               kernels.HEADERS, flags, cpu)  # fmt: skip
    return native_build.load(kernels.MODULE, built)


@pytest.fixture(params=["native", *VARIANTS])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """This CPU's build of our kernels, and the other paths where this CPU runs them all."""
    if request.param in VARIANTS:
        lib = _variant(request.param)
        monkeypatch.setattr(kernels, "_load", lambda: lib)
        assert kernels.bf16_columns() == (16 if request.param == "avx512" else 8)
    yield request.param


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("n", "k"), [(16, 32), (100, 255), (17, 33), (960, 576), (8, 1), (3, 2)])
def test_the_product_is_the_bf16_operands_product_summed_in_float32(path, n, k):
    layer, linear = KernelBf16Linear(_linear(n, k)), _linear(n, k)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 8, 13, 70):
        x = torch.randn(rows, k, generator=gen)
        with torch.no_grad():
            out = layer(x)  # [rows, n]
        exact, scale = _reference(x, linear.weight)
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        assert ((out.double() - exact).abs() <= 1e-5 * scale + 1e-30).all(), (rows, n, k)
    assert "our kernel" in repr(layer)


def test_activations_are_rounded_to_bfloat16_as_torch_rounds_them(path):
    # Ties both ways, values that round up into the next binade and to infinity, NaN, infinities;
    # each alone in its row times a one-hot weight column, in the vector body and the scalar tail.
    values = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, 1 + 2**-8 + 2**-20, 2 - 2**-9, 3.3961e38, 3.4e38, -1.5e-38]
    values += [float("inf"), -float("inf"), float("nan"), -7.0, 0.0]
    k = 19
    for col in (0, 5, 16, 18):
        weight = torch.zeros(1, k)
        weight[0, col] = 1.0
        layer = KernelBf16Linear(_as_linear(weight))
        x = torch.zeros(len(values), k)
        x[:, col] = torch.tensor(values)
        with torch.no_grad():
            out = layer(x)[:, 0]  # [len(values)]
        want = x[:, col].to(torch.bfloat16).float()
        assert bool(((out == want) | (out.isnan() & want.isnan())).all()), (col, out, want)


def _as_linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


def test_bfloat16_out_is_the_float32_sums_rounded_and_a_bias_is_added_in_float32(path):
    bare, biased = _linear(600, 200), _linear(600, 200, bias=True, seed=1)
    with torch.no_grad():
        biased.weight.copy_(bare.weight)
    x = torch.randn(9, 200, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        wide, narrow = KernelBf16Linear(bare)(x), KernelBf16Linear(bare, torch.bfloat16)(x)
        with_bias = KernelBf16Linear(biased, torch.bfloat16)(x)
    assert wide.dtype == torch.float32 and narrow.dtype == torch.bfloat16
    assert torch.equal(narrow, wide.to(torch.bfloat16))  # rounded once, to nearest even
    assert with_bias.dtype == torch.float32 and torch.equal(with_bias, wide + biased.bias)


def test_the_avx512f_and_avx2_paths_give_the_same_bits(monkeypatch):
    # Both widen a pair and add k = 2s, then 2s+1, with one FMA each: only the vector width differs.
    linear, outs = _linear(77, 301), []
    x = torch.randn(23, 301, generator=torch.Generator().manual_seed(5))
    for name in VARIANTS:
        lib = _variant(name)
        monkeypatch.setattr(kernels, "_load", lambda lib=lib: lib)
        with torch.no_grad():
            outs.append(KernelBf16Linear(linear)(x))
    assert torch.equal(outs[0], outs[1])


def test_a_merged_projection_keeps_its_sizes():
    merged = MergedLinear(64, (32, 16, 16), bias=False)
    layer = KernelBf16Linear(merged)
    assert layer.sizes == (32, 16, 16) and (layer.in_features, layer.out_features) == (64, 64)


@pytest.mark.parametrize(("n", "k"), [(133, 255), (600, 576)])
def test_a_row_has_the_same_bits_in_every_call_and_on_any_thread_count(path, threads, n, k):
    layer = KernelBf16Linear(_linear(n, k))
    x = torch.randn(ROW_BUCKETS[-1], k, generator=torch.Generator().manual_seed(3))
    outs = []
    for count in (1, 2):
        torch.set_num_threads(count)
        assert rows_variance(layer, x, COUNTS) is None
        with torch.no_grad():
            outs.append(layer(x[:100]))
    assert torch.equal(outs[0], outs[1])
    narrow = KernelBf16Linear(_linear(n, k), torch.bfloat16)
    assert rows_variance(narrow, x[:300], (1, 2, 3, 5, 17, 33, 100, 299)) is None
    assert kernel_bf16_variance() is None


def test_bfloat16_weights_run_on_our_kernel_where_it_builds():
    from batchserve.model import bf16_layer_class, bf16_products_here, choose_impl
    from batchserve.runner.forward import product_layers

    assert bf16_layer_class() is KernelBf16Linear and bf16_products_here()
    native = choose_impl(make_tiny_model(), "auto", cpu_weights="bfloat16")
    products = [m for m in native.modules() if isinstance(m, (nn.Linear, KernelBf16Linear))]
    assert products and all(type(m) is KernelBf16Linear for m in products)  # the LM head too
    assert product_layers(native) == ["KernelBf16Linear"]
    assert native.cpu_weights == "bfloat16" and native.batch_invariant_linears


def test_an_engine_on_bfloat16_weights_says_they_run_on_our_kernel_and_is_invariant():
    from batchserve import LLM, SamplingParams
    from tests.conftest import make_tiny_tokenizer

    llm = LLM(hf_model=make_tiny_model(), tokenizer=make_tiny_tokenizer(), cpu_weights="bfloat16", draft="none")
    forward = llm.engine.facts.forward
    assert forward.linear.choice == "KernelBf16Linear" and "our kernel" in forward.linear.why
    assert forward.name.startswith("native bfloat16 weights on our kernels")
    assert llm.engine.facts.batch_invariant, llm.engine.facts.invariance_why
    prompts = ["abc", "hello there", "x"]
    params = SamplingParams(max_new_tokens=8)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert [r.token_ids for r in llm.generate(prompts, params)] == alone


def test_without_our_kernels_bfloat16_falls_back_to_onednn_only_behind_its_check(monkeypatch):
    from batchserve.model import bf16_layer_class
    from batchserve.model.layers import Bf16Linear, bf16_prepack_available

    monkeypatch.setattr("batchserve.model.our_bf16_here", lambda: False)  # as without a compiler
    for verdict in (True, False):
        monkeypatch.setattr("batchserve.model.packed_products_invariant", lambda layer_class, v=verdict: v)
        assert bf16_layer_class() is (Bf16Linear if verdict and bf16_prepack_available() else None)
