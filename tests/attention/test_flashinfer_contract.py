"""The FlashInfer backend against a double that enforces FlashInfer's contract, on the CPU.

`flashinfer_double` refuses what the real wrapper refuses (a host mask where plan() packs it with
a CUDA kernel, index arrays that are not int32, graph buffers too small for a plan, a batch size
that changes in graph mode, a run without a plan), records what would block the host in plan(), and
attends from what the kernels would read.
The backend's eager steps and its bucketed (graph) steps run through it here, down to the engine
with `cuda_graphs=eager`, so none of these can come back unnoticed without a GPU. Where the
double and the real library can disagree is written in the double's docstring.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
import torch

from batchserve import SamplingParams
from batchserve.admission import Submission
from batchserve.attention import LayerAttention, StepLayout, TorchReferenceBackend
from batchserve.attention import flashinfer_staging as staging
from batchserve.attention.base import StepBucket
from batchserve.attention.flashinfer_backend import FlashInferBackend, PagedPlan, build_plan
from tests.attention import flashinfer_double as fi
from tests.attention.layouts import blocks_needed, random_step, slot_mapping
from tests.conftest import TINY_VOCAB, make_tiny_fa2_model, make_tiny_tokenizer
from tests.engine.drafters import RandomTreeDrafter

HEAD_DIM = 64  # FA2's smallest


@pytest.fixture(autouse=True)
def _host_plans(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every plan the backend builds on the host is registered as host memory with the double, its
    staging buffers as pinned host memory (what they are on CUDA)."""
    import batchserve.attention.flashinfer_backend as backend_module

    def registered(*args: Any, **kwargs: Any) -> Any:
        plan = build_plan(*args, **kwargs)
        fi.mark_host(*(getattr(plan, f) for f in PagedPlan.__dataclass_fields__))
        return plan

    allocate = staging.host_buffer

    def pinned(*args: Any) -> torch.Tensor:
        buf = allocate(*args)
        fi.mark_host(buf, pinned=True)
        return buf

    monkeypatch.setattr(backend_module, "build_plan", registered)
    monkeypatch.setattr(staging, "host_buffer", pinned)
    fi.forget_host()
    yield
    fi.forget_host()
    fi.RUNS_PER_PLAN[0] = 1 << 30


