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

Shapes: ``B`` examples, ``F`` tables, ``E`` embedding dim, ``R = sum(rows)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

try:  # inside a TorchServe worker the archive's files sit side by side
    from features import hash_values  # type: ignore[import-not-found]
    from portable_model import PortableScorer  # type: ignore[import-not-found]
except ImportError:
    from serving.worker.features import hash_values
    from serving.worker.portable_model import PortableScorer

FORMATS = ("int8", "fp16", "fp32")
_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
# checked once per unpacked model folder: the first worker hashes the tables, the rest see this
VERIFIED = ".verified-{sha}"


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
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def save_dense(path: Path, scorer: PortableScorer, tables: dict[str, Any]) -> None:
    """``mapped_<fmt>.pt``: the spec, the tables' record and every weight but the tables."""
    weights = {k: v for k, v in scorer.state_dict().items() if k != "weight"}
    torch.save({"spec": scorer.spec, "tables": tables, "weights": weights}, path)


def map_file(path: Path, size: int) -> torch.Tensor:
    """``path`` as a read-only ``uint8[size]`` tensor over a shared mapping (no copy)."""
    with path.open("rb") as f:
        got = os.fstat(f.fileno()).st_size
        if got != size:
            raise ValueError(
                f"{path.name}: {got} bytes, but the export wrote {size} (truncated or replaced)"
            )
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    mm.madvise(mmap.MADV_RANDOM)  # ids are random: readahead only evicts hot rows
    with warnings.catch_warnings():
        # torch warns that it cannot protect a read-only buffer: nothing here writes to it
        # (scoring only reads), and a write would fault rather than corrupt the file
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mm, dtype=torch.uint8)  # the tensor keeps mm alive


def check_tables(path: Path, record: dict[str, Any]) -> None:
    """Raise ValueError naming ``path`` unless its size and checksum are the export's. Hashed
    once per folder (a marker file beside it), so the second worker does not read it again."""
    marker = path.parent / VERIFIED.format(sha=record["sha256"][:16])
    size = path.stat().st_size if path.exists() else -1
    if size != record["bytes"]:
        raise ValueError(
            f"{path}: {size} bytes, but the export wrote {record['bytes']} (truncated or replaced)"
        )
    if marker.exists():
        return
    if sha256(path) != record["sha256"]:
        raise ValueError(f"{path}: checksum differs from the export's (corrupt or replaced)")
    with contextlib.suppress(OSError):  # a read-only folder: every load hashes, still correct
        marker.touch()


class MappedScorer(PortableScorer):
    """:class:`PortableScorer` whose tables are a mapped file: ``int8`` pools with torch's
    byte-rowwise kernel straight from the mapping, ``fp16``/``fp32`` with ``embedding_bag``."""

    packed: torch.Tensor

    def pooled(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
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
    if verify:
        check_tables(tables, record)
    flat = map_file(tables, record["bytes"])
    if os.environ.get("RECSYS_PRELOAD_TABLES", "0") == "1" and flat.numel():
        int(flat[:: mmap.PAGESIZE].sum())  # one byte a page: every page mapped in
    rows, dim, fmt = record["rows"], record["dim"], record["format"]
    with torch.device("meta"):  # no [R, E] allocation: the tables come from the mapping
        model = MappedScorer(spec)
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
        if fmt == "int8":
            raise ValueError(f"{path.name}: int8 tables are served on CPU (use fp16 on {device})")
        model = model.to(device)
    return model.eval()
