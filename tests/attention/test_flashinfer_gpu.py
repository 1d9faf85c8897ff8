"""FlashInfer against the torch reference on a GPU (skipped without CUDA and flashinfer-python)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from batchserve.attention import StepLayout, TorchReferenceBackend
from tests.attention.layouts import blocks_needed, random_step, slot_mapping

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and importlib.util.find_spec("flashinfer")),
        reason="needs CUDA and flashinfer-python",
    ),
]

CACHED = (0, 1, 100, 1000, 4000)  # KV lengths from 1 to about 4k


# scripts/gpu_check.sh runs bf16 at head dim 64 only (`-k "bf16 and hd64"`: what the engine runs;
# each other dtype and head dim is one more module FlashInfer builds with nvcc on first use).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["hd64", "hd128"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 8), (12, 4), (32, 4)])  # GQA 1, 3, 8
@pytest.mark.parametrize("block_size", [1, 16])
def test_flashinfer_matches_the_reference(block_size, num_heads, num_kv_heads, head_dim, dtype):
    from batchserve.attention.flashinfer_backend import FlashInferBackend

    rng = random.Random(block_size * 1000 + num_heads + head_dim)
    torch.manual_seed(0)
    dev, layer = torch.device("cuda"), 1
    num_blocks = blocks_needed(CACHED, block_size)
    ref = TorchReferenceBackend(2, num_blocks, block_size, num_kv_heads, head_dim, torch.float32, dev)
    fi = FlashInferBackend(2, num_blocks, block_size, num_heads, num_kv_heads, head_dim, dtype, dev)
    _same_pools(ref, fi, dtype)

    seqs = random_step(rng, block_size, num_blocks, CACHED)
    total = sum(s.q_len for s in seqs)
    q, k, v = (
        torch.randn(1, h, total, head_dim, device=dev).to(dtype) for h in (num_heads, num_kv_heads, num_kv_heads)
    )
    slots = slot_mapping(seqs, block_size)
    scale = head_dim**-0.5
    step = StepLayout.from_seqs(seqs)
    # The backends take the packed rows [heads, T, D] and return [T, Hq, D]; [None] adds the batch dimension back.
    ref_meta = ref.build_metadata(step, slots)
    expected = ref.forward(layer, q[0].float(), k[0].float(), v[0].float(), ref_meta, scale)[None]
    got = fi.forward(layer, q[0], k[0], v[0], fi.build_metadata(step, slots), scale)[None]
    assert got.shape == expected.shape == (1, total, num_heads, head_dim)
    rel = ((got.float() - expected).norm() / expected.norm()).item()
    assert rel < 1e-2, rel
    # Per row too: no request may be silently wrong while the total looks fine.
    row_err = (got.float() - expected).flatten(2).norm(dim=-1) / expected.flatten(2).norm(dim=-1)
    assert row_err.max().item() < 5e-2
    # The step's K/V landed where the reference put them.
    torch.testing.assert_close(
        fi.k_cache[layer].view(-1, num_kv_heads, head_dim)[slots].float(), k[0].transpose(0, 1).float()
    )


def test_copy_slots_moves_every_layer():
    from batchserve.attention.flashinfer_backend import FlashInferBackend

    fi = FlashInferBackend(3, 8, 4, 4, 2, 64, torch.bfloat16, torch.device("cuda"))
    fi.k_cache.normal_()
    fi.v_cache.normal_()
    before = [c.view(3, -1, 2, 64).clone() for c in (fi.k_cache, fi.v_cache)]
    fi.copy_slots(torch.tensor([5, 6]), torch.tensor([1, 2]))
    for cache, old in zip((fi.k_cache, fi.v_cache), before):
        after = cache.view(3, -1, 2, 64)
        torch.testing.assert_close(after[:, [1, 2]], old[:, [5, 6]])
        torch.testing.assert_close(after[:, 3:], old[:, 3:])


# In the GPU check's `-k "bf16 and hd64"`: FlashInfer's window (a tree step's in its mask, a
# decode bucket's as `window_left`) and `logits_soft_cap`, one wrapper per kind of layer.
@pytest.mark.parametrize("block_size", [1, 16])
def test_windows_and_soft_caps_match_the_reference_bf16_hd64(block_size):
    from batchserve.attention import LayerAttention
    from batchserve.attention.base import StepBucket

    dtype, head_dim, dev = torch.bfloat16, 64, torch.device("cuda")
    layers = (LayerAttention(window=37, softcap=30.0), LayerAttention(), LayerAttention(window=300))
    ref, fi, seqs = _cuda_pair(block_size, 1, block_size, layers)
    step, slots, total = StepLayout.from_seqs(seqs), slot_mapping(seqs, block_size), sum(s.q_len for s in seqs)
    q, k, v = (torch.randn(h, total, head_dim, device=dev).to(dtype) for h in (12, 4, 4))
    ref_meta, fi_meta = ref.build_metadata(step, slots), fi.build_metadata(step, slots)
    for layer in range(3):
        want = ref.forward(layer, q.float(), k.float(), v.float(), ref_meta, head_dim**-0.5)
        got = fi.forward(layer, q, k, v, fi_meta, head_dim**-0.5)
        _close_rows(got, want)
    # A decode bucket (one row a request, no mask): the window is FlashInfer's window_left.
    roots = [dataclasses.replace(s, q_start=j) for j, s in enumerate(x for x in seqs if x.q_len == 1)]
    assert roots, "random_step always holds a lone root"
    decode, rows = StepLayout.from_seqs(roots), slot_mapping(roots, block_size)
    qd, kd, vd = (torch.randn(h, len(roots), head_dim, device=dev).to(dtype) for h in (12, 4, 4))
    fi_meta = fi.plan(decode, rows.to(dev), StepBucket(len(roots), len(roots), tree=False))
    ref_meta = ref.build_metadata(decode, rows)
    want = ref.forward(0, qd.float(), kd.float(), vd.float(), ref_meta, head_dim**-0.5)
    got = fi.forward(0, qd, kd, vd, fi_meta, head_dim**-0.5)
    _close_rows(got, want)
    # A step without drafts, eager (prompt chunks beside decodes): FlashInfer's causal mode, no mask.
    plain, start = [], 0
    for s in seqs:
        if s.draft_parents or s.window != (0, 0):
            continue
        plain.append(dataclasses.replace(s, q_start=start))
        start += s.q_len
    causal, rows = StepLayout.from_seqs(plain), slot_mapping(plain, block_size)
    assert causal.causal and max(s.q_len for s in plain) > 1, "random_step always holds a chunk and a root"
    qc, kc, vc = (torch.randn(h, start, head_dim, device=dev).to(dtype) for h in (12, 4, 4))
    fi_meta, ref_meta = fi.build_metadata(causal, rows.to(dev)), ref.build_metadata(causal, rows)
    for layer in range(3):
        want = ref.forward(layer, qc.float(), kc.float(), vc.float(), ref_meta, head_dim**-0.5)
        _close_rows(fi.forward(layer, qc, kc, vc, fi_meta, head_dim**-0.5), want)


# In the GPU check's `-k "bf16 and hd64"`: gpt-oss's sinks, added from the base-2 log-sum-exp the
# kernel returns (`add_sinks`), on the modules the test above builds (plain; window with soft-cap).
def test_attention_sinks_match_the_reference_bf16_hd64():
    from batchserve.attention import LayerAttention
    from batchserve.attention.base import StepBucket

    dtype, head_dim, dev = torch.bfloat16, 64, torch.device("cuda")
    sinks = tuple(float(x) for x in torch.linspace(-2.0, 4.0, 12))
    layers = (LayerAttention(sinks=sinks), LayerAttention(window=37, softcap=30.0, sinks=sinks[::-1]))
    ref, fi, seqs = _cuda_pair(16, 2, 16, layers)
    step, slots, total = StepLayout.from_seqs(seqs), slot_mapping(seqs, 16), sum(s.q_len for s in seqs)
    q, k, v = (torch.randn(h, total, head_dim, device=dev).to(dtype) for h in (12, 4, 4))
    ref_meta, fi_meta = ref.build_metadata(step, slots), fi.build_metadata(step, slots)
    for layer in range(2):
        want = ref.forward(layer, q.float(), k.float(), v.float(), ref_meta, head_dim**-0.5)
        _close_rows(fi.forward(layer, q, k, v, fi_meta, head_dim**-0.5), want)
    roots = [dataclasses.replace(s, q_start=j) for j, s in enumerate(x for x in seqs if x.q_len == 1)]
    decode, rows = StepLayout.from_seqs(roots), slot_mapping(roots, 16)
    qd, kd, vd = (torch.randn(h, len(roots), head_dim, device=dev).to(dtype) for h in (12, 4, 4))
    fi_meta = fi.plan(decode, rows.to(dev), StepBucket(len(roots), len(roots), tree=False))
    ref_meta = ref.build_metadata(decode, rows)
    for layer in range(2):
        want = ref.forward(layer, qd.float(), kd.float(), vd.float(), ref_meta, head_dim**-0.5)
        _close_rows(fi.forward(layer, qd, kd, vd, fi_meta, head_dim**-0.5), want)


def _cuda_pair(seed: int, torch_seed: int, block_size: int, layers: tuple[Any, ...]) -> tuple[Any, Any, list[Any]]:
    """The float32 reference and FlashInfer (bf16, head dim 64, 12/4 heads) on the same random pool,
    both told `layers`, and a random step's requests over it."""
    from batchserve.attention.flashinfer_backend import FlashInferBackend

    rng, dtype, dev = random.Random(seed), torch.bfloat16, torch.device("cuda")
    torch.manual_seed(torch_seed)
    num_blocks = blocks_needed(CACHED, block_size)
    ref = TorchReferenceBackend(len(layers), num_blocks, block_size, 4, 64, torch.float32, dev)
    fi = FlashInferBackend(len(layers), num_blocks, block_size, 12, 4, 64, dtype, dev, max_model_len=8192)
    ref.set_layers(layers)
    fi.set_layers(layers)
    _same_pools(ref, fi, dtype)
    return ref, fi, random_step(rng, block_size, num_blocks, CACHED)


