"""Parallel preprocessing: Criteo TSV cut into line-aligned byte ranges ("parts") that worker
processes parse on their own, merged in input order into the same bytes as one pass.

:func:`plan_parts` cuts every input file each ``part_bytes`` bytes and moves each cut to the
start of the next line, so a line belongs to the part holding its first byte; the plan depends
on the files only, not on how many processes run it. :func:`parse_part` reads exactly its range,
converts and hashes its rows (:func:`training.data.layout.store_ids`) and writes them to
``<work>/<part>/`` (``labels.bin``, ``dense.bin``, ``sparse.bin``; ``lines.bin``, the kept
rows' line numbers, when prob sidecars are to be aligned), its malformed rows numbered from the
part's first line; ``done.json``, written last, marks the part finished, and a resumed run skips
it. :class:`Merger` takes the parts in input order, numbers their lines per file, applies the
malformed-row policy exactly as a single pass over the file would, and appends each part to the
final arrays. Shapes: ``N`` rows of a part.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from recsys_model.atomic import write_atomic
from recsys_stack.cpus import available_cpus
from recsys_stack.criteo_rows import EMPTY_LINE
from training.data.criteo import (
    MAX_EXAMPLES,
    BadRow,
    LineScan,
    OnBad,
    ParseReport,
    convert_rows,
    reject,
    too_many_bad,
)
from training.data.layout import NPY_HEADER, TRAILING, npy_header, store_ids
from training.errors import DataError

PART_BYTES = 64 << 20
ARRAYS = ("labels", "dense", "sparse")
_EMPTY = ("field count", EMPTY_LINE)  # the wording every reader uses (recsys_stack)


@dataclass(frozen=True)
class Part:
    """Bytes ``[start, end)`` of input file ``file``, starting and ending at line starts."""

    index: int
    file: int
    start: int
    end: int


@dataclass(frozen=True)
class Job:
    """What a worker needs besides its part (sent with each part)."""

    files: tuple[Path, ...]
    work: Path
    chunk_rows: int
    on_bad: OnBad
    max_bad_rows: int
    rows_per_table: tuple[int, ...] | None
    id_dtype: str
    want_lines: bool  # every input has a prob sidecar: keep the rows' line numbers

    def dir(self, part: Part) -> Path:
        return self.work / f"{part.index:06d}"


def _next_line(f: BinaryIO, pos: int, size: int) -> int:
    """Offset of the first line that starts at or after ``pos`` (``size`` if none does)."""
    f.seek(pos - 1)
    while block := f.read(1 << 16):
        j = block.find(b"\n")
        if j >= 0:
            return pos + j  # the block starts at pos - 1
        pos += len(block)
    return size


def plan_parts(files: Sequence[Path], part_bytes: int) -> list[Part]:
    """Every file cut about each ``part_bytes`` bytes, each cut moved to the next line start."""
    spans: list[tuple[int, int, int]] = []
    for i, path in enumerate(files):
        try:
            f = path.open("rb")
        except FileNotFoundError:
            raise DataError(f"{path}: vanished during preprocessing; nothing was cached") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            cuts = [0]
            for nominal in range(part_bytes, size, part_bytes):
                cut = _next_line(f, nominal, size)
                if cuts[-1] < cut < size:
                    cuts.append(cut)
            cuts.append(size)
        spans += [(i, a, b) for a, b in itertools.pairwise(cuts) if b > a]
    return [Part(k, *span) for k, span in enumerate(spans)]


class _Range(io.RawIOBase):
    """Bytes ``[start, start + length)`` of file descriptor ``fd`` as a readable stream (wrap it
    in a ``BufferedReader`` to iterate lines); ``left`` > 0 at its end: the file was cut short."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self.fd, self.pos, self.left = fd, start, length

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.left)
        if n <= 0:
            return 0
        got = os.preadv(self.fd, [memoryview(buffer)[:n]], self.pos)
        self.pos += got
        self.left -= got
        return got


def cpu_cores() -> int:
    """CPUs this process may use: its cgroup's CPU quota (a container's limit), at most its
    affinity (:func:`recsys_stack.cpus.available_cpus`, what TorchServe's workers count too): a
    trainer pod limited to 2 CPUs on a 64-core node preprocesses with 2 processes, not 64."""
    return available_cpus()


