"""The served engine, two versions side by side: `batchserve serve` (make serve's settings) from
two source trees on one machine, the same HumanEval prompts over HTTP (streamed
/v1/completions, greedy) at each load, in alternating rounds, so drift hits both alike.

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/serving_ab.py --a /tmp/before --b . --loads 1,16 --rounds 3 \\
        --out benchmarks/results/served/ab.json

Prints tokens/s per round and the median ratio b / a per load, and the version each server
reported running (its source tree). Each load runs under a tenant of its own, so its drafts
never copy an earlier load's answers to the same prompts. `--draft none` runs both without drafts (the serving path's
cost alone).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from batchserve.bench import served, servers
from batchserve.bench.datasets import humaneval
from batchserve.model.loader import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="source tree A (the baseline)")
    parser.add_argument("--b", type=Path, required=True, help="source tree B")
    parser.add_argument("--loads", default="1,16", help="requests in flight, comma-separated")
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts per load (at least 2 x the load)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--draft", default=None, help="--draft for both servers (default: make serve's)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    loads = [int(x) for x in args.loads.split(",")]
    for name in ("a", "b"):  # where each server's package comes from, as servers.batchserve_server runs it
        source = getattr(args, name).resolve()
        where = subprocess.run(
            [sys.executable, "-c", "import batchserve; print(batchserve.__file__)"],
            cwd=source, env={**os.environ, "PYTHONPATH": str(source)}, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        print(f"{name}: {where}")
    tokenizer = load_tokenizer()
    samples = humaneval()
    logs = Path(tempfile.mkdtemp(prefix="serving_ab_"))
    results: dict[str, dict[int, list[float]]] = {"a": {c: [] for c in loads}, "b": {c: [] for c in loads}}
    texts: dict[str, dict[int, list[str]]] = {"a": {}, "b": {}}
    for r in range(args.rounds):
        for name in ("a", "b") if r % 2 == 0 else ("b", "a"):
            source = getattr(args, name).resolve()
            log = logs / f"{name}{r}.log"
            with servers.batchserve_server(max(loads), log, draft=args.draft, source=source) as (_, base):
                for c in loads:
                    prompts = [tokenizer.encode(s.prompt) for s in samples[: max(args.num_prompts, 2 * c)]]
                    served.run_http(base, prompts[: min(4, len(prompts))], 8, c)  # warm the server's paths
                    # Its own tenant: a fresh trie and prefix cache, not the earlier loads' outputs.
                    run = served.run_http(base, prompts, args.max_new_tokens, c, tenant=f"ab-{name}-{r}-{c}")
                    tps = run.tokens / run.seconds
                    results[name][c].append(tps)
                    texts[name].setdefault(c, run.texts)
                    print(f"round {r} {name} C={c}: {tps:.1f} tok/s (TTFT p50 {statistics.median(run.ttfts):.3f} s)")
    summary = {}
    for c in loads:
        a, b = statistics.median(results["a"][c]), statistics.median(results["b"][c])
        same = texts["a"][c] == texts["b"][c]
        summary[c] = {"a": a, "b": b, "ratio": b / a, "same_text": same}
        print(f"C={c}: a {a:.1f}, b {b:.1f} tok/s (medians of {args.rounds}): b/a {b / a:.3f}; same text: {same}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"rounds": results, "summary": summary, "args": vars(args)}
        args.out.write_text(json.dumps(record, default=str, indent=1))


if __name__ == "__main__":
    main()
