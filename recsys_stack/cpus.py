"""The CPUs this process may use: its cgroup's CPU quota, else its affinity mask.

``os.cpu_count()`` is the node's cores: a pod limited to 1 CPU on a 64-core node would start 64
TorchServe workers (and 64 torch threads each) that share one CPU's worth of time. The kernel
enforces a pod's ``resources.limits.cpu`` as a CFS quota on its cgroup, which is what this
module reads:

- cgroup v2: ``cpu.max`` (``"QUOTA PERIOD"`` or ``"max PERIOD"``);
- cgroup v1: ``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us`` in the ``cpu``
  controller's hierarchy.

The process's own group is named by ``/proc/self/cgroup``; that group and every ancestor up to
the mount's root are read and the smallest quota wins (a parent's limit binds its children).
In a container the group is usually ``/`` (a cgroup namespace), so the root's files are the
pod's. A quota is rounded up (1.5 CPUs -> 2), then capped by the affinity mask
(``sched_getaffinity``: a cpuset or ``taskset``); no quota -> the affinity mask.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def _own_groups(proc_cgroup: Path) -> dict[str, str]:
    """``{controller: path}`` from ``/proc/self/cgroup``; cgroup v2's unified line is ``""``."""
    out: dict[str, str] = {}
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                out[controller] = parts[2]
    return out


def _ancestors(base: Path, group: str) -> list[Path]:
    """``base/group`` and each parent folder up to ``base`` itself."""
    rel = Path(group.lstrip("/"))
    dirs = [base / rel, *(base / p for p in rel.parents)]
    return list(dict.fromkeys(dirs))


def _v2_quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPU quota (in CPUs, e.g. 0.5) of this process's cgroup or an ancestor, the smallest
    found; None when no group sets one (or there is no cgroup filesystem)."""
    groups = _own_groups(proc_cgroup)
    quotas: list[float] = []
    if (root / "cgroup.controllers").exists():  # v2 mounted at root
        found = [_v2_quota(d) for d in _ancestors(root, groups.get("", "/"))]
        quotas += [q for q in found if q is not None]
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):  # v1: the cpu controller's mount
        if (root / name / "cpu.cfs_quota_us").exists():
            found = [_v1_quota(d) for d in _ancestors(root / name, groups.get("cpu", "/"))]
            quotas += [q for q in found if q is not None]
            break
    return min(quotas) if quotas else None


def available_cpus(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP, affinity: int | None = None
) -> int:
    """Whole CPUs this process may use: the cgroup quota rounded up, at most ``affinity``
    (default: ``len(os.sched_getaffinity(0))``); the affinity alone without a quota."""
    if affinity is None:
        affinity = len(os.sched_getaffinity(0))
    quota = cpu_quota(root, proc_cgroup)
    if quota is None:
        return max(1, affinity)
    return max(1, min(affinity, math.ceil(quota)))
