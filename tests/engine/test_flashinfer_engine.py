"""End to end on a GPU: SmolLM2 with FlashInfer against the torch backend and HF greedy.

In bf16/fp16 two correct attention kernels can round differently and flip a near-tie, so
these tests report a mismatch rate (printed) and bound it instead of asserting equality.
scripts/gpu_check.sh runs the bfloat16 ones (`-k bfloat16`: the shipped GPU dtype): each other
dtype is one more FlashInfer module built with nvcc on first use.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from batchserve import LLM, SamplingParams
from tests.conftest import hf_greedy, mismatch
from tests.prompts import CODE_PROMPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and importlib.util.find_spec("flashinfer")),
        reason="needs CUDA and flashinfer-python",
    ),
]

MAX_NEW = 64
SEATS = len(CODE_PROMPTS)  # every prompt at once, and no graph captured for more requests than that


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_flashinfer_engine_against_torch_backend_and_hf(dtype, smollm2):
    _, tokenizer = smollm2
    prompts = [tokenizer(p).input_ids for p in CODE_PROMPTS]
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    outs = {}
    for backend in ("flashinfer", "torch"):
        llm = LLM(dtype=dtype, attention_backend=backend, decoding_length=16, adaptive=False, max_num_seqs=SEATS)
        assert llm.engine.facts.attention_backend == backend
        outs[backend] = [r.token_ids for r in llm.generate(prompts, params)]
        del llm
    from batchserve.runner import load_model

    hf, _ = load_model(None, dtype, "cuda")
    hf_out = [hf_greedy(hf, p, MAX_NEW, ignore_eos=True) for p in prompts]
    del hf
    hf32, _ = load_model(None, "float32", "cuda")
    hf32_out = [hf_greedy(hf32, p, MAX_NEW, ignore_eos=True) for p in prompts]
    vs_torch = mismatch(outs["flashinfer"], outs["torch"])
    vs_hf = mismatch(outs["flashinfer"], hf_out)
    vs_fp32 = mismatch(outs["flashinfer"], hf32_out)
    # The format's own noise: HF in this dtype against HF in float32.
    floor = mismatch(hf_out, hf32_out)
    for name, (rate, first) in (
        ("flashinfer vs the torch backend", vs_torch),
        ("flashinfer vs HF greedy", vs_hf),
        ("flashinfer vs HF float32 greedy", vs_fp32),
        ("HF greedy vs HF float32 greedy", floor),
    ):
        print(f"\n{dtype}: {name}: {rate:.0%} of prompts differ (mean first divergence {first:.0f})")
    # A wrong mask or page table breaks almost every prompt within a few tokens.
    assert vs_torch[1] >= 8 and vs_hf[1] >= 8 and vs_fp32[1] >= 8
    assert vs_hf[0] <= 0.5
    # Rounding moves greedy output away from float32 by itself (in bf16 on the H100, HF's own
    # greedy left float32's in 5 of 8 prompts): FlashInfer may not leave it much more often.
    assert vs_fp32[0] <= floor[0] + 0.25
    if dtype == "float16":
        # fp16 keeps 3 more mantissa bits than bf16: near-ties are rare enough to bound this directly.
        assert vs_torch[0] <= 0.25


def test_native_forward_on_cuda_against_the_transformers_one(smollm2):
    """Our forward on CUDA (fp16, FlashInfer, lookahead): the same greedy output as the
    transformers model's forward in the same engine, within fp16's near-ties. Both without CUDA
    graphs (the transformers forward has none), so the steps are planned alike and only the
    forwards differ."""
    _, tokenizer = smollm2
    prompts = [tokenizer(p).input_ids for p in CODE_PROMPTS]
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    outs = {}
    for impl in ("native", "transformers"):
        llm = LLM(
            dtype="float16", attention_backend="flashinfer", model_impl=impl, decoding_length=16, adaptive=False,
            max_num_seqs=SEATS, cuda_graphs="off",
        )  # fmt: skip
        assert llm.engine.facts.forward.name.startswith(impl)
        outs[impl] = [r.token_ids for r in llm.generate(prompts, params)]
        del llm
    rate, first = mismatch(outs["native"], outs["transformers"])
    print(f"\nfloat16: native vs transformers forward: {rate:.0%} of prompts differ (first divergence {first:.0f})")
    assert first >= 8 and rate <= 0.25
