"""FlashInfer planning without a host sync, on the CPU, through the double.

The mask is packed on the host as FlashInfer's `segment_packbits` packs it; every wrapper's kernels
(eager and graph-mode, padded with requests of no rows, per kind of layer) read back each request's
bool mask bit for bit at the byte offsets the backend writes over 0.7.2's bit offsets; plan() is
handed nothing it would block the host on; staging buffers are rewritten only after their event.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from batchserve.attention import LayerAttention, StepLayout
from batchserve.attention.base import StepBucket
from batchserve.attention.flashinfer_backend import PagedPlan, build_plan
from batchserve.attention.flashinfer_staging import PlanStaging, pack_masks
from tests.attention import flashinfer_double as fi
from tests.attention.layouts import blocks_needed, random_step, slot_mapping
from tests.attention.test_flashinfer_contract import HEAD_DIM, _decode_step, _host_plans, _paired  # noqa: F401

LAYERS = (LayerAttention(window=9, softcap=1.0), LayerAttention())  # a windowed mask, and the step's own


def test_pack_masks_packs_as_segment_packbits():
    rng = np.random.default_rng(0)
    for sizes in ([1], [8], [7, 9, 0, 16, 3], [0, 0], rng.integers(0, 300, 20).tolist()):
        bits = np.array(sizes, np.int64)
        mask = rng.random(int(bits.sum())) < 0.5  # [sum bits] bool
        packed, indptr = pack_masks(mask, bits)
        theirs, their_indptr = fi.segment_packbits(torch.from_numpy(mask), bits)
        assert packed.dtype == np.uint8 and indptr.dtype == np.int32
        assert packed.tolist() == theirs.tolist() and indptr.tolist() == their_indptr.tolist()


def _step(seed: int, block_size: int) -> tuple[Any, Any, StepLayout, torch.Tensor, int]:
    num_blocks = blocks_needed((0, 1, 7, 33, 200, 517), block_size)
    backend, ref = _paired(num_blocks, block_size, LAYERS)
    seqs = random_step(random.Random(seed), block_size, num_blocks)
    return backend, ref, StepLayout.from_seqs(seqs), slot_mapping(seqs, block_size), len(seqs)


def _read_back(wrapper: Any, plan: PagedPlan, page_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per request with rows: (the mask the double's kernel reads, the bool mask it was built from)."""
    q_len = plan.qo_indptr.diff().tolist()
    kv_len = ((plan.kv_indptr.diff() - 1) * page_size + plan.kv_last_page_len).tolist()
    out, offset = [], 0
    for i, (q, kv) in enumerate(zip(q_len, kv_len)):
        if q:
            want = plan.custom_mask[offset : offset + q * kv].view(q, kv).numpy()  # [q, kv] bool
            out.append((wrapper.mask(i, q, kv).numpy(), want))
        offset += q * kv
    assert offset == plan.custom_mask.numel()
    return out


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_wrapper_reads_the_bool_masks_bit_for_bit(block_size, seed):
    """Eager and in a tree bucket padded with requests of no rows, for a windowed layer and a plain
    one: request by request the kernel's mask is the bool mask; attention matches the reference."""
    backend, ref, step, slots, n = _step(seed, block_size)
    eager = backend.build_metadata(step, slots)
    bucket = StepBucket(step.num_tokens, n + 3, tree=True)  # 3 requests of no rows, then the bucket's own
    graphed = backend.plan(step, slots, bucket)
    for kind in LAYERS:
        for metadata, requests in ((eager, None), (graphed, bucket.requests + 1)):
            plan = build_plan(step, block_size, requests, window=kind.window)
            read = _read_back(metadata.wrappers[kind], plan, block_size)
            assert len(read) == n and all(np.array_equal(got, want) for got, want in read)
    assert fi.SYNCS == []
    q, k, v = (torch.randn(h, step.num_tokens, HEAD_DIM).bfloat16() for h in (4, 2, 2))
    ref_meta, scale = ref.build_metadata(step, slots), HEAD_DIM**-0.5
    for layer in (0, 1):
        expected = ref.forward(layer, q.float(), k.float(), v.float(), ref_meta, scale)
        for metadata in (eager, graphed):
            got = backend.forward(layer, q, k, v, metadata, scale)
            torch.testing.assert_close(got.float(), expected, rtol=2**-8, atol=1e-5)


