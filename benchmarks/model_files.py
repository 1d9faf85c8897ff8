"""A model file as a user brings it: time to ready, peak memory and plain decoding speed of the
engine on a GGUF (or HF directory), in one process, and the same file on llama.cpp's
`llama-bench` and `llama-batched-bench` where they are found. One JSON line per file.

    python benchmarks/model_files.py FILE [FILE ...] [--in-flight 1,4,16] [--tokens 64] [--llama-bin DIR]

Real-shaped files come from `batchserve bench --write-gguf PATH --shape NAME --quant Q4_K_M`
(random blocks: real speed and memory, noise for text). Each file is measured in a fresh
process (peak RSS is the process's), twice: the first start reads and checks, the second finds
the metadata and the invariance verdict cached (by file and CPU).

Rates, medians of 3 runs of prompts no earlier run saw: `tok_s_N`, N requests of 32 prompt tokens
each decoding `--tokens` + 1 tokens, the prefill included; `decode_tok_s_N`, the decoding alone (that
time less a run of one token each), which is what llama-bench's tg and llama-batched-bench's S_TG
time."""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPEATS = 3  # runs a count of requests is timed, the median reported (llama-bench: -r 3 below)


def measure(path: str, in_flight: list[int], tokens: int) -> dict[str, object]:
    """In this process: load, then `tokens` tokens for each count of requests at once."""
    t0 = time.perf_counter()
    from batchserve import LLM, SamplingParams

    llm = LLM(path, draft="none", max_num_seqs=max(in_flight), kv_cache_memory_gb=0.5)
    out: dict[str, object] = {"file": path, "ready_s": round(time.perf_counter() - t0, 1)}
    out["rss_after_load_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    out["weights"] = llm.engine.facts.forward.weights.why
    prompt = list(range(1000, 1032))  # 32 tokens, as llama-batched-bench's -npp 32 below
    for n in in_flight:
        llm.generate([prompt] * n, SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm
        rates, decode_rates = [], []
        for rep in range(REPEATS):  # the first run after a load is the slowest (pages still coming in)
            t_full = _timed(llm, _prompts(prompt, n, 2 * rep + 1), tokens + 1)
            t_first = _timed(llm, _prompts(prompt, n, 2 * rep + 2), 1)
            rates.append(n * (tokens + 1) / t_full)
            decode_rates.append(n * tokens / (t_full - t_first))
        out[f"tok_s_{n}"] = round(statistics.median(rates), 2)
        out[f"decode_tok_s_{n}"] = round(statistics.median(decode_rates), 2)
    out["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    return out


def _prompts(prompt: list[int], n: int, salt: int) -> list[list[int]]:
    """n prompts no earlier run saw (the prefix cache must not shorten a timed prefill)."""
    return [[p + 97 * salt + i for p in prompt] for i in range(n)]


def _timed(llm: object, prompts: list[list[int]], tokens: int) -> float:
    from batchserve import SamplingParams

    t = time.perf_counter()
    results = llm.generate(prompts, SamplingParams(max_new_tokens=tokens, ignore_eos=True))  # type: ignore[attr-defined]
    assert all(len(r.token_ids) == tokens for r in results)
    return time.perf_counter() - t


def llama_cpp(path: str, in_flight: list[int], tokens: int, bin_dir: Path) -> dict[str, object]:
    """llama.cpp on the same file, 2 threads: llama-bench's decoding at one request, and
    llama-batched-bench's decoding (S_TG) at each count in flight."""
    out: dict[str, object] = {}
    bench = subprocess.run(
        [str(bin_dir / "llama-bench"), "-m", path, "-t", "2", "-p", "0", "-n", str(tokens), "-r", "3", "-o", "json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if bench.returncode == 0:
        out["llama_bench_tok_s_1"] = round(json.loads(bench.stdout)[0]["avg_ts"], 2)
    batched = subprocess.run(
        [str(bin_dir / "llama-batched-bench"), "-m", path, "-c", "8192", "-b", "2048", "-ub", "512", "-npp", "32",
         "-ntg", str(tokens), "-npl", ",".join(map(str, in_flight)), "-t", "2"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    for line in batched.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[2]):
            out[f"llama_batched_tok_s_{cells[2]}"] = float(cells[7])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--in-flight", default="1,4,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--llama-bin", type=Path, default=None, help="llama.cpp's bin directory (llama-bench, ...)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    in_flight = [int(n) for n in args.in_flight.split(",")]
    if args.child:
        print(json.dumps(measure(args.files[0], in_flight, args.tokens)))
        return 0
    for path in args.files:
        row: dict[str, object] = {}
        for start in ("first", "second"):
            argv = [
                sys.executable,
                __file__,
                path,
                "--child",
                "--in-flight",
                args.in_flight,
                "--tokens",
                str(args.tokens),
            ]
            child = subprocess.run(argv, capture_output=True, text=True, check=True, env=os.environ)
            result = json.loads(child.stdout.strip().splitlines()[-1])
            row.update(result if start == "first" else {"second_ready_s": result["ready_s"]})
        if args.llama_bin is not None:
            row.update(llama_cpp(path, in_flight, args.tokens, args.llama_bin))
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
