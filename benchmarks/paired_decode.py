"""One request's plain decoding on the same file, ours and llama-server's, in alternating rounds
with both loaded: the machine's noise (a shared VM's memory bandwidth moves by 20% in minutes)
hits both sides of a round alike, so the per-round ratio is the number to read.

    python benchmarks/paired_decode.py FILE --llama-server PATH [--rounds 10] [--tokens 32]

Ours: `LLM(FILE, draft="none")` in this process, decoding rate = tokens / (time for tokens + 1
minus time for 1), so the prompt's prefill and first token are left out on our side. Theirs:
`llama-server -t 2` on a local port, its own `timings.predicted_per_second` for the same prompt
(32 token ids) and count, greedy, prompt cache off. Both have the file's weights in memory
(about twice the file: check it fits). Prints one line a round and the median ratio; JSON
with `--json`."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

PROMPT = list(range(1000, 1032))  # 32 token ids, valid in any vocabulary of 1032 or more


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise SystemExit(f"llama-server not ready after {timeout_s:.0f} s")


def theirs(url: str, tokens: int) -> float:
    body = {"prompt": PROMPT, "n_predict": tokens + 1, "ignore_eos": True, "cache_prompt": False, "temperature": 0}
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=600) as response:
        return float(json.load(response)["timings"]["predicted_per_second"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path)
    parser.add_argument("--llama-server", type=Path, default=os.environ.get("LLAMA_SERVER"), required=False)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.llama_server is None:
        parser.error("--llama-server PATH (or LLAMA_SERVER) is required")
    if not 1 <= args.rounds <= 1000 or not 1 <= args.tokens <= 4096:
        parser.error("--rounds is 1..1000 and --tokens 1..4096")

    from batchserve import LLM, SamplingParams

    url = f"http://127.0.0.1:{args.port}"
    command = [str(args.llama_server), "-m", str(args.file), "-t", "2", "-c", "1024", "-np", "1"]
    command += ["--port", str(args.port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, server)
        llm = LLM(str(args.file), draft="none", max_num_seqs=1, kv_cache_memory_gb=0.5)

        def timed(count: int) -> float:
            start = time.perf_counter()
            llm.generate([PROMPT], SamplingParams(max_new_tokens=count, ignore_eos=True))
            return time.perf_counter() - start

        def ours() -> float:
            return args.tokens / (timed(args.tokens + 1) - timed(1))

        ours(), theirs(url, args.tokens)  # warm both
        rounds = []
        for i in range(args.rounds):
            a, b = ours(), theirs(url, args.tokens)
            rounds.append({"ours": round(a, 3), "llama_server": round(b, 3), "ratio": round(a / b, 3)})
            print(f"round {i}: ours {a:.2f}, llama-server {b:.2f} tok/s: {a / b:.2f}x", file=sys.stderr, flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    ratios = [r["ratio"] for r in rounds]
    summary = {"file": str(args.file), "tokens": args.tokens, "rounds": rounds,
               "median_ratio": round(statistics.median(ratios), 3),
               "rounds_above_1": sum(r > 1.0 for r in ratios)}  # fmt: skip
    if args.json:
        print(json.dumps(summary))
    else:
        above = summary["rounds_above_1"]
        print(f"median {summary['median_ratio']:.2f}x over {len(ratios)} rounds, {above} above 1.0x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
