"""The GPU check's `prebuild` step: every module the later steps need, built at once in parallel
processes, so that no step spends its own time limit in nvcc (about a minute a module, one core
each; a CUDA machine has more cores than modules).

- the drafter's native library, the default model's GGUF conversion, and FlashInfer's norm,
  activation and rope modules (`scripts/count_kernels.py`'s fused layer: its first use);
- FlashInfer's attention in bf16 at head dim 64 (SmolLM2's heads) for each kind of layer the tests
  and the engine plan: plain, a sliding window, a soft cap, both; each as a tree step (custom mask),
  a causal step (prompt chunks) and a graph bucket of decodes (`window_left`);
- the mask packing (`flashinfer.quantization.segment_packbits`).

Each job prints one line (ok, or the error); the exit status is the number of jobs that failed.
Where a job fails, the step that needs its module builds it itself, in its own time.

    python scripts/gpu_prebuild.py [--jobs N]   # N processes at most (default: one per job)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"plain": {}, "window": {"window": 37}, "softcap": {"softcap": 30.0}, "both": {"window": 37, "softcap": 30.0}}


def _project() -> None:
    """The project and its tests importable in a spawned process, whatever its working directory."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def engine_modules() -> str:
    """The drafter, the model's conversion and the fused layer's FlashInfer modules."""
    _project()
    import runpy

    from batchserve.draft import native
    from batchserve.model.loader import load_model

    native.library()
    load_model(None, "bfloat16")
    sys.argv = ["scripts/count_kernels.py"]
    try:
        runpy.run_path(str(ROOT / "scripts" / "count_kernels.py"), run_name="__main__")
    except SystemExit as e:  # the script's own exit: a status, not the job's end
        if e.code not in (0, None):
            raise RuntimeError(f"count_kernels.py exited with {e.code}") from None
    return "drafter, model, norm/activation/rope"


def attention(kind: str) -> str:
    """One kind of layer's attention modules: a tree step, a causal step, a decode bucket."""
    _project()
    import dataclasses

    import torch

    from batchserve.attention import LayerAttention, StepLayout
    from batchserve.attention.base import StepBucket
    from batchserve.attention.flashinfer_backend import FlashInferBackend
    from tests.attention.layouts import blocks_needed, random_step, slot_mapping

    dev, block = torch.device("cuda"), 16
    cached = (0, 1, 100)
    fi = FlashInferBackend(1, blocks_needed(cached, block), block, 12, 4, 64, torch.bfloat16, dev, max_model_len=512)
    fi.set_layers((LayerAttention(**KINDS[kind]),))
    seqs = random_step(random.Random(0), block, blocks_needed(cached, block), cached)
    roots = [dataclasses.replace(s, q_start=j) for j, s in enumerate(x for x in seqs if x.q_len == 1)]
    plain, start = [], 0
    for s in seqs:
        if not s.draft_parents and s.window == (0, 0):
            plain.append(dataclasses.replace(s, q_start=start))
            start += s.q_len
    for step_seqs, bucket in ((seqs, None), (plain, None), (roots, StepBucket(len(roots), len(roots), tree=False))):
        step, slots = StepLayout.from_seqs(step_seqs), slot_mapping(step_seqs, block).to(dev)
        rows = step.num_tokens
        q, k, v = (torch.randn(h, rows, 64, device=dev, dtype=torch.bfloat16) for h in (12, 4, 4))
        fi.forward(0, q, k, v, fi.plan(step, slots, bucket), 64**-0.5)
    torch.cuda.synchronize()
    return f"attention {kind}: tree, causal, decode bucket"


def packing() -> str:
    _project()
    import torch
    from flashinfer.quantization import segment_packbits

    segment_packbits(torch.ones(64, dtype=torch.bool, device="cuda"), torch.tensor([0, 64], device="cuda"))
    return "mask packing"


JOBS = {"engine": (engine_modules,), "packing": (packing,), **{f"attention-{k}": (attention, k) for k in KINDS}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=len(JOBS))
    args = parser.parse_args(argv)
    import multiprocessing

    t0, failed = time.monotonic(), 0
    context = multiprocessing.get_context("spawn")  # CUDA in each job: never forked
    with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=context) as pool:
        futures = {pool.submit(*job): name for name, job in JOBS.items()}
        for done in as_completed(futures):
            name, seconds = futures[done], time.monotonic() - t0
            try:
                print(f"prebuild {name}: ok ({done.result()}) at {seconds:.0f} s", flush=True)
            except BaseException as e:  # a job's SystemExit too: the step that needs it builds it
                failed += 1
                print(f"prebuild {name}: FAILED at {seconds:.0f} s: {type(e).__name__}: {e}", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
