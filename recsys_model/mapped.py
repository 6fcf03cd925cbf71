"""Embedding tables mapped from disk: one copy per host, shared by every worker that scores.

A ``mapped`` variant is two files (``docs/contracts.md``):

* ``tables_<fmt>.bin``: every table's rows back to back (``[sum(rows), W]``, raw little-endian,
  no header), in one of :data:`FORMATS`: ``int8`` (fbgemm's byte-rowwise layout: ``E`` int8
  codes then a float32 scale and bias per row, ``W = E + 8`` bytes, read by torch's own
  ``quantized::embedding_bag_byte_rowwise_offsets``), ``int4`` (fbgemm's 4-bit rowwise
  layout: two codes a byte then an fp16 scale and bias, ``W = E/2 + 4``, ``E`` even, read by
  ``quantized::embedding_bag_4bit_rowwise_offsets``: 12 bytes a row at ``E = 16``, half of
  int8's), ``fp16`` or ``fp32`` (``W = E``), or ``mixed``: each table in its own one of
  :data:`MIX_FORMATS` (chosen by the export's memory budget), the tables of one format back
  to back in a section of the file (64-byte aligned, one kernel call per section);
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
from pathlib import Path
from typing import Any

import torch

try:  # inside a TorchServe worker the archive's files sit side by side
    from features import hash_values  # type: ignore[import-not-found]
    from portable_model import PortableScorer  # type: ignore[import-not-found]
except ImportError:
    from recsys_model.features import hash_values
    from recsys_model.portable_model import PortableScorer

FORMATS = ("int8", "int4", "fp16", "fp32", "mixed")
MIXED = "mixed"
MIX_FORMATS = ("fp16", "int8", "int4")  # what a mixed file's tables may be, most precise first
_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
_OPS = {"int8": ("embedding_bag_byte_prepack", "embedding_bag_byte_unpack",
                 "embedding_bag_byte_rowwise_offsets"),
        "int4": ("embedding_bag_4bit_prepack", "embedding_bag_4bit_unpack",
                 "embedding_bag_4bit_rowwise_offsets")}  # fmt: skip
ALIGN = 64  # a mixed file's sections start on a cache line (a page: tiny tables lost to it)
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
    if fmt == "int4":
        check_dim(dim, fmt)
        return dim // 2 + 4  # two codes a byte, then fp16 scale and bias
    return dim * _DTYPES[fmt].itemsize


def check_dim(dim: int, fmt: str) -> None:
    """Raise ValueError when ``fmt`` cannot hold rows of ``dim`` (int4: an even dim)."""
    if fmt == "int4" and dim % 2:
        raise ValueError(f"int4 tables need an even embedding dim (this model's: {dim}): use int8")


def pack(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 rows ``[r, E]`` -> their bytes in ``fmt``, ``uint8[r, row_bytes]``."""
    if fmt in _OPS:
        check_dim(rows.shape[1], fmt)
        return getattr(torch.ops.quantized, _OPS[fmt][0])(rows.float().contiguous())
    return rows.to(_DTYPES[fmt]).contiguous().view(torch.uint8)


