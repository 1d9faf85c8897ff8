"""Where bf16 greedy output leaves HF's: SmolLM2 on a GPU, plain decoding and lookahead,
torch and FlashInfer attention, each against HF greedy in bf16 and in float32.

Run from the repository root on a CUDA machine with the project installed (`make setup`):
    PYTHONPATH=$PWD .venv/bin/python scripts/gpu_bf16_divergence.py   # $PWD: it imports from tests/
Each line prints (fraction of prompts that differ, mean first divergence of those).
"""

from __future__ import annotations

import torch

from batchserve import LLM, SamplingParams
from batchserve.runner import load_model
from tests.conftest import hf_greedy
from tests.engine.test_flashinfer_engine import MAX_NEW, _mismatch
from tests.prompts import CODE_PROMPTS

DTYPE = "bfloat16"


def main() -> None:
    hf, tok = load_model(None, DTYPE, "cuda")
    prompts = [tok(p).input_ids for p in CODE_PROMPTS]
    ref = [hf_greedy(hf, p, MAX_NEW, ignore_eos=True) for p in prompts]
    del hf
    hf32, _ = load_model(None, "float32", "cuda")
    ref32 = [hf_greedy(hf32, p, MAX_NEW, ignore_eos=True) for p in prompts]
    del hf32
    print(DTYPE, "HF bf16 vs HF fp32:", _mismatch(ref, ref32), flush=True)
    outs = {}
    for backend in ("torch", "flashinfer"):
        for draft in ("none", "lookahead"):
            llm = LLM(dtype=DTYPE, attention_backend=backend, draft=draft, adaptive=False, decoding_length=16)
            params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
            outs[backend, draft] = out = [r.token_ids for r in llm.generate(prompts, params)]
            vs_hf, vs_fp32 = _mismatch(out, ref), _mismatch(out, ref32)
            print(DTYPE, backend, draft, "vs HF:", vs_hf, "vs HF fp32:", vs_fp32, flush=True)
            del llm
            torch.cuda.empty_cache()
    print("flashinfer none vs torch none:", _mismatch(outs["flashinfer", "none"], outs["torch", "none"]))


if __name__ == "__main__":
    main()
