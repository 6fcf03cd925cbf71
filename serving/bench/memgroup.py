"""A cgroup v1 memory group for ``make bench-scale``: what a replica is charged, and a limit.

A process's memory is charged to the group it was in when it touched each page, and this
kernel moves no charge when a process changes group (``memory.move_charge_at_immigrate`` is
refused): a process moved into a group once it is READY keeps its tables and its own memory
charged elsewhere, so a limit on that group confines nothing (measured: peak 277-281 MB of a
514-539 MB limit, and "confined" ran faster than unconfined). So TorchServe is *started
inside* the group (:func:`serving.torchserve.process.start` with ``cgroup=``): the launcher
writes its own pid into ``cgroup.procs`` before it execs, and the JVM and every Python worker
it forks are born there, every page they touch charged to it.

Figures come from the group's own files: ``memory.max_usage_in_bytes`` (peak charge),
``memory.failcnt`` (how often the charge hit the limit, so the kernel had to reclaim within
the group: 0 means the limit never bound) and ``memory.stat`` (``rss``: anonymous memory;
``cache``: page cache, the tables' pages among it).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")


def unavailable() -> str:
    """Why memory groups cannot be made here, in one line; "" when they can."""
    if not ROOT.is_dir():
        return f"{ROOT} is not mounted (needs the cgroup v1 memory controller)"
    if not os.access(ROOT, os.W_OK):
        return f"{ROOT} is not writable (needs root)"
    return ""


class MemoryGroup:
    """``ROOT/<name>``, made at construction; :meth:`remove` once its processes have ended."""

    def __init__(self, name: str) -> None:
        self.path = ROOT / name
        self.path.mkdir(exist_ok=True)

    @property
    def procs(self) -> Path:
        """The file a process writes its pid into to join (what the launcher does)."""
        return self.path / "cgroup.procs"

    def read(self, name: str) -> int:
        """An integer file of the group (``memory.<name>``), e.g. ``usage_in_bytes``."""
        return int((self.path / f"memory.{name}").read_text())

    def stat(self) -> dict[str, int]:
        """``memory.stat`` (bytes and counts, this group's own lines)."""
        lines = (self.path / "memory.stat").read_text().splitlines()
        return {k: int(v) for k, v in (line.split() for line in lines)}

    def limit(self, limit: int) -> None:
        """Set the limit (the kernel first reclaims the group's page cache above it), then
        restart the peak and the fail count, so both tell of what follows."""
        (self.path / "memory.limit_in_bytes").write_text(str(limit))
        self.reset()

    def reset(self) -> None:
        """Restart ``max_usage_in_bytes`` (from the charge now) and ``failcnt`` (from 0)."""
        (self.path / "memory.max_usage_in_bytes").write_text("0")
        (self.path / "memory.failcnt").write_text("0")

    def members(self) -> list[int]:
        return [int(p) for p in self.procs.read_text().split()]

    def remove(self) -> None:
        """Move any process still inside to the root group, then remove the group."""
        for pid in self.members():
            with contextlib.suppress(OSError):  # it exited meanwhile
                (ROOT / "cgroup.procs").write_text(str(pid))
        with contextlib.suppress(FileNotFoundError):
            self.path.rmdir()
