"""The stand-in for a step's command in a dry run of the GPU check (`GPU_CHECK_DRY=1
scripts/gpu_check.sh` on any machine), so the walk through the steps, their time shares, the
verdicts and the packing (`scripts/gpu_pack.py`) are exercised without a device:

- a pytest step runs for real: its gpu tests are collected (the count the verdict checks) and each
  skips without a device, into the real junit xml;
- a `batchserve.cli bench` step's arguments go through the CLI's parser and the checks the bench
  makes of them before it loads anything (`bench.commands.bench_problem`): what the real run would refuse
  fails here too; then a results.json row and a report.md where `--out DIR` or `--curve-out DIR` say.

GPU_CHECK_DRY_SECONDS: seconds each step sleeps first (a step that overruns its share).

    python scripts/gpu_dry_step.py COMMAND ARGS...   # the step's command, as the real run would run it"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    time.sleep(float(os.environ.get("GPU_CHECK_DRY_SECONDS", "0")))
    if argv[1:3] == ["-m", "pytest"]:
        return subprocess.run(argv).returncode  # the real run: collected, then skipped without a device
    if "batchserve.cli" in argv:
        from batchserve.cli import build_parser

        args = build_parser().parse_args(argv[argv.index("batchserve.cli") + 1 :])  # exits 2 on a bad flag
        if getattr(args, "command", None) == "bench":
            from batchserve.bench.commands import bench_problem

            if (problem := bench_problem(args)) is not None:  # what the bench refuses once parsed
                print(f"batchserve bench: {problem}", file=sys.stderr)
                return 2
    for flag in ("--out", "--curve-out"):
        if flag in argv[:-1]:
            out = Path(argv[argv.index(flag) + 1])
            out.mkdir(parents=True, exist_ok=True)
            row = {"method": "dry-run", "batch_size": 1, "tokens_per_s": 0.0}
            (out / "results.json").write_text(json.dumps([row]))
            (out / "report.md").write_text("| method | batch | tokens/s |\n|---|---|---|\n| dry-run | 1 | 0.0 |\n")
    print("dry run of:", " ".join(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