def _same_pools(ref: TorchReferenceBackend, fi: Any, dtype: torch.dtype) -> None:
    """Random pool contents, rounded to the kernel's dtype so only the kernel's arithmetic differs.
    The reference is head-major [L, Hkv, slots, D]; FlashInfer's pages are [L, pages, page, Hkv, D]."""
    ref.k_cache.normal_()
    ref.v_cache.normal_()
    ref.k_cache.copy_(ref.k_cache.to(dtype))
    ref.v_cache.copy_(ref.v_cache.to(dtype))
    fi.k_cache.copy_(ref.k_cache.transpose(1, 2).reshape(fi.k_cache.shape))
    fi.v_cache.copy_(ref.v_cache.transpose(1, 2).reshape(fi.v_cache.shape))


def _close_rows(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 attention against float32's, [T, Hq, D]: as close as the plain test holds it, row by row."""
    err = (got.float() - want).flatten(1).norm(dim=-1) / want.flatten(1).norm(dim=-1)
    assert err.max().item() < 5e-2, err.max().item()


@contextlib.contextmanager
def _syncs_raise() -> Iterator[None]:
    """torch's sync debug mode: a stream sync made through torch (`.item()`, a blocking copy between
    host and device) raises "called a synchronizing CUDA operation". Not seen: syncs inside
    FlashInfer's C++ and `Event.synchronize` (the staging's deliberate wait, normally long done)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


# In the GPU check's `-k "bf16 and hd64"`: sync debug mode sees only syncs made through torch; a
# copy from pageable host memory inside FlashInfer's plan() (its sequence lengths, computed on the
# host) may wait for the stream without it. So plan() is timed behind a kernel that keeps the
# device busy for about a second: a plan that waited for the stream would take that long.
def test_plans_do_not_wait_for_the_device_bf16_hd64():
    from batchserve.attention import LayerAttention
    from batchserve.attention.base import StepBucket

    dev = torch.device("cuda")
    layers = (LayerAttention(window=37), LayerAttention())
    _, fi, seqs = _cuda_pair(26, 2, 16, layers)
    step, slots = StepLayout.from_seqs(seqs), slot_mapping(seqs, 16).to(dev)
    bucket = StepBucket(step.num_tokens, len(seqs) + 2, tree=True)
    for _ in range(2):  # modules built, buffers allocated
        fi.build_metadata(step, slots)
        fi.plan(step, slots, bucket)
    torch.cuda.synchronize()
    busy = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    busy[0].record()
    torch.cuda._sleep(2_000_000_000)  # about a second of device time at 1.5-2 GHz
    busy[1].record()
    t = time.perf_counter()
    fi.build_metadata(step, slots)
    fi.plan(step, slots, bucket)
    planned = time.perf_counter() - t
    torch.cuda.synchronize()
    slept = busy[0].elapsed_time(busy[1]) / 1000
    assert slept > 0.3 and planned < slept / 4, (planned, slept)


# In the GPU check's `-k "bf16 and hd64"`: the mask packed on the host against FlashInfer's own
# packing, the byte offsets each wrapper's kernels read, plan() without a host sync, and attention.
@pytest.mark.parametrize("block_size", [1, 16])
def test_plans_pack_as_flashinfer_and_never_sync_bf16_hd64(block_size):
    from flashinfer.quantization import segment_packbits

    from batchserve.attention import LayerAttention
    from batchserve.attention.base import StepBucket
    from batchserve.attention.flashinfer_backend import build_plan

    dtype, head_dim, dev = torch.bfloat16, 64, torch.device("cuda")
    layers = (LayerAttention(window=37), LayerAttention())
    ref, fi, seqs = _cuda_pair(10 + block_size, 2, block_size, layers)
    step, slots = StepLayout.from_seqs(seqs), slot_mapping(seqs, block_size)
    bucket = StepBucket(step.num_tokens, len(seqs) + 2, tree=True)  # 2 requests of no rows + the bucket's own
    with _syncs_raise(), pytest.raises(RuntimeError, match="synchronizing"):  # the check sees a blocking copy
        torch.zeros(4, device=dev).copy_(torch.ones(4))
    for _ in range(2):  # the first plans build modules and allocate; later ones reuse them
        fi.build_metadata(step, slots.to(dev))
        fi.plan(step, slots.to(dev), bucket)
    torch.cuda.synchronize()
    device_slots = slots.to(dev)
    with _syncs_raise():
        eager, graphed = fi.build_metadata(step, device_slots), fi.plan(step, device_slots, bucket)
    torch.cuda.synchronize()
    for kind in layers:
        for metadata, requests in ((eager, None), (graphed, bucket.requests + 1)):
            plan = build_plan(step, block_size, requests, window=kind.window)
            kv_len = (plan.kv_indptr.diff() - 1) * block_size + plan.kv_last_page_len  # [B]
            bits = torch.zeros(len(kv_len) + 1, dtype=torch.int32)
            bits[1:] = torch.cumsum(plan.qo_indptr.diff() * kv_len, 0)
            mask = plan.custom_mask.to(dev)
            with _syncs_raise(), pytest.raises(RuntimeError, match="synchronizing"):  # its indptr_new[-1].item()
                segment_packbits(mask, bits.to(dev), bitorder="little")
            theirs, offsets = segment_packbits(mask, bits.to(dev), bitorder="little")
            assert torch.equal(plan.packed_mask.to(dev), theirs) and torch.equal(plan.mask_indptr.to(dev), offsets)
            wrapper = metadata.wrappers[kind]  # what its kernels read: the same bytes, at byte offsets
            assert torch.equal(wrapper._mask_indptr_buf, offsets)
            assert torch.equal(wrapper._custom_mask_buf[: len(theirs)], theirs)
    q, k, v = (torch.randn(h, step.num_tokens, head_dim, device=dev).to(dtype) for h in (12, 4, 4))
    ref_meta = ref.build_metadata(step, slots)
    for layer in range(2):
        want = ref.forward(layer, q.float(), k.float(), v.float(), ref_meta, head_dim**-0.5)
        for metadata in (eager, graphed):
            _close_rows(fi.forward(layer, q, k, v, metadata, head_dim**-0.5), want)
