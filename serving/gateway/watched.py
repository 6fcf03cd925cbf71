"""Re-read a file when it changes: one rule for the gateway's token file and its serving plan.

A file is "as last read" when its identity is the same: what ``stat`` says of it (device, inode,
size, modification and change times, in nanoseconds) and, for a file of at most
``content_limit`` bytes, the SHA-256 of its bytes. The content is what catches the edit a stat
misses: the same number of bytes written in place within one tick of the file system's clock
(timestamps are coarser than they look), or with the modification time put back (``cp -p``,
``rsync -t``, ``touch -r``). Both files watched here are a few kilobytes, read at most once a
second: comparing their content costs a read, and a missed revocation costs far more.

A missing file is a state of its own: missing, then still missing, is no change (the caller has
reacted to it already); missing, then present, is. A file that can be stat'ed but not read has
no digest (``b""``) and changes with its stat (a ``chmod`` that fixes it changes ``ctime``).

Stdlib only: TorchServe's config reads plans without the gateway's dependencies.
"""

from __future__ import annotations

import errno
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

CONTENT_LIMIT = 1 << 20  # bytes: files up to this size are compared by content too
# errors reading a file that are the process's or the machine's state, not the file's: no
# descriptor left, no memory, interrupted (the token file and the plan keep their last good
# content and are read again; 1,100 idle connections once turned EMFILE into "every token
# rejected")
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
TRANSIENT = OUT_OF_RESOURCES | {errno.EINTR, errno.EAGAIN, errno.EIO}


@dataclass(frozen=True)
class Identity:
    """What a file is now, as far as "has it changed" goes."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    digest: bytes | None  # SHA-256 of the content; None = too large to compare; b"" = unreadable


def identity(path: Path, content_limit: int = CONTENT_LIMIT) -> Identity | None:
    """``path``'s identity now; None when there is no such file (or its folder is unreadable)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    digest: bytes | None = None
    if st.st_size <= content_limit:
        try:
            digest = hashlib.sha256(Path(path).read_bytes()).digest()
        except OSError:
            digest = b""
    return Identity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest)


class WatchedFile:
    """A file read again only when it is not as it was when last :meth:`mark`-ed.

    Usage: ``if w.changed(): w.mark(); read the file``. Marking before reading means a write
    that lands during the read makes the next :meth:`changed` true: a change may be read twice,
    never missed."""

    def __init__(self, path: Path, content_limit: int = CONTENT_LIMIT) -> None:
        self.path = Path(path)
        self.content_limit = content_limit
        self._seen: Identity | None = None
        self._marked = False

    def changed(self) -> bool:
        """True when the file differs from its last :meth:`mark` (never marked: True)."""
        return not self._marked or identity(self.path, self.content_limit) != self._seen

    def mark(self) -> None:
        """Remember the file as it is now (call it just before reading the file)."""
        self._seen = identity(self.path, self.content_limit)
        self._marked = True

    def forget(self) -> None:
        """Take the last read back (it failed for a reason that says nothing of the file):
        the next :meth:`changed` is True, so the file is read again."""
        self._marked = False
