"""CUDA graphs on a GPU: a replayed bucket equals the same bucket run eagerly, bit for bit; the
engine's output with graphs equals the same bucketed steps run eagerly, token for token, and its
distance from the engine without buckets (`off`) is reported; capture is reported (skipped
without CUDA and flashinfer-python).

The models here have head dim 64: FlashInfer's FA2 prefill kernels have no valid tile below it.
`on` and `eager` plan every bucketed step through the same graph-mode wrappers, so their outputs
are equal; `off` plans through the plain wrapper, whose planner splits the KV differently (graph
mode always splits and merges), so in bf16 a near-tie may flip between them, late in an output."""

from __future__ import annotations

import importlib.util
import itertools
import time

import pytest
import torch

from batchserve import LLM, SamplingParams
from tests.conftest import TINY_VOCAB, make_tiny_fa2_model, make_tiny_tokenizer, mismatch
from tests.engine.drafters import RandomTreeDrafter
from tests.prompts import CODE_PROMPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and importlib.util.find_spec("flashinfer")),
        reason="needs CUDA and flashinfer-python",
    ),
]


def _tiny(graphs: str, seed: int = 5, max_num_seqs: int = 8) -> LLM:
    drafter = RandomTreeDrafter(seed=seed, vocab=TINY_VOCAB, max_nodes=10)
    model = make_tiny_fa2_model().to("cuda")  # bfloat16, head dim 64
    return LLM(
        hf_model=model, tokenizer=make_tiny_tokenizer(), drafter=drafter, cuda_graphs=graphs, adaptive=False,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=256, decoding_length=10, block_size=16,
    )  # fmt: skip


def test_every_replayed_bucket_equals_the_same_bucket_run_eagerly():
    llm = _tiny("on")
    engine = llm.engine
    assert engine.facts.attention_backend == "flashinfer" and engine.facts.graphs == "on"
    graphs = engine.runner.graphs
    assert engine.facts.capture is not None and engine.facts.capture.graphs == len(graphs.captured) > 0
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


@pytest.fixture(scope="module")
def smollm2_bf16():
    """(model, tokenizer): SmolLM2 in bfloat16 on the GPU (head dim 64), loaded once; each engine
    builds its own forward from it."""
    from batchserve.runner import load_model

    return load_model(None, "bfloat16", "cuda")


@pytest.mark.parametrize("batch", [1, 8])
def test_engine_output_with_graphs_equals_the_same_steps_eager(batch, smollm2_bf16):
    """Fixed decoding length (adaptive lengths follow step timings, which differ between modes):
    `on` replays the buckets that `eager` runs, planned alike, so the outputs are equal token for
    token. Against `off` (no buckets) the mismatch is printed and loosely bounded."""
    model, tokenizer = smollm2_bf16
    prompts = [tokenizer(p).input_ids for p in CODE_PROMPTS[:8]]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    outs = {}
    for graphs in ("on", "eager", "off"):
        llm = LLM(
            hf_model=model, tokenizer=tokenizer, cuda_graphs=graphs, max_num_seqs=batch, adaptive=False,
            decoding_length=16,
        )  # fmt: skip
        assert llm.engine.facts.graphs == graphs and llm.engine.facts.attention_backend == "flashinfer"
        outs[graphs] = [r.token_ids for r in llm.generate(prompts, params)]
        if graphs == "on":
            report = llm.engine.facts.capture
            mib = report.bytes / 2**20
            print(f"\nbatch {batch}: {report.graphs} graphs captured in {report.seconds:.1f} s, {mib:.0f} MiB")
        del llm
        torch.cuda.empty_cache()
    rate, first = mismatch(outs["on"], outs["off"])
    print(f"batch {batch}: graphs on vs off: {rate:.0%} of prompts differ (mean first divergence {first:.0f})")
    same = sum(a == b for a, b in zip(outs["on"], outs["eager"]))
    assert outs["on"] == outs["eager"], f"on and eager differ on {len(prompts) - same} of {len(prompts)} prompts"
    # A wrong plan or page table breaks almost every prompt within a few tokens.
    assert first >= 8 and rate <= 0.5


def test_prompt_chunks_run_eagerly_between_replayed_steps():
    """Requests arrive while others decode (two seats for six requests, so each later one is admitted
    as a seat frees): steps with a prompt chunk (eager) sit between replayed ones, and the outputs
    equal the eager engine's."""
    outs = []
    for graphs in ("on", "eager"):
        llm = _tiny(graphs, max_num_seqs=2)
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
