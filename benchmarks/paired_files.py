"""One request's plain decoding on two model files, both served by us and loaded side by side,
in alternating rounds: what one family's layers cost against another's at the same sizes (a
Qwen3 file against a Llama file of its shape: the per-head q/k norms), with the machine's noise
hitting both sides of a round alike.

    python benchmarks/paired_files.py FILE_A FILE_B [--rounds 10] [--tokens 32] [--json]

Each side: `LLM(FILE, draft="none")`, decoding rate = tokens / (time for tokens + 1 minus time
for 1): the prompt's prefill and first token left out. Prints one line a round, then the median
of A's rate over B's."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

PROMPT = list(range(1000, 1032))  # 32 token ids, valid in any vocabulary of 1032 or more


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file_a", type=Path)
    parser.add_argument("file_b", type=Path)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not 1 <= args.rounds <= 1000 or not 1 <= args.tokens <= 4096:
        parser.error("--rounds is 1..1000 and --tokens 1..4096")
    for path in (args.file_a, args.file_b):
        if not path.is_file():
            parser.error(f"no such file: {path}")

    from batchserve import LLM, SamplingParams

    engines = [LLM(str(p), draft="none", max_num_seqs=1, kv_cache_memory_gb=0.5) for p in (args.file_a, args.file_b)]
    forwards = [llm.engine.facts.forward.name for llm in engines]

    def rate(llm: LLM) -> float:
        def timed(count: int) -> float:
            start = time.perf_counter()
            llm.generate([PROMPT], SamplingParams(max_new_tokens=count, ignore_eos=True))
            return time.perf_counter() - start

        return args.tokens / (timed(args.tokens + 1) - timed(1))

    for llm in engines:
        rate(llm)  # warm
    rounds = []
    for i in range(args.rounds):
        a, b = rate(engines[0]), rate(engines[1])
        rounds.append({"a": round(a, 3), "b": round(b, 3), "ratio": round(a / b, 3)})
        print(f"round {i}: A {a:.2f}, B {b:.2f} tok/s: {a / b:.3f}x", file=sys.stderr, flush=True)
    ratios = [r["ratio"] for r in rounds]
    summary = {
        "a": str(args.file_a), "b": str(args.file_b), "forwards": forwards, "tokens": args.tokens,
        "rounds": rounds, "median_ratio": round(statistics.median(ratios), 3),
    }  # fmt: skip
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"A: {forwards[0]}\nB: {forwards[1]}")
        print(f"median A/B {summary['median_ratio']:.3f}x over {len(ratios)} rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
