"""recsys_stack/cpus.py: the CPUs a pod may use, from cgroup files laid out as the kernel does
(v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``) in a temporary folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from recsys_stack.cpus import available_cpus, cpu_quota
from serving.torchserve.config import TorchServeConfig


def v2(tmp_path: Path, cpu_max: str, group: str = "/", parent_max: str | None = None) -> Path:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    leaf = root / group.lstrip("/")
    leaf.mkdir(parents=True, exist_ok=True)
    (leaf / "cpu.max").write_text(f"{cpu_max}\n")
    if parent_max is not None:
        (leaf.parent / "cpu.max").write_text(f"{parent_max}\n")
    (tmp_path / "self-cgroup").write_text(f"0::{group}\n")
    return root


def v1(tmp_path: Path, quota: int, period: int = 100000) -> Path:
    root = tmp_path / "cgroup"
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    (tmp_path / "self-cgroup").write_text("4:cpu,cpuacct:/\n0::/\n")
    return root


@pytest.mark.parametrize(
    ("cpu_max", "quota", "cpus"),
    [("100000 100000", 1.0, 1), ("150000 100000", 1.5, 2), ("50000 100000", 0.5, 1),
     ("400000 100000", 4.0, 4), ("max 100000", None, 64)],
)  # fmt: skip
def test_v2_quota_rounded_up_else_the_affinity(
    tmp_path: Path, cpu_max: str, quota: float | None, cpus: int
) -> None:
    root = v2(tmp_path, cpu_max)
    assert cpu_quota(root, tmp_path / "self-cgroup") == quota
    assert available_cpus(root, tmp_path / "self-cgroup", affinity=64) == cpus


def test_v2_the_tightest_of_the_group_and_its_parents(tmp_path: Path) -> None:
    root = v2(tmp_path, "max 100000", group="/kubepods/pod1/c1", parent_max="200000 100000")
    assert available_cpus(root, tmp_path / "self-cgroup", affinity=64) == 2


def test_v1_quota_and_no_quota(tmp_path: Path) -> None:
    root = v1(tmp_path, 250000)
    assert available_cpus(root, tmp_path / "self-cgroup", affinity=64) == 3
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert available_cpus(root, tmp_path / "self-cgroup", affinity=64) == 64


def test_the_affinity_caps_a_larger_quota_and_no_cgroup_is_the_affinity(tmp_path: Path) -> None:
    root = v2(tmp_path, "800000 100000")
    assert available_cpus(root, tmp_path / "self-cgroup", affinity=2) == 2
    assert available_cpus(tmp_path / "none", tmp_path / "none", affinity=3) == 3


def test_torchserve_workers_zero_means_the_cpus_this_process_may_use() -> None:
    assert TorchServeConfig(workers=0).worker_count() == available_cpus()
    assert TorchServeConfig(workers=3).worker_count() == 3