def init_worker() -> None:
    """One worker, one core: no intra-op threads on top of the worker processes."""
    torch.set_num_threads(1)


def parse_part(job: Job, part: Part) -> dict[str, Any]:
    """Parse ``part`` into ``job.dir(part)``; returns its summary (saved as ``done.json`` when
    the part was read to its end, not stopped early by the malformed-row policy).

    Raises :class:`DataError` when the file vanished or was cut short since the plan was made.
    """
    out = job.dir(part)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    path = job.files[part.file]
    rows = bad = 0
    by_reason: dict[str, int] = {}
    examples: list[BadRow] = []
    stopped = False
    names = [*ARRAYS, "lines"] if job.want_lines else list(ARRAYS)
    try:
        f = path.open("rb")
    except FileNotFoundError:
        raise DataError(f"{path}: vanished during preprocessing; nothing was cached") from None
    with f:
        handles = {name: (out / f"{name}.bin").open("wb") for name in names}
        rng = _Range(f.fileno(), part.start, part.end - part.start)
        scan = LineScan(io.BufferedReader(rng, 1 << 20), job.chunk_rows)
        try:
            for batch in scan:
                labels, dense, sparse, lines, bad_rows = convert_rows(*batch)
                for row in bad_rows:
                    bad += 1
                    by_reason[row[1]] = by_reason.get(row[1], 0) + 1
                    if len(examples) < MAX_EXAMPLES:
                        examples.append(row)
                arrays = {
                    "labels": labels,
                    "dense": dense,
                    "sparse": store_ids(sparse, job.rows_per_table, np.dtype(job.id_dtype)),
                    "lines": lines,
                }
                for name, h in handles.items():
                    h.write(arrays[name].tobytes())
                rows += len(labels)
                if bad and (job.on_bad == "fail" or bad > job.max_bad_rows):
                    stopped = True
                    break
        finally:
            for h in handles.values():
                h.close()
    if not stopped and rng.left != 0:
        raise DataError(
            f"{path}: truncated during preprocessing (it now ends before byte {part.end}); "
            "nothing was cached"
        )
    summary = {
        "rows": rows,
        "lines": scan.lines,
        "last": scan.last,
        "trailing_empty": scan.trailing_empty,
        "bad": bad,
        "by_reason": by_reason,
        "examples": [list(e) for e in examples],
        "complete": not stopped,
    }
    if not stopped:
        write_atomic(out / "done.json", json.dumps(summary))
    return summary


def finished(job: Job, part: Part, dtypes: dict[str, np.dtype]) -> dict[str, Any] | None:
    """The summary of a part a previous run finished, or None (to parse it again)."""
    out = job.dir(part)
    try:
        summary: dict[str, Any] = json.loads((out / "done.json").read_text())
        names = [*ARRAYS, "lines"] if job.want_lines else list(ARRAYS)
        for name in names:
            dtype = np.dtype(np.int64) if name == "lines" else dtypes[name]
            row_bytes = dtype.itemsize * int(np.prod(TRAILING.get(name, ())))
            if (out / f"{name}.bin").stat().st_size != summary["rows"] * row_bytes:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return summary


def append_file(src: Path, dst: BinaryIO) -> None:
    """Append file ``src`` to the unbuffered ``dst`` (in the kernel where it can)."""
    with src.open("rb") as f:
        size = left = os.fstat(f.fileno()).st_size
        try:
            while left > 0 and (n := os.copy_file_range(f.fileno(), dst.fileno(), left)):
                left -= n
        except (AttributeError, OSError):  # no copy_file_range here: copy in user space
            pass
        f.seek(size - left)
        dst.seek(0, os.SEEK_END)
        shutil.copyfileobj(f, dst, 1 << 22)


