"""How many torch threads the server runs: the flag, the deployment's variable, or the cores this
process may use (affinity and cgroup quota)."""

from __future__ import annotations

import os

import pytest

from batchserve.threads import THREADS_ENV, available_cpus, cgroup_cpu_limit, resolve_threads


def test_the_cgroup_quota_is_read_from_v2_then_v1(tmp_path):
    assert cgroup_cpu_limit(str(tmp_path)) is None  # no cgroup files: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) == 1.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(str(v1)) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    assert cgroup_cpu_limit(str(v1)) == 3.0


def test_the_cores_this_process_may_use_are_its_affinity_capped_by_the_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert available_cpus(str(tmp_path)) == (affinity, "the CPU affinity")
    (tmp_path / "cpu.max").write_text(f"{(affinity + 3) * 100000} 100000\n")
    assert available_cpus(str(tmp_path))[0] == affinity  # a quota above the affinity changes nothing
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a core: one thread, never zero
    assert available_cpus(str(tmp_path)) == (1, "the cgroup's CPU quota of 0.5")


def test_the_flag_then_the_variable_then_the_cores():
    assert resolve_threads(3, {THREADS_ENV: "5"}) == (3, "--num-threads")
    assert resolve_threads(None, {THREADS_ENV: " 5 "}) == (5, f"${THREADS_ENV}")
    assert resolve_threads(None, {})[0] == available_cpus()[0]
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(ValueError, match=THREADS_ENV):
            resolve_threads(None, {THREADS_ENV: bad})


def test_num_threads_is_a_checked_setting():
    from batchserve.config import EngineConfig, ModelConfig

    assert EngineConfig().with_settings(num_threads=4).model.num_threads == 4
    with pytest.raises(ValueError, match="num_threads"):
        ModelConfig(num_threads=0)
