"""The FlashInfer backend's CPU side: page tables and masks checked against the reference.

`emulate` reads a PagedPlan exactly as FlashInfer documents its inputs (CSR page table,
last-page lengths, per-request row-major masks) and attends densely; it must reproduce the
torch reference backend on the same pool.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from batchserve.attention import SeqLayout, StepLayout, TorchReferenceBackend, make_backend, resolve_backend
from batchserve.attention.flashinfer_backend import FlashInferBackend, PagedPlan, build_plan
from tests.attention.layouts import blocks_needed, random_step, slot_mapping


def emulate(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: PagedPlan, scale: float
) -> torch.Tensor:
    """q [T, Hq, D], pages [P, page_size, Hkv, D] -> [T, Hq, D]."""
    page_size = k_pages.shape[1]
    out = torch.empty_like(q)
    mask_offset = 0
    for i in range(len(plan.kv_last_page_len)):
        q0, q1 = plan.qo_indptr[i].item(), plan.qo_indptr[i + 1].item()
        pages = plan.kv_indices[plan.kv_indptr[i] : plan.kv_indptr[i + 1]].long()
        kv_len = (len(pages) - 1) * page_size + plan.kv_last_page_len[i].item()
        k = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:kv_len]  # [kv_len, Hkv, D]
        v = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:kv_len]
        n = (q1 - q0) * kv_len
        mask = plan.custom_mask[mask_offset : mask_offset + n].view(q1 - q0, kv_len)
        mask_offset += n
        o = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[q0:q1] = o.transpose(0, 1)
    assert mask_offset == len(plan.custom_mask)
    return out


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_plan_read_as_flashinfer_reads_it_matches_the_reference(block_size, num_heads, num_kv_heads, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    head_dim, layer = 16, 1
    num_blocks = blocks_needed((0, 1, 7, 33, 200, 517), block_size)
    ref = TorchReferenceBackend(2, num_blocks, block_size, num_kv_heads, head_dim)
    ref.k_cache.normal_()
    ref.v_cache.normal_()
    seqs = random_step(rng, block_size, num_blocks)
    total = sum(s.q_len for s in seqs)
    q = torch.randn(num_heads, total, head_dim)
    k = torch.randn(num_kv_heads, total, head_dim)
    v = torch.randn(num_kv_heads, total, head_dim)
    scale = head_dim**-0.5
    step = StepLayout.from_seqs(seqs)
    expected = ref.forward(layer, q, k, v, ref.build_metadata(step, slot_mapping(seqs, block_size)), scale)

    plan = build_plan(step, block_size)
    assert all(t.dtype == torch.int32 for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len))
    assert plan.qo_indptr[-1].item() == total
    assert ((plan.kv_last_page_len >= 1) & (plan.kv_last_page_len <= block_size)).all()
    assert len(plan.custom_mask) == sum(s.q_len * s.kv_len for s in seqs)
    # The backend writes the step's K/V before attending, as the reference just did.
    pages = (num_blocks, block_size, num_kv_heads, head_dim)
    k_pages, v_pages = (c[layer].transpose(0, 1).reshape(pages) for c in (ref.k_cache, ref.v_cache))
    got = emulate(q.transpose(0, 1), k_pages, v_pages, plan, scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def build_plan_of(seqs: list[SeqLayout], page_size: int) -> PagedPlan:
    return build_plan(StepLayout.from_seqs(seqs), page_size)


def test_plan_of_one_request_spells_out_its_pages_and_mask():
    # 5 cached + 1 chunk token + a 2-node chain: kv_len 8 over pages of 3 -> 3 pages, last holds 2.
    s = SeqLayout(q_start=0, q_len=3, num_cached=5, num_chunk=1, draft_parents=(None, 0), block_ids=(9, 4, 7, 2))
    plan = build_plan_of([s], page_size=3)
    assert plan.qo_indptr.tolist() == [0, 3] and plan.kv_indptr.tolist() == [0, 3]
    assert plan.kv_indices.tolist() == [9, 4, 7] and plan.kv_last_page_len.tolist() == [2]
    rows = plan.custom_mask.view(3, 8).int().tolist()
    assert rows == [
        [1, 1, 1, 1, 1, 1, 0, 0],  # the root sees the prefix and itself
        [1, 1, 1, 1, 1, 1, 1, 0],  # node 0: prefix, root, itself
        [1, 1, 1, 1, 1, 1, 1, 1],  # node 1: ... and its parent
    ]
    # Packed as FlashInfer's segment_packbits(bitorder="little") packs it: element j of a byte is bit j.
    assert plan.packed_mask.tolist() == [0b00111111, 0b01111111, 0b11111111]
    assert plan.mask_indptr.tolist() == [0, 3] and plan.mask_indptr.dtype == torch.int32
    bare = build_plan(StepLayout.from_seqs([s]), page_size=3, masked=False)  # for a wrapper that reads no mask
    assert bare.kv_indices.tolist() == [9, 4, 7] and bare.custom_mask.numel() == bare.packed_mask.numel() == 0


def test_plan_refuses_unpacked_rows_and_short_block_tables():
    a = SeqLayout(0, 2, 0, 2, (), (0,))
    with pytest.raises(ValueError, match="packed"):
        build_plan_of([a, SeqLayout(3, 1, 0, 1, (), (1,))], page_size=4)
    with pytest.raises(ValueError, match="pages"):
        build_plan_of([SeqLayout(0, 1, 8, 1, (), (0,))], page_size=4)


def test_auto_serves_attention_sinks_off_flashinfer_on_the_reference(monkeypatch):
    """FlashInfer's sinks come from its log-sum-exp (`add_sinks`), which only a device can compare
    with the reference's: on CUDA `auto` takes the torch reference for a model that has them, and
    `flashinfer` forced runs them (the choice alone: no GPU needed)."""
    import importlib.util

    from batchserve.attention import backend_choice

    find = importlib.util.find_spec
    installed = lambda name, *a: object() if name == "flashinfer" else find(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", installed)
    cuda = torch.device("cuda")
    assert backend_choice("auto", cuda, torch.bfloat16, head_dim=64)[0] == "flashinfer"
    name, why = backend_choice("auto", cuda, torch.bfloat16, head_dim=64, sinks=True)
    assert name == "torch" and "sinks" in why
    assert backend_choice("flashinfer", cuda, torch.bfloat16, head_dim=64, sinks=True)[0] == "flashinfer"


def test_backend_choice_on_this_machine():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, torch.float32) == "torch"
    assert resolve_backend("auto", cpu, torch.bfloat16) == "torch"
    assert resolve_backend("torch", cpu, torch.float32) == "torch"
    for bad in ("flashinfer",):
        with pytest.raises(ValueError, match="CUDA"):
            resolve_backend(bad, cpu, torch.float32)
    with pytest.raises(ValueError, match="one of"):
        resolve_backend("triton", cpu, torch.float32)
    backend = make_backend(
        "auto",
        num_layers=1,
        num_blocks=4,
        block_size=4,
        num_qo_heads=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=cpu,
    )
    assert isinstance(backend, TorchReferenceBackend) and backend.num_blocks == 4
    with pytest.raises(ValueError, match="CUDA"):
        FlashInferBackend(1, 4, 4, 4, 2, 8, torch.bfloat16, cpu)


def test_engine_refuses_a_forced_flashinfer_backend_without_cuda():
    from batchserve.config import EngineConfig, ModelConfig
    from batchserve.engine import EngineCore
    from tests.conftest import make_tiny_model, make_tiny_tokenizer

    with pytest.raises(ValueError, match="flashinfer"):
        EngineCore(
            EngineConfig(model=ModelConfig(attention_backend="flashinfer")), make_tiny_model(), make_tiny_tokenizer()
        )
    with pytest.raises(ValueError, match="attention_backend"):
        ModelConfig(attention_backend="triton")
    from batchserve import kernels
    from batchserve.attention import kernels_invariant

    core = EngineCore(EngineConfig(), make_tiny_model(), make_tiny_tokenizer())
    # The CPU choices: our kernel where it builds, the torch-op invariant one where it passes its check.
    expected = "kernel" if kernels.available() else ("invariant" if kernels_invariant() else "torch")
    assert core.facts.attention_backend == expected
    core = EngineCore(EngineConfig().with_settings(model_impl="transformers"), make_tiny_model(), make_tiny_tokenizer())
    assert core.facts.attention_backend == "torch"  # transformers' products are not batch-invariant: no need