def test_plan_is_handed_nothing_it_would_block_on(monkeypatch):
    """Pinned host indptrs, device page indices and packed mask, in eager mode and in both kinds of
    bucket; the double sees a regression (the page indices and mask left on the host)."""
    backend, _, step, slots, n = _step(3, 4)
    eager = backend.build_metadata(step, slots)
    backend.plan(step, slots, StepBucket(step.num_tokens, n, tree=True))
    backend.plan(_decode_step([(1, 2), (3,)], [5, 2]), torch.zeros(2, dtype=torch.long), StepBucket(2, 2, False))
    assert fi.SYNCS == []
    for wrapper in eager.wrappers.values():  # eager: the wrapper keeps the very device tensors it was handed
        assert fi._where(wrapper._paged_kv_indices_buf) == fi._where(wrapper._custom_mask_buf) == "device"
    monkeypatch.setattr(PlanStaging, "_on_device", PlanStaging._on_host)
    backend.plan(step, slots, StepBucket(step.num_tokens, n, tree=True))
    assert any("paged_kv_indices on the host" in s for s in fi.SYNCS)
    assert any("packed_custom_mask on the host" in s for s in fi.SYNCS)


def test_the_double_records_what_would_block_the_host():
    ws = torch.empty(16, dtype=torch.uint8)
    i32 = {"dtype": torch.int32}
    qo, kv, idx, last = (torch.tensor(a, **i32) for a in ([0, 2], [0, 1], [5], [2]))
    args = (4, 2, HEAD_DIM, 4)
    eager = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    eager.plan(qo, kv, idx, last, *args, custom_mask=torch.ones(4, dtype=torch.bool))
    device_indptrs = ("qo_indptr", "paged_kv_indptr", "paged_kv_last_page_len")  # none registered as host here
    assert fi.SYNCS == [
        "custom_mask: plan() packs it with segment_packbits, which reads indptr_new[-1].item()",
        *(f"{name} on the device: plan() reads it back with .to('cpu'), a blocking copy" for name in device_indptrs),
    ]
    fi.SYNCS.clear()
    fi.mark_host(qo, kv, last, pinned=True)
    fi.mark_host(idx)  # pageable
    eager.plan(qo, kv, idx, last, *args)
    assert fi.SYNCS == ["paged_kv_indices in pageable memory: plan()'s cudaMemcpyAsync from it may block"]
    fi.SYNCS.clear()
    bufs = [torch.zeros(k, **i32) for k in (2, 2, 1, 1)]
    graph = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", True, *bufs, backend="fa2")
    fi.mark_host(idx, pinned=True)
    graph.plan(qo, kv, idx, last, *args, non_blocking=False)
    assert fi.SYNCS == [
        "non_blocking=False: every copy plan() makes is a blocking one",
        "paged_kv_indices on the host: graph-mode plan() copies it with non_blocking=False",
    ]


def test_without_byte_offsets_flashinfer_reads_the_wrong_masks(monkeypatch):
    """0.7.2 leaves bit offsets for a packed mask: past the first request every mask is misread
    (eager: past the end of the packed mask; in a bucket's larger buffer: other bits)."""
    with pytest.raises(RuntimeError, match="_mask_indptr_buf"):  # a FlashInfer that keeps them elsewhere
        PlanStaging(torch.device("cpu")).fix_mask_offsets(object())
    monkeypatch.setattr(PlanStaging, "fix_mask_offsets", lambda self, wrapper: None)
    backend, _, step, slots, n = _step(0, 4)
    eager = backend.build_metadata(step, slots)
    with pytest.raises(fi.ContractError, match="run past"):
        _read_back(eager.wrappers[LAYERS[1]], build_plan(step, 4), 4)
    graphed = backend.plan(step, slots, StepBucket(step.num_tokens, n, tree=True))
    read = _read_back(graphed.wrappers[LAYERS[1]], build_plan(step, 4, n + 1), 4)
    assert np.array_equal(*read[0]) and not all(np.array_equal(got, want) for got, want in read[1:])


class _Recorder:
    """An event that logs when it is waited on and recorded, and its staging's host writes."""

    def __init__(self, device: torch.device) -> None:
        self.log: list[str] = []
        EVENTS.append(self)

    def record(self) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("wait")


EVENTS: list[_Recorder] = []


def test_staging_is_rewritten_only_after_its_event(monkeypatch):
    """Each wrapper's host buffers: waited for, written, then the event recorded after plan(), step
    after step; the same buffers reused once grown."""
    import batchserve.attention.flashinfer_staging as staging

    EVENTS.clear()
    monkeypatch.setattr(staging, "make_event", _Recorder)
    on_host = PlanStaging._on_host

    def logged(self: PlanStaging, name: str, src: torch.Tensor) -> torch.Tensor:
        self.event.log.append("write")
        return on_host(self, name, src)

    monkeypatch.setattr(PlanStaging, "_on_host", logged)
    backend, _, step, slots, _ = _step(1, 16)
    backend.build_metadata(step, slots)
    before = {k: v._host["qo_indptr"].data_ptr() for k, v in backend._staging.items()}
    backend.build_metadata(step, slots)
    assert {k: v._host["qo_indptr"].data_ptr() for k, v in backend._staging.items()} == before
    assert len(EVENTS) == len(LAYERS)
    for event in EVENTS:
        collapsed = [e for i, e in enumerate(event.log) if i == 0 or e != event.log[i - 1]]
        assert collapsed == ["wait", "write", "record"] * 2, event.log
