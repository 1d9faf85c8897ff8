"""Pack a GPU check's work directory into the few files a lent machine sends back (at most 8,
directly under $OUT): `scripts/gpu_check.sh` runs this after every step, so a call cut at its
time limit still returns everything the steps before it wrote.

    python scripts/gpu_pack.py WORK OUT

Writes into OUT, each file whole (written beside WORK where that is on OUT's filesystem, else in
OUT, then renamed: a pack killed mid-write leaves nothing partial in OUT):
    results.json  every bench step's rows (WORK/<step>/results.json), each with its "step"
    report.md     the summary so far, then each step's report.md under its name
    logs.tgz      everything in WORK: logs, junit xml, curves, the reports
    summary.txt   WORK/summary.txt (one line per step so far) and WORK/device.txt
Nothing else is left in OUT (an earlier run's files of other names are removed)."""

from __future__ import annotations

import json
import os
import sys
import tarfile
from pathlib import Path

PACKED = ("results.json", "report.md", "logs.tgz", "summary.txt")


def _staging(work: Path, out: Path) -> Path:
    """Where a file is written before it is renamed into OUT: a folder beside WORK when it is on
    OUT's filesystem (a rename across filesystems is a copy), else OUT itself."""
    stage = work.parent / f".{work.name}.pack"
    try:
        stage.mkdir(exist_ok=True)
        if os.stat(stage).st_dev == os.stat(out).st_dev:
            return stage
        stage.rmdir()
    except OSError:
        pass
    return out


def _write(stage: Path, out: Path, name: str, data: bytes) -> None:
    tmp = stage / f".{name}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, out / name)


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def pack(work: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    steps = sorted(p for p in work.iterdir() if p.is_dir())
    rows: list[dict[str, object]] = []
    reports = []
    for step in steps:
        try:
            found = json.loads(_text(step / "results.json") or "[]")
        except json.JSONDecodeError:  # a step stopped while writing: its log says so
            found = []
        rows += [{"step": step.name, **row} for row in found if isinstance(row, dict)]
        if report := _text(step / "report.md"):
            reports.append(f"# {step.name}\n\n{report.strip()}\n")
    summary = _text(work / "summary.txt") + (
        "\n" + _text(work / "device.txt") if (work / "device.txt").exists() else ""
    )
    stage = _staging(work, out)
    _write(stage, out, "results.json", json.dumps(rows, indent=1).encode())
    _write(stage, out, "report.md", ("```\n" + summary.strip() + "\n```\n\n" + "\n".join(reports)).encode())
    _write(stage, out, "summary.txt", summary.encode())
    tmp = stage / ".logs.tgz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(work, arcname="gpu_check")
    os.replace(tmp, out / "logs.tgz")
    if stage != out:
        stage.rmdir()  # empty again: every file renamed into OUT
    for stray in out.iterdir():  # only the packed files come back: nothing else may take a place
        if stray.name not in PACKED:
            if stray.is_dir():
                continue  # never ours to remove; the test of the dry run shows none is made
            stray.unlink()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    pack(Path(sys.argv[1]), Path(sys.argv[2]))
