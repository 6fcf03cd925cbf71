"""Re-read on change (serving/gateway/watched.py), as the token file and the serving plan use it.

The edits a stat of (mtime, size) misses: the same number of bytes written in place with the
modification time put back (``cp -p``, ``rsync -t``, ``touch -r``, or two writes within one tick
of the file system's clock, whose timestamps are coarser than a nanosecond).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from serving import plan as plan_io
from serving.gateway.auth import TokenFile
from serving.gateway.plan_watcher import PlanWatcher
from serving.gateway.validate import Schema
from serving.gateway.watched import WatchedFile
from serving.plan import Plan, Version

DENSE, SPARSE = ("I1", "I2"), ("C1", "C2")


def _rewrite_in_place(path: Path, text: str) -> None:
    """Overwrite ``path`` with ``text`` (as long as what it holds), same inode, mtime kept."""
    before = path.stat()
    assert len(text.encode()) == before.st_size
    with open(path, "r+") as f:
        f.write(text)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns,
    )  # fmt: skip


def test_watched_file_sees_every_kind_of_change(tmp_path: Path) -> None:
    f = tmp_path / "f"
    w = WatchedFile(f)
    assert w.changed()  # never looked at: read it
    w.mark()
    assert not w.changed()  # missing, still missing: nothing to re-read
    f.write_text("abc\n")
    assert w.changed()
    w.mark()
    assert not w.changed()
    _rewrite_in_place(f, "abd\n")
    assert w.changed()
    w.mark()
    tmp = tmp_path / "f.tmp"  # atomic replace by rename: a new inode
    tmp.write_text("abd\n")
    os.replace(tmp, f)
    assert w.changed()
    w.mark()
    f.unlink()
    assert w.changed()


def test_token_file_sees_a_same_size_rotation_in_place(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    old, new = "old-token-" + "a" * 20, "new-token-" + "b" * 20
    f.write_text(f"{old}\n")
    tokens = TokenFile(f, recheck_s=0.0)
    assert tokens.accepts(old.encode())
    _rewrite_in_place(f, f"{new}\n")
    assert tokens.accepts(new.encode()) and not tokens.accepts(old.encode())


def test_plan_watcher_sees_a_same_size_edit_in_place(tmp_path: Path) -> None:
    versions = {v: Version(f"m-{v}.mar", DENSE, SPARSE) for v in ("1", "2")}
    path = tmp_path / "plan.json"
    plan_io.save(Plan("m", "1", versions, generation=4), path)
    watcher = PlanWatcher(path, Schema("m", "1", DENSE, SPARSE))
    assert watcher.poll() is not None and watcher.poll() is None
    edited = Plan("m", "2", versions, generation=5)  # as long: "1" -> "2", 4 -> 5
    _rewrite_in_place(path, json.dumps(edited.to_json(), indent=2) + "\n")
    assert watcher.poll() == edited
    assert watcher.poll() is None
