"""A sparse layer's router on our kernels (`moe.KernelRouter`, `KernelSparseMoE._route`,
csrc/router.cpp): the float32 product near torch's, the routing `Routing.route`'s rules (the same
experts, their weights near), and each row's bits its own alone or among any others, at any thread
count."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from batchserve import kernels
from batchserve.model.moe import KernelRouter, Routing

pytestmark = pytest.mark.skipif(not kernels.available(), reason="our kernels do not build here")


def _each_thread_count(check: Callable[[], None]) -> None:
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            check()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("hidden", "bias"), [(256, False), (2880, True), (72, False)])  # 72: not a multiple of 32
def test_the_router_product_is_torchs_within_rounding_and_each_rows_own(hidden, bias):
    gen = torch.Generator().manual_seed(hidden)
    weight = torch.randn(33, hidden, generator=gen)  # 32 experts and a shared expert's gate
    b = torch.randn(33, generator=gen) if bias else None
    router = KernelRouter(weight, b, (32, 1))
    x = torch.randn(40, hidden, generator=gen)
    got = router(x)
    want = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * hidden**0.5)

    def rows_alone() -> None:
        for rows in (1, 2, 9):
            assert torch.equal(router(x[:rows]), got[:rows]), rows

    _each_thread_count(rows_alone)


@pytest.mark.parametrize(
    "rules",
    [
        dict(softmax_first=True, renormalize=True),  # Qwen3-MoE, Mixtral, OLMoE with norm_topk_prob
        dict(softmax_first=True, renormalize=False),  # Qwen2-MoE
        dict(softmax_first=False, renormalize=False),  # gpt-oss: top k of the logits, then their softmax
    ],
)
def test_the_routing_kernel_takes_routings_experts_with_its_weights(rules):
    routing = Routing(experts=16, top_k=4, intermediate=8, shared_intermediate=None, sparse_step=1, dense_layers=(),
                      **rules)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 17, generator=gen) * 3  # a shared expert's logit last: never routed to
    logits[5, 2] = logits[5, 9] = logits[5, 11] = logits[5, 14] = logits[5, 0] = 40.0  # five equal: the lower four
    logits[6, :16] = 0.5  # every expert equal
    want_w, want_ids = routing.route(logits[:, :16])
    got_w, got_ids = kernels.moe_route(logits, 16, 4, routing.softmax_first, routing.renormalize)
    assert torch.equal(got_ids, want_ids)
    assert got_ids[5].tolist() == [0, 2, 9, 11] and got_ids[6].tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    assert (got_ids < 16).all()

    def rows_alone() -> None:
        for rows in (1, 3, 7):
            w, ids = kernels.moe_route(logits[:rows].contiguous(), 16, 4, routing.softmax_first, routing.renormalize)
            assert torch.equal(w, got_w[:rows]) and torch.equal(ids, got_ids[:rows]), rows

    _each_thread_count(rows_alone)