def unpack(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    """:func:`pack`'s bytes ``uint8[r, row_bytes]`` -> the fp32 rows ``[r, E]`` they score as."""
    if fmt in _OPS:
        return getattr(torch.ops.quantized, _OPS[fmt][1])(packed.contiguous())
    return packed.contiguous().view(_DTYPES[fmt]).float()


def layout(
    rows: list[int], dim: int, formats: list[str]
) -> tuple[list[int], dict[str, tuple[int, int]], int]:
    """Where each table of a file whose tables are in ``formats`` (one a table) lies: each
    table's first row within its format's section, ``{format: (byte offset, rows)}`` of the
    sections (in :data:`MIX_FORMATS` order, aligned) and the file's bytes. One format:
    one section at 0, the tables back to back (the uniform files' layout)."""
    local, sections, end = [0] * len(rows), {}, 0
    for fmt in [f for f in (*MIX_FORMATS, "fp32") if f in formats]:
        n = 0
        for t, (r, f) in enumerate(zip(rows, formats, strict=True)):
            if f == fmt:
                local[t], n = n, n + r
        start = -(-end // ALIGN) * ALIGN
        sections[fmt], end = (start, n), start + n * row_bytes(dim, fmt)
    return local, sections, end


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
    """:class:`PortableScorer` whose tables are a mapped file: ``int8``/``int4`` pool with
    torch's rowwise kernels straight from the mapping, ``fp16``/``fp32`` with
    ``embedding_bag``; a ``mixed`` file, one kernel call per section (:func:`layout`)."""

    # (format, its rows [n, W] over the mapping, its tables int64[k], their first rows in it);
    # empty: the tables are ``weight`` (fp16 / fp32). routes: the same per table, int64[F]
    sections: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]
    routes: tuple[torch.Tensor, torch.Tensor]
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

    def global_ids(
        self, values: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row ids int64[N] in the concatenated tables, ids per feature int64[F])``."""
        per_feature = lengths.to(torch.int64).sum(dim=1)
        ids = hash_values(values, lengths, self.rows)
        return ids + torch.repeat_interleave(self.routes[1], per_feature), per_feature

    def unflatten(self, out: torch.Tensor, batch: int) -> torch.Tensor:
        """Pooled rows ``[F*B, E]`` (feature-major) -> ``[B, F, E]``."""
        return out.reshape(self.num_features, batch, self.dim).transpose(0, 1)

    def pooled(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        self.check_tables()
        if not self.sections:
            return super().pooled(values, lengths)
        batch = lengths.shape[1]
        ids, per_feature = self.global_ids(values, lengths)  # each table's first row added
        if len(self.sections) == 1:  # every table in one format: one call, no gather
            return self.unflatten(_bag(*self.sections[0][:2], ids, lengths), batch)
        which = torch.repeat_interleave(self.routes[0], per_feature)  # feature-major in each
        out = torch.empty(self.num_features, batch, self.dim)
        for k, (fmt, grid, feats, _) in enumerate(self.sections):
            out[feats] = _bag(fmt, grid, ids[which == k], lengths[feats]).view(-1, batch, self.dim)
        return out.transpose(0, 1)


def _bag(
    fmt: str,
    grid: torch.Tensor,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum-pooled fp32 rows ``[k*B, E]`` of ``grid``'s rows ``ids`` in bags of ``lengths``,
    each row scaled by its ``weights`` (float32[N]) when given."""
    lens = lengths.reshape(-1).to(torch.int64)
    offsets = torch.cumsum(lens, 0) - lens
    if fmt in _OPS:
        kernel = getattr(torch.ops.quantized, _OPS[fmt][2])
        return kernel(grid, ids, offsets, False, 0, False, weights, None, False)  # type: ignore[no-any-return]
    weight = grid.view(_DTYPES[fmt])
    per_row = None if weights is None else weights.to(weight.dtype)  # 0 or 1: exact in fp16
    return torch.nn.functional.embedding_bag(
        ids, weight, offsets, mode="sum", per_sample_weights=per_row
    ).float()


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
    model.sections = []
    if fmt in _DTYPES:
        grid = flat.view(rows, row_bytes(dim, fmt))
        model.weight = torch.nn.Parameter(grid.view(_DTYPES[fmt]), requires_grad=False)
        model = model.to(_DTYPES[fmt])  # the MLPs in the tables' dtype (the tables: no copy)
    else:
        model.weight = torch.nn.Parameter(torch.empty(0, dim), requires_grad=False)
        model.sections, model.routes = _sections(flat, [int(r) for r in spec["rows"]], dim, record)
    if device.type != "cpu":
        close_fd()  # the tables are copied to the device: nothing to watch
        if model.sections:
            raise ValueError(f"{path.name}: {fmt} tables are served on CPU (use fp16 on {device})")
        model = model.to(device)
        return model.eval()
    st = os.fstat(fd)
    model.tables_path, model.tables_fd = tables, fd
    model.tables_seen = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink)
    return model.eval()


def _sections(
    flat: torch.Tensor, rows: list[int], dim: int, record: dict[str, Any]
) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]], tuple[Any, Any]]:
    """:attr:`MappedScorer.sections` and ``routes`` of a quantized or mixed file (``flat``)."""
    formats = record.get("formats") or [record["format"]] * len(rows)
    if len(formats) != len(rows) or not set(formats) <= set(MIX_FORMATS):
        raise ValueError(f"{record['file']}: per-table formats {formats} do not fit {len(rows)}")
    local, sections, size = layout(rows, dim, formats)
    if size != record["bytes"]:
        raise ValueError(f"{record['file']}: its layout makes {size} bytes, not {record['bytes']}")
    out = []
    for fmt, (start, n) in sections.items():
        width = row_bytes(dim, fmt)
        feats = [t for t, f in enumerate(formats) if f == fmt]
        grid = flat[start : start + n * width].view(n, width)
        out.append((fmt, grid, torch.tensor(feats), torch.tensor([local[t] for t in feats])))
    return out, (torch.tensor([list(sections).index(f) for f in formats]), torch.tensor(local))
