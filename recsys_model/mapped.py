"""Embedding tables mapped from disk: one copy per host, shared by every worker that scores.

A ``mapped`` variant is two files (``docs/contracts.md``):

* ``tables_<fmt>.bin``: every table's rows back to back (``[sum(rows), W]``, raw little-endian,
  no header), in one of :data:`FORMATS`: ``int8`` (fbgemm's byte-rowwise layout: ``E`` int8
  codes then a float32 scale and bias per row, ``W = E + 8`` bytes, read by torch's own
  ``quantized::embedding_bag_byte_rowwise_offsets``), ``fp16`` or ``fp32`` (``W = E``);
* ``mapped_<fmt>.pt``: a small ``torch.save`` of the spec, the table file's name, size and
  checksum, and the dense part (MLPs, row offsets), a few MB at most.

A worker maps the table file read-only (``mmap`` + ``MADV_RANDOM``: ids are random, and with
default readahead a confined worker read 40x slower here) and wraps it in a tensor without a
copy, so the page cache holds the tables once whatever the number of workers, and a host with
less memory than the tables keeps the hot rows resident and pages cold ones in. On CUDA the
tables are copied to the device (fp16). Only ``torch`` is imported: this file, the portable
scorer and the transforms are archived beside the handler.

**Verified once per file, by identity.** The first worker to load a folder hashes the tables
and leaves ``.verified-<sha16>-<inode>-<size>-<mtime>-<ctime>`` beside them; a later load skips
the hash only when the file is still that one. The ctime is in the key because ``cp -p``,
``rsync -t`` or ``os.utime`` put an mtime back but no user call can set the ctime: an in-place
overwrite of the same size is hashed again (and refused when it differs).

**Replace by rename, never in place.** A mapping reads the file's pages as they are now: a
file renamed over (a new inode, what the export does) leaves the mapped one intact, but bytes
written into the mapped file change the scores, and a truncated one makes the next read of a
page past its end a ``SIGBUS`` that kills the worker. A signal handler cannot turn that into
an error in Python (the fault is raised inside a torch kernel; CPython runs handlers between
bytecodes, after the kernel returns, which it never does). So every batch first compares the
mapped file's ``fstat`` (size, mtime, ctime: a few microseconds) with what was verified and
refuses it with one line when the file changed: the worker stops scoring bytes that are not
the export's, and a truncation that happened before the batch is an error, not a crash. One
that lands during a batch can still fault: the guard narrows the window, only the rename
closes it.

Shapes: ``B`` examples, ``F`` tables, ``E`` embedding dim, ``R = sum(rows)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import warnings
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

try:  # inside a TorchServe worker the archive's files sit side by side
    from features import hash_values  # type: ignore[import-not-found]
    from portable_model import PortableScorer  # type: ignore[import-not-found]
except ImportError:
    from recsys_model.features import hash_values
    from recsys_model.portable_model import PortableScorer

FORMATS = ("int8", "fp16", "fp32")
_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
# checked once per table file: the first worker hashes it, the rest see this (module doc)
VERIFIED = ".verified-{sha}-{ino}-{size}-{mtime}-{ctime}"
Identity = tuple[int, int, int, int]  # (inode, size, mtime_ns, ctime_ns) of a table file


def identity(st: os.stat_result) -> Identity:
    """What tells one file apart from another, or from itself rewritten in place."""
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def row_bytes(dim: int, fmt: str) -> int:
    """Bytes of one table row in ``fmt``."""
    if fmt == "int8":
        return dim + 8  # codes, then float32 scale and bias
    return dim * _DTYPES[fmt].itemsize


def pack(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 rows ``[r, E]`` -> their bytes in ``fmt``, ``uint8[r, row_bytes]``."""
    if fmt == "int8":
        return torch.ops.quantized.embedding_bag_byte_prepack(rows.float().contiguous())
    return rows.to(_DTYPES[fmt]).contiguous().view(torch.uint8)


