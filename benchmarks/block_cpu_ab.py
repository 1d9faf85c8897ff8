"""block_ab.py's builds of the block kernels (two or more source directories), alternating call
by call over the builds, timed by the calling thread's CPU time at one thread (the OpenMP team is
the caller alone: time a preempted thread waits is not counted, so a machine other processes share
still gives a usable ratio) or by the wall clock at --threads 2. Each build's median of --reps
calls, or with --stat min its fastest (what a call takes undisturbed). --copies C packs C copies of
the weights per build and calls them in turn, so a matrix smaller than the last-level cache still
comes from memory, as in a model's step; they are in huge pages, as BlockLinear keeps them. GB/s is
each build's packed bytes over that time (a 1-row product reads each once); the ratios are the
first build's time over each other's, and a build whose output differs from the first's in any bit
is flagged.

    python benchmarks/block_cpu_ab.py DIR DIR [DIR ...] [--rows 1] [--types IQ4_NL,Q4_0]
        [--shapes 4096x4096,14336x4096,4096x14336] [--reps 31] [--threads 1] [--arch native,...]
        [--stat min] [--copies 1]"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).parent))
from block_ab import build

from batchserve.model.blocks import _aligned, random_blocks


def packed(lib, raw: np.ndarray, qtype: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the packed weights, their descriptor) for one build, in huge pages as `BlockLinear` keeps them."""
    size = lib.bs_block_packed_size(qtype, n, k)
    buf = _aligned(size)
    lib.bs_block_pack(qtype, raw.ctypes.data, n, k, raw.strides[0], buf.data_ptr(), 2)
    return buf, torch.tensor([k, n, 1, qtype, n, buf.data_ptr()], dtype=torch.int64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", type=Path, nargs="+")
    parser.add_argument("--rows", default="1")
    parser.add_argument("--types", default="IQ4_NL,Q4_0")
    parser.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336", help="N x K, comma-separated")
    parser.add_argument("--arch", default="native", help="-march for each build, comma-separated (one for all)")
    parser.add_argument("--reps", type=int, default=31)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stat", choices=("median", "min"), default="median")
    parser.add_argument("--copies", type=int, default=1)
    args = parser.parse_args()
    stat = statistics.median if args.stat == "median" else min
    if len(args.dirs) < 2:
        parser.error("give two or more source directories")
    arches = args.arch.split(",")
    arches = arches * len(args.dirs) if len(arches) == 1 else arches
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    gen = torch.Generator().manual_seed(0)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(d, a, Path(tmp) / f"lib{i}.so") for i, (d, a) in enumerate(zip(args.dirs, arches, strict=True))]
        for name in args.types.split(","):
            qtype = int(T[name])
            for n, k in shapes:
                raw = np.ascontiguousarray(random_blocks(qtype, n, k, gen))
                packs = [[packed(lib, raw, qtype, n, k) for _ in range(args.copies)] for lib in libs]
                cells = []
                for count in rows:
                    x = torch.randn(count, k, generator=gen)
                    ys = [torch.empty(count, n) for _ in libs]
                    times: list[list[float]] = [[] for _ in libs]
                    for r in range(args.reps):
                        for i, lib in enumerate(libs):
                            desc = packs[i][r % args.copies][1]
                            start = clock()
                            lib.bs_block_linear(x.data_ptr(), count, desc.data_ptr(), ys[i].data_ptr(), args.threads)
                            times[i].append(clock() - start)
                    medians = [stat(t) for t in times]
                    parts = [f"{packs[0][0][0].numel() / medians[0] / 1e9:5.1f}"]
                    for i in range(1, len(libs)):
                        same = "" if torch.equal(ys[0], ys[i]) else " BITS DIFFER"
                        gbs = packs[i][0][0].numel() / medians[i] / 1e9
                        parts.append(f"{gbs:5.1f} ({medians[0] / medians[i]:4.2f}x{same})")
                    cells.append(f"{count} rows GB/s " + " / ".join(parts))
                print(f"{name} {n}x{k}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