def _backend(num_blocks: int, block_size: int, num_qo_heads: int = 4, num_kv_heads: int = 2, **kw: Any) -> Any:
    return FlashInferBackend(
        2, num_blocks, block_size, num_qo_heads, num_kv_heads, HEAD_DIM, torch.bfloat16, "cpu", library=fi, **kw
    )


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_an_eager_step_through_the_double_attends_as_the_reference(block_size, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = blocks_needed((0, 1, 7, 33, 200, 517), block_size)
    backend = _backend(num_blocks, block_size, max_model_len=1024)
    ref = TorchReferenceBackend(2, num_blocks, block_size, 2, HEAD_DIM)  # float32, on bf16 values
    backend.k_cache.normal_()
    backend.v_cache.normal_()
    pages = (num_blocks, block_size, 2, HEAD_DIM)
    for r, b in ((ref.k_cache, backend.k_cache), (ref.v_cache, backend.v_cache)):
        r.copy_(b.float().reshape(2, *pages).reshape(2, -1, 2, HEAD_DIM).transpose(1, 2))
    seqs = random_step(rng, block_size, num_blocks)
    total = sum(s.q_len for s in seqs)
    q, k, v = (torch.randn(h, total, HEAD_DIM).bfloat16() for h in (4, 2, 2))
    step, slots = StepLayout.from_seqs(seqs), slot_mapping(seqs, block_size)
    scale = HEAD_DIM**-0.5
    fi.RUNS_PER_PLAN[0] = 1
    metadata = backend.build_metadata(step, slots)
    got = backend.forward(1, q, k, v, metadata, scale)  # [T, Hq, D] bf16
    expected = ref.forward(1, q.float(), k.float(), v.float(), ref.build_metadata(step, slots), scale)
    # Both attend in float32; the double rounds its output to bf16 once: half a bf16 ulp (2^-9
    # relative) apart, plus float32 summation noise far below it.
    torch.testing.assert_close(got.float(), expected, rtol=2**-8, atol=1e-5)
    with pytest.raises(fi.ContractError, match="more runs than layers"):  # the next step must plan first
        backend.forward(1, q, k, v, metadata, scale)


def _paired(num_blocks: int, block_size: int, layers: tuple[LayerAttention, ...]) -> tuple[Any, Any]:
    """The backend over the double and the float32 reference on the same bf16 pool, both told `layers`."""
    backend = _backend(num_blocks, block_size, max_model_len=1024)
    ref = TorchReferenceBackend(2, num_blocks, block_size, 2, HEAD_DIM)
    backend.k_cache.normal_()
    backend.v_cache.normal_()
    pages = (num_blocks, block_size, 2, HEAD_DIM)
    for r, b in ((ref.k_cache, backend.k_cache), (ref.v_cache, backend.v_cache)):
        r.copy_(b.float().reshape(2, *pages).reshape(2, -1, 2, HEAD_DIM).transpose(1, 2))
    backend.set_layers(layers)
    ref.set_layers(layers)
    return backend, ref


def test_windowed_and_capped_layers_plan_their_own_wrappers_eager_and_in_a_bucket():
    """Layer 0 a 9-key window with a soft-cap, layer 1 plain: a tree step's window is in its mask
    (by each row's position), a decode bucket's is FlashInfer's `window_left`; each layer reads
    its own wrapper, and attends as the reference does."""
    layers = (LayerAttention(window=9, softcap=1.0), LayerAttention())
    backend, ref = _paired(400, 4, layers)
    seqs = random_step(random.Random(5), 4, 400, cached=(0, 7, 33, 200))
    step, slots = StepLayout.from_seqs(seqs), slot_mapping(seqs, 4)
    total = sum(s.q_len for s in seqs)
    q, k, v = (torch.randn(h, total, HEAD_DIM).bfloat16() for h in (4, 2, 2))
    scale = HEAD_DIM**-0.5
    metadata = backend.build_metadata(step, slots)
    assert set(metadata.wrappers) == set(layers)
    ref_meta = ref.build_metadata(step, slots)
    for layer in (0, 1):
        got = backend.forward(layer, q, k, v, metadata, scale)
        expected = ref.forward(layer, q.float(), k.float(), v.float(), ref_meta, scale)
        torch.testing.assert_close(got.float(), expected, rtol=2**-8, atol=1e-5)
    decode = _decode_step([tuple(range(10)), tuple(range(20, 40))], [30, 70])
    slots = torch.tensor([30, 4 * 20 + 70], dtype=torch.long)
    q, k, v = (torch.randn(h, 2, HEAD_DIM).bfloat16() for h in (4, 2, 2))
    metadata = backend.plan(decode, slots, StepBucket(2, 2, tree=False))
    assert {w.use_cuda_graph for w in metadata.wrappers.values()} == {True}
    assert metadata.wrappers[layers[0]]._plan.window_left == 8
    ref_meta = ref.build_metadata(decode, slots)
    got = backend.forward(0, q, k, v, metadata, scale)
    expected = ref.forward(0, q.float(), k.float(), v.float(), ref_meta, scale)
    torch.testing.assert_close(got.float(), expected, rtol=2**-8, atol=1e-5)
    plain = ref.forward(1, q.float(), k.float(), v.float(), ref_meta, scale)
    assert (plain - expected).abs().max() > 1e-2  # the window and cap made a difference


def test_attention_sinks_are_added_from_the_kernels_log_sum_exp_eager_and_in_a_bucket():
    """gpt-oss's sinks (a logit per query head in the softmax's denominator): each layer's own, added
    from the base-2 log-sum-exp the kernel returns, as the reference computes them, on a tree step
    (masked, one layer windowed) and in a decode bucket. Layers that differ only in their sinks
    share one wrapper: the sinks are not planned."""
    layers = (LayerAttention(window=9, sinks=(0.5, -1.0, 2.0, 0.0)), LayerAttention(sinks=(3.0, 1.0, -2.0, 0.25)))
    backend, ref = _paired(400, 4, layers)
    assert set(backend._kinds) == {LayerAttention(window=9), LayerAttention()}
    plain, _ = _paired(400, 4, (LayerAttention(window=9), LayerAttention()))
    plain.k_cache.copy_(backend.k_cache)
    plain.v_cache.copy_(backend.v_cache)
    seqs = random_step(random.Random(7), 4, 400, cached=(0, 7, 33, 200))
    step, slots = StepLayout.from_seqs(seqs), slot_mapping(seqs, 4)
    total = sum(s.q_len for s in seqs)
    q, k, v = (torch.randn(h, total, HEAD_DIM).bfloat16() for h in (4, 2, 2))
    decode = _decode_step([tuple(range(10)), tuple(range(20, 40))], [30, 70])
    decode_slots = torch.tensor([30, 4 * 20 + 70], dtype=torch.long)
    qd, kd, vd = (torch.randn(h, 2, HEAD_DIM).bfloat16() for h in (4, 2, 2))
    scale = HEAD_DIM**-0.5
    for layer in (0, 1):
        metadata, ref_meta = backend.build_metadata(step, slots), ref.build_metadata(step, slots)
        got = backend.forward(layer, q, k, v, metadata, scale)
        expected = ref.forward(layer, q.float(), k.float(), v.float(), ref_meta, scale)
        # Rounded to bf16 twice (the kernel's output, then the scaled one): within a bf16 ulp, 2^-7.
        torch.testing.assert_close(got.float(), expected, rtol=2**-7, atol=1e-5)
        unsunk = plain.forward(layer, q, k, v, plain.build_metadata(step, slots), scale)
        assert (unsunk.float() - expected).abs().max() > 1e-2  # the sinks made a difference
        metadata = backend.plan(decode, decode_slots, StepBucket(2, 2, tree=False))
        got = backend.forward(layer, qd, kd, vd, metadata, scale)
        ref_meta = ref.build_metadata(decode, decode_slots)
        expected = ref.forward(layer, qd.float(), kd.float(), vd.float(), ref_meta, scale)
        torch.testing.assert_close(got.float(), expected, rtol=2**-7, atol=1e-5)
    with pytest.raises(ValueError, match="3 attention sinks for 4 query heads"):
        _backend(8, 4).set_layers((LayerAttention(sinks=(1.0, 2.0, 3.0)),))


def test_add_sinks_keeps_a_rows_share_and_leaves_an_empty_row_empty():
    """sigmoid(L - s) of each row, L its natural log-sum-exp: a sink equal to L halves the row, a
    row that saw no key (L = -inf) stays 0, never NaN."""
    from batchserve.attention.flashinfer_backend import add_sinks

    out = torch.ones(3, 2, 4, dtype=torch.bfloat16)  # [T, Hq, D]
    lse2 = torch.tensor([[1.0, 1.0], [float("-inf"), 0.0], [3.0, -3.0]])  # [T, Hq], base 2
    sinks = torch.tensor([math.log(2.0), -50.0])  # [Hq]: head 0's sink equals row 0's L
    got = add_sinks(out, lse2, sinks).float()
    assert torch.isfinite(got).all()
    assert got[0, 0].eq(0.5).all() and got[1, 0].eq(0).all() and got[1, 1].eq(1).all()
    assert got[2, 0].eq(torch.tensor(0.8).bfloat16().float()).all()  # sigmoid(3 ln 2 - ln 2) = 4/5
    assert got[2, 1].eq(1).all()  # a sink far below the row's mass takes nothing


def test_a_step_without_drafts_plans_causal_and_hands_no_mask():
    """Prompt chunks beside decodes (`none`'s step): FlashInfer's causal mode, aligned to the keys'
    end, with the window as `window_left`: no mask built, packed or copied, the reference's output."""
    from batchserve.attention.base import SeqLayout

    layers = (LayerAttention(window=9), LayerAttention())
    backend, ref = _paired(400, 4, layers)
    shapes, seqs, start, block = ((70, 33), (1, 200), (5, 0), (1, 7)), [], 0, 0  # (rows, cached)
    for rows, cached in shapes:
        n = -(-(rows + cached) // 4)
        seqs.append(SeqLayout(start, rows, cached, rows, (), tuple(range(block, block + n))))
        start, block = start + rows, block + n
    step, slots = StepLayout.from_seqs(seqs), slot_mapping(seqs, 4)
    assert step.causal
    q, k, v = (torch.randn(h, start, HEAD_DIM).bfloat16() for h in (4, 2, 2))
    metadata, ref_meta = backend.build_metadata(step, slots), ref.build_metadata(step, slots)
    for layer, wrapper in enumerate(metadata.wrappers.values()):
        assert wrapper._plan.causal and wrapper._custom_mask_buf is None
        got = backend.forward(layer, q, k, v, metadata, HEAD_DIM**-0.5)
        expected = ref.forward(layer, q.float(), k.float(), v.float(), ref_meta, HEAD_DIM**-0.5)
        torch.testing.assert_close(got.float(), expected, rtol=2**-8, atol=1e-5)


def _decode_step(tables: list[tuple[int, ...]], num_cached: list[int]) -> StepLayout:
    n = len(tables)
    width = max(map(len, tables))
    table = np.zeros((n, width), np.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    return StepLayout(
        qo_indptr=np.arange(n + 1, dtype=np.int64),
        num_cached=np.array(num_cached, np.int64),
        num_chunk=np.ones(n, np.int64),
        num_blocks=np.array([len(t) for t in tables], np.int64),
        block_table=table,
        spec_masks=(None,) * n,
    )


def test_a_bucket_holds_requests_that_share_every_prefix_block():
    """With the prefix cache one block stands in many tables: eight requests over the same 60
    blocks of a 64-block pool need 480 page entries (sizing by the pool gave 64 + 9 + 8)."""
    backend = _backend(64, 16, max_model_len=1024)
    shared = tuple(range(60))
    step = _decode_step([shared] * 8, [959] * 8)
    slots = torch.zeros(8, dtype=torch.long)
    metadata = backend.plan(step, slots, StepBucket(8, 8, tree=False))
    wrapper = metadata.wrapper
    assert len(wrapper._paged_kv_indices_buf) >= 8 * 60
    assert wrapper._paged_kv_indices_buf[:480].tolist() == list(shared) * 8


def test_graph_mode_keeps_a_fixed_batch_and_the_captured_rows():
    backend = _backend(64, 4, max_model_len=64)
    bucket = StepBucket(4, 2, tree=False)
    slots = torch.zeros(4, dtype=torch.long)
    four = _decode_step([(1,), (2,), (3,), (4,)], [1, 1, 1, 1])
    with pytest.raises(fi.ContractError, match=r"batch size 4 != the graph's fixed 3"):  # 4 requests, a bucket of 2
        backend.plan(four, slots, bucket)
    one = _decode_step([(1,)], [2])
    metadata = backend.plan(one, slots, bucket)  # padded to 2 requests + the padding request
    assert metadata.wrapper.fixed_batch_size == 3
    with pytest.raises(ValueError, match="max_model_len"):
        _backend(64, 4).plan(one, slots, StepBucket(1, 1, tree=False))


def test_the_double_refuses_what_flashinfer_refuses():
    ws = torch.empty(16, dtype=torch.uint8)
    i32 = {"dtype": torch.int32}
    qo, kv, idx, last = (torch.tensor(a, **i32) for a in ([0, 2], [0, 1], [5], [2]))
    args = (4, 2, HEAD_DIM, 4)
    mask = torch.ones(4, dtype=torch.bool)
    eager = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    with pytest.raises(fi.ContractError, match="int32"):
        eager.plan(qo.long(), kv, idx, last, *args)
    with pytest.raises(fi.ContractError, match="Invalid configuration"):
        eager.plan(qo, kv, idx, last, 4, 2, 16, 4)
    with pytest.raises(fi.ContractError, match="q_len \\* kv_len"):
        eager.plan(qo, kv, idx, last, *args, custom_mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(fi.ContractError, match="fa2"):
        fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD").plan(qo, kv, idx, last, *args, custom_mask=mask)
    with pytest.raises(fi.ContractError, match="uint8"):
        eager.plan(qo, kv, idx, last, *args, packed_custom_mask=torch.ones(1, dtype=torch.bool))
    fi.mark_host(mask)
    with pytest.raises(fi.ContractError, match="host memory"):  # segment_packbits runs on the device
        eager.plan(qo, kv, idx, last, *args, custom_mask=mask)
    mask = mask.clone()
    with pytest.raises(fi.ContractError, match="before plan"):
        eager.run(torch.zeros(2, 4, HEAD_DIM), (torch.zeros(8, 4, 2, HEAD_DIM),) * 2)

    def graph(indices: int, mask_bytes: int | None) -> Any:
        extra = {"custom_mask_buf": torch.zeros(mask_bytes, dtype=torch.uint8)} if mask_bytes is not None else {}
        if mask_bytes is not None:
            extra["mask_indptr_buf"] = torch.zeros(2, **i32)
        return fi.BatchPrefillWithPagedKVCacheWrapper(
            ws, "NHD", True, torch.zeros(2, **i32), torch.zeros(2, **i32), torch.zeros(indices, **i32),
            torch.zeros(1, **i32), backend="fa2", **extra,
        )  # fmt: skip

    with pytest.raises(fi.ContractError, match="exceeds the allocated buffer"):
        graph(0, None).plan(qo, kv, idx, last, *args)
    with pytest.raises(fi.ContractError, match="custom_mask_buf must be given"):
        graph(1, None).plan(qo, kv, idx, last, *args, custom_mask=mask)
    with pytest.raises(fi.ContractError, match="exceeds custom_mask_buf"):
        graph(1, 0).plan(qo, kv, idx, last, *args, custom_mask=mask)
    g = graph(1, 1)
    g.plan(qo, kv, idx, last, *args, custom_mask=mask)
    with pytest.raises(fi.ContractError, match="exceed the 2 planned at capture"):
        g.plan(torch.tensor([0, 3], **i32), kv, idx, torch.tensor([3], **i32), *args)
    with pytest.raises(fi.ContractError, match="fixed 1"):
        g.plan(torch.tensor([0, 1, 2], **i32), torch.tensor([0, 1, 2], **i32), idx.repeat(2), last.repeat(2), *args)
    with pytest.raises(fi.ContractError, match="CUDA graph mode"):
        fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", True)


# The engine: the tiny Llama at FlashInfer's smallest head dim, in bf16, over the double.


def _core(monkeypatch: pytest.MonkeyPatch, graphs: str) -> Any:
    """An engine whose attention is the FlashInfer backend over the double (made where the engine
    makes its backend), greedy with fixed-length random trees."""
    import batchserve.runner.build as build
    import batchserve.runner.forward as forward
    from batchserve.config import CacheConfig, DraftConfig, EngineConfig, ModelConfig, SchedulerConfig
    from batchserve.engine import EngineCore

    def make_backend(name: str, **kw: Any) -> Any:
        assert name == "flashinfer"
        kw["device"] = torch.device(kw["device"])
        layers = kw.pop("layers")
        backend = FlashInferBackend(**kw, library=fi)
        backend.set_layers(layers)
        return backend

    monkeypatch.setattr(forward, "backend_choice", lambda *a, **k: ("flashinfer", "the test double"))
    monkeypatch.setattr(build, "make_backend", make_backend)
    config = EngineConfig(
        model=ModelConfig(cuda_graphs=graphs, model_impl="native"),
        cache=CacheConfig(block_size=4, num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=96),
        draft=DraftConfig(decoding_length=8, adaptive=False),
    )
    drafter = RandomTreeDrafter(seed=3, vocab=TINY_VOCAB, max_nodes=8)
    return EngineCore(config, make_tiny_fa2_model(), make_tiny_tokenizer(), drafter)


def _generate(core: Any) -> tuple[dict[str, list[int]], list[Any]]:
    runner, buckets = core.runner, []
    launch = runner._launch

    def record(step: Any) -> Any:
        buckets.append(runner.graphs.bucket_for(step.layout) if runner.graphs is not None else None)
        return launch(step)

    runner._launch = record
    for i in range(9):
        core.add_request(
            Submission([1 + i, 2, 3, 4, 5] * (1 + i % 3), SamplingParams(max_new_tokens=20, ignore_eos=True))
        )
    done: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            done.setdefault(o.request_id, []).extend(o.new_token_ids)
    return done, buckets


def test_the_engine_runs_the_graph_path_through_the_double(monkeypatch):
    """`cuda_graphs=eager`: every step without a prompt chunk planned into its bucket's graph-mode
    wrapper (fixed buffers, a fixed batch, the mask packed into its buffer) and read back by the
    double as the kernels would; greedy output token for token that of the eager engine."""
    fi.RUNS_PER_PLAN[0] = 2  # the model's layers: one plan per step
    plain = _core(monkeypatch, "off")
    bucketed = _core(monkeypatch, "eager")
    assert plain.facts.attention_backend == bucketed.facts.attention_backend == "flashinfer"
    assert plain.facts.graphs == "off" and bucketed.facts.graphs == "eager"
    expected, _ = _generate(plain)
    got, used = _generate(bucketed)
    assert got == expected
    assert fi.SYNCS == []  # no plan() of either engine would have blocked the host
    buckets = [b for b in used if b is not None]
    assert len(buckets) >= 20 and any(b.tree for b in buckets) and any(not b.tree for b in buckets)
    assert any(b is None for b in used)  # prompt chunks ran eagerly in between
    assert all(b.requests <= b.rows for b in buckets)
    planned = bucketed.runner.backend._buckets
    assert set(planned) == set(buckets) and all(m.wrapper.use_cuda_graph for m in planned.values())
    with pytest.raises(ValueError, match="CUDA device"):  # no capture without CUDA, double or not
        _core(monkeypatch, "on")