class TableWriter:
    """Writes ``tables_<fmt>.bin``: fp32 rows in, ``fmt`` bytes out, one chunk in memory at a
    time (a table, or part of one, in any order); :meth:`close` checks every row was written
    exactly once and returns the record ``mapped_<fmt>.pt`` keeps."""

    def __init__(self, path: Path, total_rows: int, dim: int, fmt: str) -> None:
        self.path, self.rows, self.dim, self.fmt = path, total_rows, dim, fmt
        self.width = row_bytes(dim, fmt)
        self.written = 0
        self.file = path.open("wb")
        self.file.truncate(total_rows * self.width)

    def write(self, start: int, rows: torch.Tensor) -> None:
        """fp32 ``rows [r, E]`` at table row ``start`` of the concatenated tables."""
        if rows.shape[1] != self.dim or start < 0 or start + rows.shape[0] > self.rows:
            raise ValueError(f"{self.path.name}: rows {start}+{rows.shape[0]} do not fit")
        self.file.seek(start * self.width)
        self.file.write(pack(rows, self.fmt).numpy().data)  # the bytes, no extra copy
        self.written += rows.shape[0]

    def close(self) -> dict[str, Any]:
        self.file.close()
        if self.written != self.rows:
            raise ValueError(f"{self.path.name}: {self.written} rows written for {self.rows}")
        digest = sha256(self.path)
        drop_cached(self.path)
        return {"file": self.path.name, "format": self.fmt, "rows": self.rows, "dim": self.dim,
                "bytes": self.rows * self.width, "sha256": digest}  # fmt: skip


def write_tables(
    path: Path, total_rows: int, dim: int, fmt: str, chunks: Iterable[tuple[int, torch.Tensor]]
) -> dict[str, Any]:
    """:class:`TableWriter` over ``chunks`` of ``(first row, fp32 rows [r, E])``."""
    writer = TableWriter(path, total_rows, dim, fmt)
    for start, rows in chunks:
        writer.write(start, rows)
    return writer.close()


def drop_cached(path: Path) -> None:
    """Evict ``path``'s pages from the page cache (written and synced, so clean). Just written
    sequentially, they sit in large folios: a process mapping the file then maps a whole folio
    per fault (measured: 13k random rows of the Kaggle int8 tables mapped 738 of its 810 MB),
    so a reader of a few rows would account for most of the file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return _sha256_of(f)


def _sha256_of(f: Any) -> str:
    h = hashlib.sha256()
    while block := f.read(1 << 22):
        h.update(block)
    return h.hexdigest()


def save_dense(path: Path, scorer: PortableScorer, tables: dict[str, Any]) -> None:
    """``mapped_<fmt>.pt``: the spec, the tables' record and every weight but the tables."""
    weights = {k: v for k, v in scorer.state_dict().items() if k != "weight"}
    torch.save({"spec": scorer.spec, "tables": tables, "weights": weights}, path)


def map_file(path: Path, size: int, expect: Identity | None = None) -> tuple[torch.Tensor, int]:
    """``path`` as a read-only ``uint8[size]`` tensor over a shared mapping (no copy), and a
    descriptor of the mapped file (for :meth:`MappedScorer.check_tables`; the caller closes
    it). ``expect``: the identity :func:`check_tables` verified; another file is refused."""
    with path.open("rb") as f:
        st = os.fstat(f.fileno())
        if st.st_size != size:
            raise ValueError(
                f"{path.name}: {st.st_size} bytes, but the export wrote {size} (truncated or "
                "replaced)"
            )
        if expect is not None and identity(st) != expect:
            raise ValueError(f"{path}: replaced or rewritten while it was loaded; load again")
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        fd = os.dup(f.fileno())
    mm.madvise(mmap.MADV_RANDOM)  # ids are random: readahead only evicts hot rows
    with warnings.catch_warnings():
        # torch warns that it cannot protect a read-only buffer: nothing here writes to it
        # (scoring only reads), and a write would fault rather than corrupt the file
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mm, dtype=torch.uint8), fd  # the tensor keeps mm alive


def check_tables(path: Path, record: dict[str, Any]) -> Identity:
    """Raise ValueError naming ``path`` unless its size and checksum are the export's; returns
    the identity it verified. Hashed once per file (a marker beside it keyed on the file's
    identity, module doc), so the second worker does not read it again."""
    size = path.stat().st_size if path.exists() else -1
    if size != record["bytes"]:
        raise ValueError(
            f"{path}: {size} bytes, but the export wrote {record['bytes']} (truncated or replaced)"
        )
    with path.open("rb") as f:
        before = identity(os.fstat(f.fileno()))
        marker = path.parent / VERIFIED.format(
            sha=record["sha256"][:16], ino=before[0], size=before[1], mtime=before[2],
            ctime=before[3],
        )  # fmt: skip
        if marker.exists():
            return before
        digest = _sha256_of(f)
        if identity(os.fstat(f.fileno())) != before:
            raise ValueError(
                f"{path}: changed while it was checked (written in place?); load again"
            )
    if digest != record["sha256"]:
        raise ValueError(f"{path}: checksum differs from the export's (corrupt or replaced)")
    with contextlib.suppress(OSError):  # a read-only folder: every load hashes, still correct
        for old in path.parent.glob(VERIFIED.format(sha=record["sha256"][:16], ino="*",
                                                    size="*", mtime="*", ctime="*")):  # fmt: skip
            old.unlink()  # markers of files that are gone: never true again
        marker.touch()
    return before


