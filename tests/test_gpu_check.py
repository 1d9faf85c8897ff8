"""The GPU check's dry run (`GPU_CHECK_DRY=1 scripts/gpu_check.sh`): the same steps, shares and
packing as on a device, each step's command replaced by what it would write. What a lent machine
returns is at most 8 plain files directly under $OUT, so the pack must fit that after every step,
and a call killed at its limit must still leave the steps before it packed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("kernels", "graphs", "parity-kernels", "bench", "peer", "parity-engine", "sharegpt", "shape", "versions")
PACKED = {"results.json", "report.md", "logs.tgz", "summary.txt"}


def _env(out: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(out), "PYTHON": sys.executable, **extra}


def _check_pack(out: Path) -> list[dict[str, object]]:
    entries = list(out.iterdir())
    assert len(entries) <= 8 and all(e.is_file() for e in entries), entries  # what comes back from a device
    assert {e.name for e in entries} == PACKED
    return json.loads((out / "results.json").read_text())


def test_the_dry_run_walks_every_step_into_four_files_within_the_budget(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("an earlier run's")  # nothing but the pack may take a place
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=_env(out), capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "budget 420 s" in run.stdout
    rows = _check_pack(out)
    assert {row["step"] for row in rows} == {"humaneval", "peer", "sharegpt", "shape"}
    summary = (out / "summary.txt").read_text()
    lines = [line.split()[0] for line in summary.splitlines()[1:] if line.split() and line.split()[0] in STEPS]
    assert tuple(lines) == STEPS and "every step passed" in summary
    timeouts = [int(line.rsplit("timeout ", 1)[1].split()[0]) for line in summary.splitlines() if "timeout" in line]
    assert all(0 < t <= 420 for t in timeouts)
    report = (out / "report.md").read_text()
    assert "# humaneval" in report and "# peer" in report and "gpu_check: every step passed" in report
    with tarfile.open(out / "logs.tgz") as tar:
        names = set(tar.getnames())
    assert {f"gpu_check/{s}.txt" for s in STEPS if s != "versions"} <= names
    assert {"gpu_check/graphs.xml", "gpu_check/humaneval/report.md", "gpu_check/device.txt"} <= names


def test_a_run_killed_mid_step_leaves_the_steps_before_it_packed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen(
        ["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=_env(out, GPU_CHECK_DRY_SECONDS="1"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the bench step's row is packed
            if (out / "results.json").exists() and "humaneval" in (out / "results.json").read_text():
                break
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # as a device's time limit ends a call
        proc.wait()
    steps = [row["step"] for row in _check_pack(out)]
    assert steps[0] == "humaneval" and "shape" not in steps  # killed a few steps before the shape's
    summary = (out / "summary.txt").read_text()
    assert "bench" in summary and "shape" not in summary


def test_the_dry_run_refuses_a_flag_the_real_run_would_refuse() -> None:
    step = [sys.executable, "scripts/gpu_dry_step.py", sys.executable, "-m", "batchserve.cli", "bench"]
    good = subprocess.run([*step, "--peer-repeats", "2"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert good.returncode == 0, good.stderr
    bad = subprocess.run([*step, "--peers-repeats", "2"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unrecognized arguments: --peers-repeats" in bad.stderr
