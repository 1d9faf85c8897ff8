"""The CPU product kernels on SmolLM2's shapes, by rows per call: ms for one step's products.

    .venv/bin/python benchmarks/quant_products.py [--rows 1,2,4,8,16,32,64] [--repeats 5] [--kernels q4_1,bf16]

Layers: 30 x (q|k|v 960x576, o 576x576, gate|up 3072x576, down 576x1536) on random weights of
each format; head: the 49152x576 LM head. Each kernel runs every layer once per repeat (the
weights do not fit the caches, as in a real step); the median is printed. Kernels:
- `q4_1`, `q8_0` ours over random blocks of that GGUF type (`BlockLinear`,
  batchserve/kernels/csrc/block_gemm.cpp), int8 activations;
- `int8pack` torch's `_weight_int8pack_mm` (int8 per output channel: not the file's blocks, a
  reference point only);
- `float32` oneDNN prepacked, and `bfloat16` oneDNN prepacked where this CPU has it;
- `bf16` ours over the same bfloat16 weights (batchserve/kernels/csrc/bf16_gemm.cpp:
  AVX512-BF16's dot products where the CPU has them, else bfloat16 widened to float32 FMAs on
  AVX-512F or AVX2), invariant by construction."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType as T
from torch import nn

from batchserve import kernels
from batchserve.model.bf16 import KernelBf16Linear
from batchserve.model.blocks import BlockLinear, BlockPart, random_blocks
from batchserve.model.layers import Bf16Linear, PackedLinear, bf16_prepack_available

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in)
HEAD = (49152, 576)


class Int8Pack(nn.Module):
    def __init__(self, n: int, k: int, gen: torch.Generator) -> None:
        super().__init__()
        self.in_features = k
        self.weight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        self.scales = torch.rand(n, generator=gen).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scales).float()


def _linear(n: int, k: int, gen: torch.Generator) -> nn.Linear:
    layer = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
    return layer


def _blocks(qtype: T) -> Callable[[int, int, torch.Generator], nn.Module]:
    return lambda n, k, gen: BlockLinear([BlockPart(random_blocks(qtype, n, k, gen), qtype, k)])


def builders() -> dict[str, Callable[[int, int, torch.Generator], nn.Module]]:
    made: dict[str, Callable[[int, int, torch.Generator], nn.Module]] = {
        "int8pack": Int8Pack,
        "float32": lambda n, k, g: PackedLinear(_linear(n, k, g)),
    }
    if kernels.available():
        made["q4_1"], made["q8_0"] = _blocks(T.Q4_1), _blocks(T.Q8_0)
        made["bf16"] = lambda n, k, g: KernelBf16Linear(_linear(n, k, g))
    if bf16_prepack_available():
        made["bfloat16"] = lambda n, k, g: Bf16Linear(_linear(n, k, g))
    return made


def time_layers(layers: list[nn.Module], rows: int, repeats: int) -> float:
    inputs = {k: torch.randn(rows, k) for k in {layer.in_features for layer in layers}}
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        start = time.perf_counter()
        for layer in layers:
            layer.forward(inputs[layer.in_features])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kernels", default="", help="comma-separated kernel names (default: all that run here)")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    print("| kernel | part | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    chosen = set(args.kernels.split(",")) - {""}
    for name, build in builders().items():
        if chosen and name not in chosen:
            continue
        parts = {"layers": [build(n, k, gen) for _ in range(30) for n, k in LAYER_SHAPES], "head": [build(*HEAD, gen)]}
        for part, layers in parts.items():
            cells = [f"{time_layers(layers, r, args.repeats):.1f}" for r in rows]
            print(f"| {name} | {part} | " + " | ".join(cells) + " |", flush=True)
        del parts


if __name__ == "__main__":
    main()