class MappedScorer(PortableScorer):
    """:class:`PortableScorer` whose tables are a mapped file: ``int8`` pools with torch's
    byte-rowwise kernel straight from the mapping, ``fp16``/``fp32`` with ``embedding_bag``."""

    packed: torch.Tensor
    tables_path: Path | None = None  # the mapped table file (None: tables copied to a device)
    tables_fd: int = -1
    tables_seen: tuple[int, int, int, int] = (0, 0, 0, 0)  # size, mtime, ctime, links

    def check_tables(self) -> None:
        """Refuse to score when the mapped file changed on disk since it was verified (module
        doc: written in place or truncated); one ``fstat``, a few microseconds. A ctime
        that moved with the link count is a rename over the file or its removal, which
        leaves the mapped bytes as they were: taken as the new normal."""
        if self.tables_path is None:
            return
        st = os.fstat(self.tables_fd)
        now = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink)
        if now == self.tables_seen:
            return
        size, mtime, _, links = self.tables_seen
        if now[:2] == (size, mtime) and now[3] != links:
            self.tables_seen = now
            return
        raise RuntimeError(
            f"{self.tables_path.name} changed on disk under this worker ({now[0]} bytes, "
            f"mapped {size}; written in place or truncated): its rows are no longer the "
            "export's; replace model files by rename and load the model again"
        )

    def pooled(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        self.check_tables()
        if self.packed.numel() == 0:
            return super().pooled(values, lengths)
        batch = lengths.shape[1]
        lens = lengths.reshape(-1).to(torch.int64)
        per_feature = lengths.to(torch.int64).sum(dim=1)
        ids = hash_values(values, lengths, self.rows)
        ids = ids + torch.repeat_interleave(self.row_offsets, per_feature)
        out = torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
            self.packed, ids, torch.cumsum(lens, 0) - lens, False, 0, False, None, None, False
        )
        return out.reshape(self.num_features, batch, self.dim).transpose(0, 1)


def load_mapped(path: Path, device: torch.device, verify: bool = True) -> MappedScorer:
    """``mapped_<fmt>.pt`` and its table file -> a scorer in eval mode. On CPU the tables stay
    mapped (``RECSYS_PRELOAD_TABLES=1``: every page read in at load, for hosts that hold them
    all and want no page fault on the first requests); on another device they are copied
    there. Raises ValueError naming a bad file."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        record, spec = state["tables"], state["spec"]
    except Exception as e:  # any unpickling failure: one line naming the file
        raise ValueError(f"{path}: not a mapped model file ({type(e).__name__}: {e})") from None
    tables = path.parent / record["file"]
    verified = check_tables(tables, record) if verify else None
    rows, dim, fmt = record["rows"], record["dim"], record["format"]
    with torch.device("meta"):  # no [R, E] allocation: the tables come from the mapping
        model = MappedScorer(spec)
    flat, fd = map_file(tables, record["bytes"], verified)
    close_fd = weakref.finalize(model, os.close, fd)  # open as long as the model lives
    if os.environ.get("RECSYS_PRELOAD_TABLES", "0") == "1" and flat.numel():
        int(flat[:: mmap.PAGESIZE].sum())  # one byte a page: every page mapped in
    model.load_state_dict(state["weights"], strict=False, assign=True)
    grid = flat.view(rows, row_bytes(dim, fmt))
    if fmt == "int8":
        model.weight = torch.nn.Parameter(torch.empty(0, dim), requires_grad=False)
        model.packed = grid
    else:
        model.weight = torch.nn.Parameter(grid.view(_DTYPES[fmt]), requires_grad=False)
        model.packed = torch.empty(0, dtype=torch.uint8)
        model = model.to(_DTYPES[fmt])  # the MLPs in the tables' dtype (the tables: no copy)
    if device.type != "cpu":
        close_fd()  # the tables are copied to the device: nothing to watch
        if fmt == "int8":
            raise ValueError(f"{path.name}: int8 tables are served on CPU (use fp16 on {device})")
        model = model.to(device)
        return model.eval()
    st = os.fstat(fd)
    model.tables_path, model.tables_fd = tables, fd
    model.tables_seen = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink)
    return model.eval()
