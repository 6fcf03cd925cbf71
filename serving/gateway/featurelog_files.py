"""Rolling JSON-lines files, each appearing by rename when complete (the feature log's files).

One :class:`RollingFiles` per kind (impressions, clicks) and writer (a gateway process): the
open file is hidden (``.<name>.tmp``), so a reader listing the folder (the Flink joiner's
file source) sees only whole files, each under its final name
``<kind>-<writer>-<seq>.jsonl`` (:func:`recsys_stack.online.file_name`). A file closes when it
reaches ``max_bytes`` (it may pass it by the last batch written), when it has been open
``max_age_s`` (the joiner wants records within seconds, not when a file fills), or when the
gateway stops. A file is opened by the first write after the last one closed: an idle gateway
leaves no empty files. Closing flushes, fsyncs, then renames: a closed file survives a crash.

Retention: after each close, closed files of the kind beyond ``max_files`` in the folder
(every writer's: the folder is the bound) are deleted, oldest first, and counted. Used by one
thread (the feature log's); standard library only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import BinaryIO

from recsys_stack.online import SUFFIX, file_name

logger = logging.getLogger("serving.gateway.featurelog")


class RollingFiles:
    """Appends to ``folder``'s current ``kind`` file of ``writer``; rolls by size and age."""

    def __init__(
        self, folder: Path, kind: str, writer: str, max_bytes: int, max_age_s: float,
        max_files: int,
    ) -> None:  # fmt: skip
        self.folder, self.kind, self.writer = folder, kind, writer
        self.max_bytes, self.max_age_s, self.max_files = max_bytes, max_age_s, max_files
        folder.mkdir(parents=True, exist_ok=True)
        self.seq = 0
        self._file: BinaryIO | None = None
        self._opened = 0.0
        self.size = 0
        self.closed = 0  # files closed (renamed into view)
        self.deleted = 0  # closed files deleted by retention

    def _names(self) -> tuple[Path, Path]:
        name = file_name(self.kind, self.writer, self.seq)
        return self.folder / f".{name}.tmp", self.folder / name

    def write(self, data: bytes, now: float | None = None) -> None:
        """Append ``data`` (whole lines) to the open file (opened here if none is); close it
        once it holds ``max_bytes``. OSError: the caller counts the lines as lost."""
        if self._file is None:  # unbuffered: a batch of lines is one write(2)
            self._file = open(self._names()[0], "wb", buffering=0)  # noqa: SIM115 - close()
            self._opened = time.monotonic() if now is None else now
            self.size = 0
        view = memoryview(data)
        try:
            while view:
                view = view[self._file.write(view) or 0 :]
        except OSError:  # disk full: no partial line stays behind the last whole one
            with contextlib.suppress(OSError):
                os.ftruncate(self._file.fileno(), self.size)
                self._file.seek(self.size)
            raise
        self.size += len(data)
        if self.size >= self.max_bytes:
            self.close()

    def tick(self, now: float | None = None) -> None:
        """Close the open file if it has been open ``max_age_s``."""
        now = time.monotonic() if now is None else now
        if self._file is not None and now - self._opened >= self.max_age_s:
            self.close()

    @property
    def open(self) -> bool:
        return self._file is not None

    def close(self) -> None:
        """Flush, fsync and rename the open file into view (none open: nothing), then apply
        retention."""
        f, self._file = self._file, None
        if f is None:
            return
        hidden, final = self._names()
        self.seq += 1
        try:
            os.fsync(f.fileno())
        finally:
            f.close()
        os.rename(hidden, final)
        self.closed += 1
        self.retain()

    def retain(self) -> None:
        """Delete the oldest closed files of the kind beyond ``max_files``."""
        if self.max_files <= 0:
            return
        files = []
        with os.scandir(self.folder) as it:
            for e in it:
                if e.name.startswith(f"{self.kind}-") and e.name.endswith(SUFFIX):
                    with contextlib.suppress(OSError):  # a reader may have consumed it
                        files.append((e.stat().st_mtime_ns, e.name))
        files.sort()
        for _, name in files[: max(0, len(files) - self.max_files)]:
            try:
                os.unlink(self.folder / name)
                self.deleted += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("feature log: cannot delete %s: %s", name, e.strerror or e)