class Merger:
    """Parts in input order -> ``<tmp>/<name>.npy`` and one :class:`ParseReport`.

    Line numbers are global per file whichever process parsed the part: a part's are offset by
    the lines of the file's earlier parts. Empty lines at the end of a part are malformed if a
    later part of the same file has a non-empty line (the file's end otherwise).
    """

    def __init__(
        self,
        job: Job,
        tmp: Path,
        dtypes: dict[str, np.dtype],
        probs: list[np.ndarray] | None,
    ) -> None:
        self.job, self.tmp, self.dtypes, self.probs = job, tmp, dtypes, probs
        self.report = ParseReport()
        self.rows = 0
        self.file_lines = [0] * len(job.files)  # lines of the file's parts merged so far
        self.file_rows = [0] * len(job.files)  # last non-empty line of the file
        self.pending: list[tuple[int, int]] = []  # (first line, count) of trailing empty lines
        self.current = -1
        names = [*ARRAYS, "prob"] if probs is not None else list(ARRAYS)
        self.out = {name: (tmp / f"{name}.npy").open("wb", buffering=0) for name in names}
        for h in self.out.values():
            h.write(bytes(NPY_HEADER))

    def _reject(self, path: Path, rows: list[BadRow], more: dict[str, int]) -> None:
        job = self.job
        for line, reason, detail in rows:
            reject(self.report, f"{path}:{line}: {detail}", reason, job.on_bad, job.max_bad_rows)
        for reason, n in more.items():  # past a part's first MAX_EXAMPLES: counts only
            self.report.count_bad(reason, n)
            if n and self.report.rows_bad > job.max_bad_rows:
                raise too_many_bad(self.report, job.max_bad_rows)

    def add(self, part: Part, summary: dict[str, Any]) -> None:
        """Merge one part (in input order); raises :class:`DataError` per the policy."""
        path, offset = self.job.files[part.file], self.file_lines[part.file]
        if part.file != self.current:
            self.current, self.pending = part.file, []
        if summary["last"]:  # a non-empty line follows the pending empty lines
            for first, n in self.pending:
                shown = min(n, MAX_EXAMPLES)
                extra = {_EMPTY[0]: n - shown}
                self._reject(path, [(first + i, *_EMPTY) for i in range(shown)], extra)
            self.pending = []
        examples = [(offset + int(line), str(r), str(d)) for line, r, d in summary["examples"]]
        more = dict(summary["by_reason"])
        for _, reason, _ in examples:
            more[reason] -= 1
        self._reject(path, examples, more)
        if not summary["complete"]:
            raise AssertionError(f"part {part} stopped early but broke no rule")
        if summary["trailing_empty"]:
            first = offset + summary["lines"] - summary["trailing_empty"] + 1
            self.pending.append((first, summary["trailing_empty"]))
        if summary["last"]:
            self.file_rows[part.file] = offset + summary["last"]
        self.file_lines[part.file] += summary["lines"]
        self.rows += summary["rows"]
        self.report.rows_ok += summary["rows"]
        src = self.job.dir(part)
        for name in ARRAYS:
            append_file(src / f"{name}.bin", self.out[name])
        self._add_prob(part, src, offset)

    def _add_prob(self, part: Part, src: Path, offset: int) -> None:
        if self.probs is None or "prob" not in self.out:
            return
        prob = self.probs[part.file]
        lines = np.fromfile(src / "lines.bin", dtype=np.int64) + offset
        if len(lines) and lines[-1] > len(prob):
            self.out.pop("prob").close()
            return
        self.out["prob"].write(np.asarray(prob[lines - 1], np.float32).tobytes())

    def finish(self) -> bool:
        """Write the headers and close; returns whether ``prob.npy`` was kept (every sidecar
        has one entry per data line of its file)."""
        probs = self.probs
        has_prob = "prob" in self.out and probs is not None
        if has_prob and probs is not None:
            has_prob = all(self.file_rows[i] == len(p) for i, p in enumerate(probs))
        for name, h in self.out.items():
            if name != "prob" or has_prob:
                h.seek(0)
                h.write(npy_header(self.dtypes[name], (self.rows, *TRAILING[name])))
            h.close()
        if not has_prob:
            (self.tmp / "prob.npy").unlink(missing_ok=True)
        return has_prob

    def close(self) -> None:
        for h in self.out.values():
            h.close()


def kill_workers(workers: Sequence[BaseProcess]) -> None:
    """SIGKILL and reap a failed run's parsing workers that are still alive."""
    workers = [w for w in workers if w.is_alive()]
    for w in workers:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            w.kill()
    for w in workers:
        with contextlib.suppress(OSError, ValueError, AssertionError):
            w.join(30)
