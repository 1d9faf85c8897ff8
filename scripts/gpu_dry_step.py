"""The stand-in for a step's command in a dry run of the GPU check (`GPU_CHECK_DRY=1
scripts/gpu_check.sh` on any machine): it writes what the step would write, where the step's own
arguments say (`--junitxml=PATH`: one passing test; `--out DIR` or `--curve-out DIR`: a results.json
row and a report.md), and one line of log, so the walk through the steps, their time shares and the
packing (`scripts/gpu_pack.py`) are exercised without a device. A `batchserve.cli` command's
arguments are parsed by the CLI's own parser first: a flag the real run would refuse fails here too.

    python scripts/gpu_dry_step.py COMMAND ARGS...   # the step's command, as the real run would run it"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

JUNIT = '<testsuites><testsuite name="pytest" tests="1" failures="0" errors="0" skipped="0"></testsuite></testsuites>\n'


def main(argv: list[str]) -> int:
    time.sleep(float(os.environ.get("GPU_CHECK_DRY_SECONDS", "0")))
    if "batchserve.cli" in argv:
        from batchserve.cli import build_parser

        build_parser().parse_args(argv[argv.index("batchserve.cli") + 1 :])  # exits 2 on a bad flag
    for arg in argv:
        if arg.startswith("--junitxml="):
            Path(arg.partition("=")[2]).write_text(JUNIT)
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
