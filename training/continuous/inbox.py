"""The folder click logs arrive in, and the ledger of what the loop consumed from it.

**Arrival.** A file is taken when it is complete, so producers must write it under another
name and rename it into the folder (``os.replace``: atomic on one filesystem). Never read:
names starting with ``.`` (hidden, and ``.x.tmp-123`` partial files), names ending in ``.tmp``,
the true-probability sidecars of synthetic days (``*.prob.npy``) and sub-folders (``rejected/``).
Everything else is a Criteo TSV file, taken in natural name order (``day_2`` before
``day_10``), one at a time.

**Rejection.** A file that fails the malformed-row policy (``data.on_bad_row``,
``data.max_bad_rows``) or holds too few rows for one batch is moved to ``rejected/`` with a
``<name>.reason.txt`` beside it saying why; the loop goes on with the next file.

**Ledger** (in every checkpoint's ``meta.json`` under ``"continuous"``): the files consumed,
each with its rows, the rows trained and the ``[from, to)`` row segments of its shuffled order
trained between checkpoints, and the file in progress with its row position. It moves with
the model it describes: a run killed mid-file resumes at the position of its checkpoint, so
no row is trained twice, and the segments show it.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REJECTED = "rejected"
REASON_SUFFIX = ".reason.txt"


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def readable(path: Path) -> bool:
    """Whether ``path`` is a complete data file the loop may read (module doc)."""
    name = path.name
    if name.startswith(".") or name.endswith(".tmp") or name.endswith(".prob.npy"):
        return False
    return path.is_file()


def pending(data_dir: Path, consumed: set[str]) -> list[Path]:
    """The readable files of ``data_dir`` not in ``consumed``, in natural name order."""
    if not data_dir.is_dir():
        return []
    files = [p for p in data_dir.iterdir() if p.name not in consumed and readable(p)]
    return sorted(files, key=lambda p: _natural(p.name))


def reject(path: Path, reason: str) -> Path:
    """Move ``path`` (and a sidecar) to ``rejected/`` beside it, with the reason; returns where."""
    folder = path.parent / REJECTED
    folder.mkdir(exist_ok=True)
    target = folder / path.name
    (folder / (path.name + REASON_SUFFIX)).write_text(
        f"{time.strftime('%Y-%m-%d %H:%M:%S')} {path.name}: {reason}\n"
    )
    os.replace(path, target)
    sidecar = path.with_suffix(".prob.npy")
    if sidecar.is_file():
        os.replace(sidecar, folder / sidecar.name)
    return target


def drop_cache(cache_dir: Path) -> None:
    """Remove a consumed file's preprocessed cache (continuous.keep_cache = false)."""
    shutil.rmtree(cache_dir, ignore_errors=True)


@dataclass
class FileRecord:
    """One file of the ledger: what was trained of it, and where its position stands."""

    file: str
    rows: int
    index: int  # the file's number in the run (0, 1, ...): seeds its shuffle
    row: int = 0  # rows of its shuffled order trained (the position a resume starts from)
    segments: list[list[int]] = field(default_factory=list)  # [from, to) per checkpoint
    steps: list[int] = field(default_factory=list)  # [step before its first, its last step]
    done: bool = False

    def advance(self, start: int, to: int, step: int) -> None:
        """Record rows ``[start, to)`` as trained, the last of them at ``step`` (at a
        checkpoint); ``steps``: [the step before the file's first, its last], set by
        :meth:`begin` and here."""
        if to > start:
            self.segments.append([start, to])
            self.steps[1:] = [step]
        self.row = to

    def begin(self, step: int) -> None:
        """Training on the file starts (or resumes) after ``step``."""
        if not self.steps:
            self.steps = [step, step]


@dataclass
class Ledger:
    files: list[FileRecord] = field(default_factory=list)
    files_since_export: int = 0
    exported_step: int = -1

    @property
    def consumed(self) -> set[str]:
        return {f.file for f in self.files if f.done}

    @property
    def current(self) -> FileRecord | None:
        """The file in progress (not done), if any."""
        return next((f for f in self.files if not f.done), None)

    def start(self, name: str, rows: int) -> FileRecord:
        record = FileRecord(file=name, rows=rows, index=len(self.files))
        self.files.append(record)
        return record

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> Ledger:
        if not raw:
            return cls()
        files = [FileRecord(**f) for f in raw.get("files", [])]
        return cls(files, int(raw.get("files_since_export", 0)), int(raw.get("exported_step", -1)))
