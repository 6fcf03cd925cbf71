"""Write a file whole or not at all: the one helper for every state file of the stack.

A reader (a worker polling a pointer, the gateway re-reading its plan, a resumed run reading
``latest``) sees the old content or the new, never half: the bytes go to a temporary file in the
same folder (unique per process and thread, so concurrent writers never share one), which is
flushed and ``fsync``-ed, renamed over the target (atomic on POSIX), and the folder is
``fsync``-ed so that the rename itself survives a crash. Before this helper 23 hand copies did
some of that: some fsync-ed the file, some not, none the folder.

Shipped in the model archive beside mapped.py (the worker's deltas write their acks with it):
stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: Path, data: bytes | str, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` (str: UTF-8) atomically; ``durable``: fsync the file and
    its folder (off only for files nothing needs after a crash, e.g. a report re-made each run).
    On failure ``path`` is unchanged and no temporary file stays."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(path.parent)
