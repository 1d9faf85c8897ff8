"""CUDA graphs on a GPU: a replayed bucket equals the same bucket run eagerly, bit for bit; the
engine's output with graphs equals its output without; capture is reported (skipped without CUDA)."""

from __future__ import annotations

import importlib.util
import itertools
import time

import pytest
import torch

from batchserve import LLM, SamplingParams
from tests.conftest import TINY_VOCAB, make_tiny_model, make_tiny_tokenizer
from tests.engine.drafters import RandomTreeDrafter
from tests.prompts import CODE_PROMPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and importlib.util.find_spec("flashinfer")),
        reason="needs CUDA and flashinfer-python",
    ),
]


def _tiny(graphs: str, seed: int = 5) -> LLM:
    drafter = RandomTreeDrafter(seed=seed, vocab=TINY_VOCAB, max_nodes=10)
    model = make_tiny_model().to("cuda", torch.bfloat16)
    return LLM(
        hf_model=model, tokenizer=make_tiny_tokenizer(), drafter=drafter, cuda_graphs=graphs, adaptive=False,
        max_num_seqs=8, max_num_batched_tokens=256, decoding_length=10, block_size=16,
    )  # fmt: skip


def test_every_replayed_bucket_equals_the_same_bucket_run_eagerly():
    llm = _tiny("on")
    engine = llm.engine
    graphs = engine.runner.graphs
    assert engine.graphs_report is not None and engine.graphs_report.graphs == len(graphs.captured) > 0
    replayed, eager = [], []
    runner = engine.runner
    launch_eagerly_too = runner._launch

    def launch(step):  # the same planned step: the bucket's graph, then its forward eagerly
        bucket = graphs.bucket_for(step.layout)
        if bucket is None:
            return launch_eagerly_too(step)
        metadata, kept = graphs.prepare(step, bucket)

        def run():
            logits = graphs.forward(bucket, metadata, kept).clone()
            eager.append(graphs._forward(bucket, metadata)[:kept].clone())
            replayed.append(logits)
            return logits

        return run, time.perf_counter()

    runner._launch = launch
    prompts = [[1 + i, 2, 3, 4, 5] * (2 + i) for i in range(8)]
    llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert len(replayed) >= 20
    for a, b in zip(replayed, eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("batch", [1, 8])
def test_engine_output_with_graphs_equals_without(batch, smollm2):
    _, tokenizer = smollm2
    prompts = [tokenizer(p).input_ids for p in CODE_PROMPTS[:8]]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    outs = {}
    for graphs in ("on", "off"):
        llm = LLM(dtype="bfloat16", cuda_graphs=graphs, max_num_seqs=batch)
        assert llm.engine.graphs == graphs
        outs[graphs] = [r.token_ids for r in llm.generate(prompts, params)]
        if graphs == "on":
            report = llm.engine.graphs_report
            mib = report.bytes / 2**20
            print(f"\nbatch {batch}: {report.graphs} graphs captured in {report.seconds:.1f} s, {mib:.0f} MiB")
        del llm
        torch.cuda.empty_cache()
    assert outs["on"] == outs["off"]


def test_prompt_chunks_run_eagerly_between_replayed_steps():
    """Requests arrive while others decode: steps with a prompt chunk (eager) sit between replayed
    ones, and the outputs equal the eager engine's."""
    outs = []
    for graphs in ("on", "eager"):
        llm = _tiny(graphs)
        kinds = []
        runner = llm.engine.runner
        launch = runner._launch

        def record(step, launch=launch, kinds=kinds, graphs=runner.graphs):
            kinds.append(graphs.bucket_for(step.layout) is not None)
            return launch(step)

        runner._launch = record
        prompts = [[3 + i, 7, 9] * (3 + 4 * i) for i in range(6)]
        params = [SamplingParams(max_new_tokens=16 + 4 * i, ignore_eos=True) for i in range(6)]
        outs.append([r.token_ids for r in llm.generate(prompts, params)])
        assert any(kinds) and not all(kinds)
        switches = sum(1 for a, b in itertools.pairwise(kinds) if a != b)
        assert switches >= 2  # eager prompt steps between replayed ones
    assert outs[0] == outs[1]
