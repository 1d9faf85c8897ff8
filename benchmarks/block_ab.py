"""Two builds of the block product kernels (block_gemm.cpp, block_pack.cpp and their headers) in
one process, alternating call by call, on the same random blocks: GOPS of each (2 x rows x N x K a
second, the median of 9) and whether their outputs are bit for bit equal.

    python benchmarks/block_ab.py OLD_DIR NEW_DIR [--rows 1,16,64] [--types Q4_K,Q6_K]
        [--shapes 14336x4096,4096x14336] [--arch-old haswell]

A directory holds a copy of `batchserve/kernels/csrc` (e.g. `git show REV:...` into it). Both are
built alike (`g++ -O3 -march=native`, or `--arch-*` to compare another instruction set's bits).
Compare the ratio within a line: a shared machine's speed moves between lines."""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from batchserve.model.blocks import random_blocks

FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC"]
ALIGN = 64


def build(source: Path, arch: str, out: Path) -> ctypes.CDLL:
    files = [str(source / "block_gemm.cpp"), str(source / "block_pack.cpp")]
    subprocess.run(["g++", *FLAGS, f"-march={arch}", "-o", str(out), *files], check=True)
    lib = ctypes.CDLL(str(out))
    lib.bs_block_packed_size.restype = ctypes.c_int64
    lib.bs_block_packed_size.argtypes = [ctypes.c_int64] * 3
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.bs_block_pack.argtypes = [i64, ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.bs_block_linear.argtypes = [ptr, i64, ptr, ptr, ctypes.c_int]
    return lib


def packed(lib: ctypes.CDLL, raw: np.ndarray, qtype: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the packed weights, their descriptor) for one build."""
    size = lib.bs_block_packed_size(qtype, n, k)
    buf = torch.empty(size + ALIGN, dtype=torch.uint8)
    skip = -buf.data_ptr() % ALIGN
    buf = buf[skip : skip + size]
    lib.bs_block_pack(qtype, raw.ctypes.data, n, k, raw.strides[0], buf.data_ptr(), 2)
    return buf, torch.tensor([k, n, 1, qtype, n, buf.data_ptr()], dtype=torch.int64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--types", default="Q4_K,Q6_K")
    parser.add_argument("--shapes", default="14336x4096,4096x14336", help="N x K, comma-separated")
    parser.add_argument("--arch-old", default="native")
    parser.add_argument("--arch-new", default="native")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        libs = [
            build(args.old, args.arch_old, Path(tmp) / "old.so"),
            build(args.new, args.arch_new, Path(tmp) / "new.so"),
        ]
        for name in args.types.split(","):
            qtype = int(T[name])
            for n, k in shapes:
                raw = np.ascontiguousarray(random_blocks(qtype, n, k, gen))
                packs = [packed(lib, raw, qtype, n, k) for lib in libs]
                cells = []
                for count in rows:
                    x = torch.randn(count, k, generator=gen)
                    ys = [torch.empty(count, n) for _ in libs]
                    times: list[list[float]] = [[], []]
                    for _ in range(9):
                        for i, lib in enumerate(libs):
                            start = time.perf_counter()
                            lib.bs_block_linear(
                                x.data_ptr(), count, packs[i][1].data_ptr(), ys[i].data_ptr(), args.threads
                            )
                            times[i].append(time.perf_counter() - start)
                    old, new = (2 * count * n * k / statistics.median(t) / 1e9 for t in times)
                    same = "" if torch.equal(ys[0], ys[1]) else " BITS DIFFER"
                    cells.append(f"{count} rows {old:4.0f} / {new:4.0f} GOPS {new / old:4.2f}x{same}")
                print(f"{name} {n}x{k}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
