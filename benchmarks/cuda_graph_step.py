"""What a CUDA graph buys the native forward: ms per forward, eager against replayed (needs CUDA).

    python benchmarks/cuda_graph_step.py [--dtype bfloat16] [--context 256]

SmolLM2-135M in our native forward, rows 1 to 64 (decode roots or draft nodes), each attending
to a fixed `--context` of cached keys plus the step's own rows. The attention here is a plain SDPA
over static buffers, not the engine's FlashInfer backend (whose planning runs outside a graph):
the question is how much of a step is launch overhead of the model's own ops. The median of 50.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from batchserve.model import native_from_hf
from batchserve.runner import load_model

ROWS = (1, 4, 16, 32, 64)


class StaticContextAttention:
    """Each layer's queries over `context` cached keys and the step's rows (no mask: timing only)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, context: int, dtype: torch.dtype) -> None:
        shape = (layers, 1, kv_heads, context, head_dim)
        self.k = torch.randn(shape, device="cuda", dtype=dtype)
        self.v = torch.randn(shape, device="cuda", dtype=dtype)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: object, scale: float
    ) -> torch.Tensor:
        keys = torch.cat((self.k[layer_idx], k[None]), dim=2)  # [1, Hkv, C+T, D]; q, k, v: [heads, T, D]
        values = torch.cat((self.v[layer_idx], v[None]), dim=2)
        out = F.scaled_dot_product_attention(q[None], keys, values, scale=scale, enable_gqa=True)  # [1, Hq, T, D]
        return out[0].transpose(0, 1)  # [T, Hq, D]


class Meta:
    def __init__(self, backend: StaticContextAttention) -> None:
        self.backend = backend


def median_ms(fn: object, runs: int = 50) -> float:
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    hf, _ = load_model(None, args.dtype, "cuda")
    model = native_from_hf(hf)
    del hf
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = getattr(torch, args.dtype)
    meta = Meta(StaticContextAttention(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, args.context, dtype))
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, context {args.context}: ms per forward (median of 50)")
    print("| rows | eager | graph replay | eager / graph |\n|---|---|---|---|")
    for rows in ROWS:
        ids = torch.randint(0, cfg.vocab_size, (1, rows), device="cuda")
        pos = torch.arange(args.context, args.context + rows, device="cuda")[None]
        keep = torch.arange(rows, device="cuda")
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    model(ids, pos, keep, meta)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model(ids, pos, keep, meta)
            eager = median_ms(functools.partial(model, ids, pos, keep, meta))
            replay = median_ms(graph.replay)
        print(f"| {rows} | {eager:.2f} | {replay:.2f} | {eager / replay:.1f}x |")
        del graph


if __name__ == "__main__":
    main()
