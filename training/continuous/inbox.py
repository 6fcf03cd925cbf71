"""The folder click logs arrive in, and the ledger of what the loop consumed from it.

**Arrival.** A file is taken when it is complete, so producers must write it under another
name and rename it into the folder (``os.replace``: atomic on one filesystem). Never read:
names starting with ``.`` (hidden, and ``.x.tmp-123`` partial files), names ending in ``.tmp``,
the true-probability sidecars of synthetic days (``*.prob.npy``) and sub-folders (``rejected/``).
Everything else is a Criteo TSV file, taken in natural name order (``day_2`` before
``day_10``, :func:`recsys_stack.datafile.natural_key`), one at a time.

**Identity by content.** A file is consumed as a name *and* a content: its
:func:`recsys_stack.datafile.fingerprint` (bytes, sha256 of the first and last MiB), the one
its cache was built from. A file renamed in under a consumed name with other bytes is a new
file (trained, with a warning naming both); the same bytes again (a copy, another mtime) are
not. A ledger written before content was recorded matches by name, as it did. Fingerprints of
files present under a consumed name are read once per file version (memoized on inode, size,
mtime and ctime), not at every poll.

**Rejection.** A file that fails the malformed-row policy (``data.on_bad_row``,
``data.max_bad_rows``) or holds too few rows for one batch is moved to ``rejected/`` with a
``<name>.reason.txt`` beside it saying why; the loop goes on with the next file.

**Ledger** (in every checkpoint's ``meta.json`` under ``"continuous"``): the files consumed,
each with its rows, the rows trained and the ``[from, to)`` row segments of its shuffled order
trained between checkpoints, the rows carried in from the previous file and out to the next
(training/continuous/carry.py: ``carried_in + rows == row + carried_out``), its content, and
the file in progress with its row position. A
file in progress that is replaced meanwhile is closed with the rows it had (the rest of the
old bytes are gone) and its new content starts as a new file. It moves with
the model it describes: a run killed mid-file resumes at the position of its checkpoint, so
no row is trained twice, and the segments show it.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from recsys_stack.datafile import fingerprint, natural_key

REJECTED = "rejected"
REASON_SUFFIX = ".reason.txt"
logger = logging.getLogger("training.continuous")
Content = dict[str, Any]  # {"bytes", "sha256_ends"}: what a file holds (module doc)
# path -> (inode, size, mtime, ctime) when read, its content: a file is hashed once per version
_CONTENTS: dict[str, tuple[tuple[int, int, int, int], Content]] = {}
_WARNED: set[tuple[str, str]] = set()  # (name, sha256_ends) already said loudly


def content_of(path: Path) -> Content:
    """``path``'s content id: the ``bytes`` and ``sha256_ends`` of its fingerprint, memoized
    on its inode, size, mtime and ctime (a write moves the ctime, which no user call sets)."""
    st = path.stat()
    key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    known = _CONTENTS.get(str(path))
    if known is not None and known[0] == key:
        return known[1]
    fp = fingerprint(path)
    content = {"bytes": fp["bytes"], "sha256_ends": fp["sha256_ends"]}
    _CONTENTS[str(path)] = (key, content)
    return content


def readable(path: Path) -> bool:
    """Whether ``path`` is a complete data file the loop may read (module doc)."""
    name = path.name
    if name.startswith(".") or name.endswith(".tmp") or name.endswith(".prob.npy"):
        return False
    return path.is_file()


def pending(data_dir: Path, consumed: dict[str, list[Content | None]]) -> list[Path]:
    """The readable files of ``data_dir`` not consumed (``consumed``: name -> the contents
    consumed under it, :attr:`Ledger.consumed`), in natural name order. A consumed name holding
    other content is pending, and said once with a warning."""
    if not data_dir.is_dir():
        return []
    files = []
    for p in data_dir.iterdir():
        seen = consumed.get(p.name)
        if not readable(p) or (seen is not None and None in seen):  # None: a ledger by name
            continue
        if seen is not None:
            try:
                now = content_of(p)
            except OSError:  # gone meanwhile: the next poll sees what is there
                continue
            if now in seen:
                continue
            if (p.name, now["sha256_ends"]) not in _WARNED:
                _WARNED.add((p.name, now["sha256_ends"]))
                logger.warning(
                    "%s: the name of a consumed file, with other content (%d bytes, sha256 of "
                    "its ends %s; consumed: %s): taken as a new file", p.name, now["bytes"],
                    now["sha256_ends"][:12],
                    ", ".join(f"{c['bytes']} bytes {c['sha256_ends'][:12]}" for c in seen if c),
                )  # fmt: skip
        files.append(p)
    return sorted(files, key=lambda p: natural_key(p.name))


class Prefetch:
    """The next pending file parsed into its binary cache in a thread while a pass trains (rank
    0), so the loop finds it built when the pass ends: its load is then a reuse, and the
    publish that waits for that file (it is the gate's rows) starts sooner. One file ahead,
    one process (no fork beside the training threads); a failure is left for the loop's own
    load to meet and report. The loop joins it before loading a file (the cache's lock is a
    process's, so it does not order two threads)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.thread: threading.Thread | None = None

    def start(self, data_dir: Path, ledger: Ledger, current: str, cfg: Any) -> None:
        if not self.enabled or (self.thread is not None and self.thread.is_alive()):
            return
        files = [p for p in pending(data_dir, ledger.consumed) if p.name != current]
        if not files:
            return
        from training.data.binary import ensure_binary

        d = cfg.data

        def work() -> None:
            try:
                ensure_binary([files[0]], Path(d.cache_dir), on_bad=d.on_bad_row,
                              max_bad_rows=d.max_bad_rows, progress=False,
                              rows_per_table=cfg.model.rows(), processes=1)  # fmt: skip
            except Exception as e:  # the loop's load meets it again and says so
                logger.debug("prefetching %s: %s", files[0].name, e)

        self.thread = threading.Thread(target=work, name="prefetch", daemon=True)
        self.thread.start()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


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


def reject_file(loop: Any, name: str, reason: str) -> None:
    """The continuous loop's rejection of its file ``name``: moved aside (:func:`reject`),
    recorded, and out of the ledger."""
    if loop.rank == 0:
        path = loop.data_dir / name
        if path.exists():
            where = reject(path, reason)
            logger.warning("%s rejected (-> %s): %s", name, where.parent, reason)
        loop.events.write({"event": "rejected", "file": name, "reason": reason,
                           "step": loop.progress.step, "time": time.time()})  # fmt: skip
    current = loop.ledger.current
    if current is not None and current.file == name:
        loop.ledger.files.remove(current)


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
    content: Content | None = None  # what it held (module doc); None in an older ledger
    carried_in: int = 0  # rows of the previous file that open its order (carry.py)
    carry_from: int | None = None  # the number of the file they were carried out of
    carried_out: int = 0  # the last rows of its order, fewer than a batch: to the next file

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
    def consumed(self) -> dict[str, list[Content | None]]:
        """Name -> the contents consumed under it (module doc: identity by content)."""
        out: dict[str, list[Content | None]] = {}
        for f in self.files:
            if f.done:
                out.setdefault(f.file, []).append(f.content)
        return out

    @property
    def done(self) -> list[FileRecord]:
        """The files consumed, in order."""
        return [f for f in self.files if f.done]

    @property
    def current(self) -> FileRecord | None:
        """The file in progress (not done), if any."""
        return next((f for f in self.files if not f.done), None)

    def start(self, name: str, rows: int, content: Content | None = None) -> FileRecord:
        record = FileRecord(file=name, rows=rows, index=len(self.files), content=content)
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
