"""Bucketed static-buffer steps (what a CUDA graph replays), run eagerly on CPU: the buckets, the
padding, and logits equal to the unpadded step's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from batchserve import SamplingParams
from batchserve.admission import Submission
from batchserve.attention.base import StepBucket, StepLayout
from batchserve.records import SchedulerOutput
from batchserve.runner.batch import BlockTables, pack
from batchserve.runner.graphs import StepGraphs, eligible, filler_layout, pad_step, request_buckets, row_buckets
from tests.conftest import TINY_VOCAB, make_tiny_model, make_tiny_tokenizer
from tests.engine.drafters import RandomTreeDrafter


def test_row_buckets_are_fine_then_by_32_up_to_the_largest_step():
    assert row_buckets(1) == (1,)
    assert row_buckets(13) == (1, 2, 4, 8, 12, 16)
    assert row_buckets(64) == (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
    assert row_buckets(130) == (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160)
    assert request_buckets(16) == (1, 2, 4, 8, 16)
    assert request_buckets(9) == (1, 2, 4, 8, 16)
    assert request_buckets(300)[-1] >= 300


def _layout(q_len: list[int], chunk: list[int] | None = None) -> StepLayout:
    b = len(q_len)
    chunk = chunk or [1] * b
    return StepLayout(
        qo_indptr=np.concatenate(([0], np.cumsum(q_len))).astype(np.int64),
        num_cached=np.full(b, 5, np.int64),
        num_chunk=np.array(chunk, np.int64),
        num_blocks=np.full(b, 4, np.int64),
        block_table=np.zeros((b, 4), np.int64),
        spec_masks=(None,) * b,
    )


def _graphs(max_rows: int = 130, max_requests: int = 16) -> StepGraphs:
    from batchserve.attention import TorchReferenceBackend

    model = make_tiny_model()
    backend = TorchReferenceBackend(2, 8, 4, 2, 16)
    rows, requests = row_buckets(max_rows), request_buckets(max_requests)
    return StepGraphs(model, backend, torch.device("cpu"), 7, rows, requests, max_rows, max_requests)


def test_the_bucket_rounds_rows_and_requests_up_and_skips_prompt_chunks():
    g = _graphs()
    assert g.bucket_for(_layout([1])) == StepBucket(1, 1, tree=False)
    assert g.bucket_for(_layout([1, 1, 1])) == StepBucket(4, 4, tree=False)
    assert g.bucket_for(_layout([5, 1, 8])) == StepBucket(16, 4, tree=True)  # ragged trees: only totals count
    assert g.bucket_for(_layout([9] * 16)) == StepBucket(160, 16, tree=True)
    assert g.bucket_for(_layout([4, 1], chunk=[4, 1])) is None  # a prompt chunk runs eagerly
    assert not eligible(_layout([4, 1], chunk=[4, 1]))
    assert g.bucket_for(_layout([21] * 8)) is None  # beyond the largest bucket: eager
    assert g.bucket_for(_layout([1] * 17)) is None  # more requests than any bucket
    # Never more requests than rows: 10 roots take rows bucket 12, so requests 12 (not 16), and the
    # plan's batch (requests + the padding request) stays within rows + 1 (FlashInfer's graph
    # planner wraps around below that and tiles every decode step by 128 query rows).
    assert g.bucket_for(_layout([1] * 10)) == StepBucket(12, 12, tree=False)
    assert g.bucket_for(_layout([2] + [1] * 9)) == StepBucket(12, 12, tree=True)
    assert all(b.requests <= b.rows for b in g.all_buckets())


def test_every_bucket_a_step_can_take_is_among_those_captured():
    g = _graphs(max_rows=100, max_requests=12)  # neither a bucket's edge: no bucket past them
    captured = set(g.all_buckets())
    assert len(captured) == len(g.all_buckets())  # no bucket twice
    seen = set()
    for requests in range(1, 13):
        for rows in range(requests, 101):
            bucket = g.bucket_for(_layout([rows - requests + 1] + [1] * (requests - 1)))
            if bucket is not None:
                seen.add(bucket)
    assert seen == captured  # and every listed bucket is one some step takes
    assert list(g.all_buckets()) == sorted(captured, key=lambda b: (b.rows, b.requests, b.tree), reverse=True)


def test_padding_rows_are_one_more_request_over_the_scratch_block():
    tables = BlockTables()
    requests = [
        _scheduled("a", 9, (3, 4, 5), None),
        _scheduled("b", 2, (6,), ((1, 2, 3), (None, 0, 0))),
    ]
    step = pack(requests, tables, 4)
    layout, inputs = pad_step(step, 8, scratch_block=11, block_size=4)
    assert step.layout.num_tokens == 5 and layout.num_tokens == 8
    assert layout.q_len.tolist() == [1, 4, 3]
    assert layout.block_table[2, 0] == 11 and layout.num_cached[2] == 0 and layout.num_chunk[2] == 3
    assert (inputs.slot_mapping[5:] // 4 == 11).all()  # the padding rows' K/V land in the scratch block
    assert inputs.slot_mapping[:5].tolist() == step.slot_mapping.tolist()
    assert inputs.keep[: len(step.keep)].tolist() == step.keep.tolist() and (inputs.keep[len(step.keep) :] == 0).all()
    same, _ = pad_step(step, 5, scratch_block=11, block_size=4)
    assert same is step.layout  # nothing to pad
    with pytest.raises(ValueError, match="does not fit"):
        pad_step(step, 4, scratch_block=11, block_size=4)


def test_a_filler_step_has_the_buckets_shape():
    for bucket in _graphs(max_rows=64, max_requests=8).all_buckets():
        layout = filler_layout(bucket, scratch_block=7, block_size=4)
        assert layout.num_tokens == bucket.rows
        assert len(layout.num_cached) <= bucket.requests + 1
        if bucket.tree:
            assert (layout.q_len > 1).any()  # the padding request: the step reads a mask


def _scheduled(rid: str, cached: int, blocks: tuple[int, ...], tree: Any) -> Any:
    from batchserve.records import ScheduledRequest
    from batchserve.trees import DraftTree

    draft = DraftTree(*tree) if tree is not None else None
    return ScheduledRequest(rid, (7,), cached, blocks, draft, True, SamplingParams())


def _core(graphs: str, seed: int = 3) -> Any:
    from batchserve.config import CacheConfig, DraftConfig, EngineConfig, ModelConfig, SchedulerConfig
    from batchserve.engine import EngineCore

    config = EngineConfig(
        model=ModelConfig(cuda_graphs=graphs),
        cache=CacheConfig(block_size=4, num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=96),
        draft=DraftConfig(decoding_length=8, adaptive=False),
    )
    drafter = RandomTreeDrafter(seed=seed, vocab=TINY_VOCAB, max_nodes=8)
    return EngineCore(config, make_tiny_model(), make_tiny_tokenizer(), drafter)


class Logits:
    """Every step's kept-row logits, from the runner's forward (either path)."""

    def __init__(self, core: Any) -> None:
        self.steps: list[torch.Tensor] = []
        self.buckets: list[StepBucket | None] = []  # the bucket each step took (None: its own size)
        runner = core.runner
        launch = runner._launch

        def record(step: Any) -> Any:
            self.buckets.append(runner.graphs.bucket_for(step.layout) if runner.graphs is not None else None)
            forward, t = launch(step)

            def run() -> torch.Tensor:
                logits = forward()
                self.steps.append(logits.clone())
                return logits

            return run, t

        runner._launch = record


def test_bucketed_steps_give_the_unpadded_steps_logits_bit_for_bit():
    """Trees of every size, 1 to 6 requests, padding rows in most steps: the bucketed path (static
    buffers, the padding request on the scratch block) gives each step's kept rows the same bits
    as the step at its own size, and so the same tokens."""
    plain, bucketed = _core("off"), _core("eager")
    assert plain.runner.graphs is None and bucketed.runner.graphs is not None
    logits = [Logits(plain), Logits(bucketed)]
    outputs = []
    for core in (plain, bucketed):
        for i in range(9):
            core.add_request(
                Submission([1 + i, 2, 3, 4, 5] * (1 + i % 3), SamplingParams(max_new_tokens=20, ignore_eos=True))
            )
        done: dict[str, list[int]] = {}
        while core.has_work():
            for o in core.step():
                done.setdefault(o.request_id, []).extend(o.new_token_ids)
        outputs.append(done)
    assert outputs[0] == outputs[1]
    assert len(logits[0].steps) == len(logits[1].steps)
    for a, b in zip(*(r.steps for r in logits)):
        assert torch.equal(a, b)
    used = logits[1].buckets
    buckets = [b for b in used if b is not None]
    assert len(buckets) >= 20 and any(b.tree for b in buckets) and any(not b.tree for b in buckets)
    assert len({b.requests for b in buckets}) >= 3
    assert any(u is None for u in used)  # prompt chunks ran eagerly in between


def test_a_padded_step_writes_nothing_outside_its_slots_and_the_scratch_block():
    from batchserve.records import ScheduledRequest
    from batchserve.trees import DraftTree

    core = _core("eager")
    runner = core.runner
    backend, graphs = runner.backend, runner.graphs
    bs = backend.block_size
    # A prompt (eager: a chunk), then a root and a 2-node tree: 3 rows padded to 4.
    prompt = ScheduledRequest("r", (5, 6, 7, 8, 9, 10), 0, (20, 21), None, True, SamplingParams())
    runner.execute(SchedulerOutput((prompt,), ()))
    tree = DraftTree((11, 12), (None, 0))
    out = SchedulerOutput((ScheduledRequest("r", (13,), 6, (20, 21, 22), tree, True, SamplingParams()),), ())
    step = pack(out.requests, runner._tables, bs)
    bucket = graphs.bucket_for(step.layout)
    assert bucket == StepBucket(4, 1, tree=True) and step.layout.num_tokens == 3
    scratch = set(range(graphs.scratch_block * bs, (graphs.scratch_block + 1) * bs))
    backend.k_cache[:, :, sorted(scratch)] = 7.0  # a mark that no K can be (earlier padding rows wrote there)
    before = backend.k_cache.clone()
    runner.execute(out)
    changed = set((backend.k_cache != before).any(dim=(0, 1, 3)).nonzero().flatten().tolist())  # slots written
    assert changed <= set(step.slot_mapping.tolist()) | scratch
    assert changed & scratch  # the padding row did write, to the scratch block alone
    assert graphs.scratch_block == backend.num_blocks - 1 and graphs.scratch_block != core.facts.probe_block
    assert graphs.scratch_block >= core.scheduler.allocator.num_blocks  # outside the scheduler's pool


def test_cuda_graphs_setting_is_checked_where_no_graph_can_be_captured():
    from batchserve.attention import TorchReferenceBackend
    from batchserve.runner.forward import graphs_choice

    class GraphSafe(TorchReferenceBackend):
        graph_safe = True

    def graphs_mode(*args: object) -> str:
        return graphs_choice(*args)[0]

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    safe, fresh = GraphSafe, TorchReferenceBackend
    assert graphs_mode("auto", cpu, True, safe) == "off"
    assert graphs_mode("auto", cuda, True, safe) == "on"
    assert graphs_mode("auto", cuda, False, safe) == "off"
    # The torch reference builds its metadata afresh each step: a replay would reuse the capture's.
    assert graphs_mode("auto", cuda, True, fresh) == "off"
    assert graphs_mode("eager", cpu, False, fresh) == "eager"
    with pytest.raises(ValueError, match=r"needs? a CUDA device"):
        graphs_mode("on", cpu, True, safe)
    with pytest.raises(ValueError, match="native"):
        graphs_mode("on", cuda, False, safe)
    with pytest.raises(ValueError, match="TorchReferenceBackend attention builds its metadata afresh"):
        graphs_mode("on", cuda, True, fresh)
    with pytest.raises(ValueError, match="cuda_graphs"):
        from batchserve.config import ModelConfig

        ModelConfig(cuda_graphs="sometimes")
