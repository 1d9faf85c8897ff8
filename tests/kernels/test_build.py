"""Building our kernels: a CPU or compiler that cannot build them says why, nothing half-built is
left behind, and a build is made once per source, compiler and CPU, then reused."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchserve import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}")


def test_a_build_that_cannot_run_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("BATCHSERVE_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx", "sse4_2"})
    with pytest.raises(kernels.KernelUnavailable, match="lacks avx2, fma, f16c"):
        kernels.build()
    monkeypatch.undo()
    monkeypatch.setenv("BATCHSERVE_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with pytest.raises(kernels.KernelUnavailable, match="failed to build"):
        kernels.build()
    assert not list((tmp_path / "kernels").iterdir())  # no half-built file left behind
    monkeypatch.delenv("CXX")
    built = kernels.build()
    assert built.parent == tmp_path / "kernels" and built.stat().st_size > 0
    stamp = built.stat().st_mtime_ns
    assert kernels.build() == built and built.stat().st_mtime_ns == stamp  # built once, then reused
