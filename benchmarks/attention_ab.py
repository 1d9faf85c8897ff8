"""A CPU attention backend alone: ms per step of 30 layers, on SmolLM2's shapes.

    PYTHONPATH=<checkout> python benchmarks/attention_ab.py NAME [torch|invariant]

Run it once per checkout to compare two versions of the backend on one machine, or once per
backend (the torch reference, the batch-invariant one) to compare them. Each request's
blocks lie in one run of the pool; keys are drawn per request from the given range.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from batchserve.attention import InvariantBackend, SeqLayout, StepLayout, TorchReferenceBackend, slots_of

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
# (requests, fewest keys, most keys, rows per request)
CASES = ((1, 150, 280, 1), (4, 150, 280, 1), (16, 150, 280, 1), (16, 150, 280, 4), (1, 150, 280, 8))
CASES += ((16, 500, 1000, 1), (16, 300, 2800, 1))


def step_ms(num_seqs: int, low: int, high: int, rows: int, backend_cls: type, repeats: int = 10) -> float:
    keys = np.random.default_rng(0).integers(low, high, size=num_seqs)
    blocks_each = [-(-(int(k) + rows) // BLOCK) for k in keys]
    extra = {"num_qo_heads": HEADS} if backend_cls is InvariantBackend else {}
    backend = backend_cls(LAYERS, sum(blocks_each) + 8, BLOCK, KV_HEADS, HEAD_DIM, **extra)
    seqs, start, first = [], 0, 0
    for k, n in zip(keys.tolist(), blocks_each):
        parents = (None, *range(rows - 2)) if rows > 1 else ()  # a chain of draft rows
        seqs.append(SeqLayout(start, rows, k, 1, parents, tuple(range(first, first + n))))
        start, first = start + rows, first + n
    step = StepLayout.from_seqs(seqs)
    slots = torch.cat([slots_of(s.block_ids, BLOCK, torch.arange(s.num_cached, s.kv_len)) for s in seqs])
    q = torch.randn(HEADS, start, HEAD_DIM)  # [Hq, T, D]
    k, v = torch.randn(KV_HEADS, start, HEAD_DIM), torch.randn(KV_HEADS, start, HEAD_DIM)

    def run() -> None:
        meta = backend.build_metadata(step, slots)
        for layer in range(LAYERS):
            backend.forward(layer, q, k, v, meta, HEAD_DIM**-0.5)

    run()
    t0 = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    torch.set_num_threads(2)
    name = sys.argv[1] if len(sys.argv) > 1 else "this checkout"
    backend_cls = InvariantBackend if sys.argv[2:] == ["invariant"] else TorchReferenceBackend
    for num_seqs, low, high, rows in CASES:
        ms = step_ms(num_seqs, low, high, rows, backend_cls)
        print(f"{name}: {num_seqs} requests, {low}-{high} keys, {rows} rows each: {ms:7.2f} ms", flush=True)


if __name__ == "__main__":
    main()
