"""Writing ``tables_<fmt>.bin`` (the export's side of recsys_model/mapped.py, which maps and
reads them): fp32 rows in, the format's bytes out, one chunk in memory at a time. Not in the
model archive: workers only read tables."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from recsys_model.mapped import MIXED, drop_cached, layout, pack, row_bytes, sha256


class TableWriter:
    """Writes ``tables_<fmt>.bin``: fp32 rows in, ``fmt`` bytes out, one chunk in memory at a
    time (a table, or part of one, in any order); :meth:`close` checks every row was written
    exactly once and returns the record ``mapped_<fmt>.pt`` keeps. ``mixed``: ``tables``
    gives each table's rows and format (:func:`layout`)."""

    def __init__(
        self, path: Path, total_rows: int, dim: int, fmt: str,
        tables: list[tuple[int, str]] | None = None,
    ) -> None:  # fmt: skip
        self.path, self.rows, self.dim, self.fmt = path, total_rows, dim, fmt
        given, tables = tables is not None, tables or [(total_rows, fmt)]
        if sum(r for r, _ in tables) != total_rows or (fmt == MIXED) != given:
            raise ValueError(f"{path.name}: tables {tables} do not make {total_rows} {fmt} rows")
        self.formats = [f for _, f in tables]
        local, self.sections, self.bytes = layout([r for r, _ in tables], dim, self.formats)
        self.starts = [sum(r for r, _ in tables[:t]) for t in range(len(tables) + 1)]
        self.at = [self.sections[f][0] + n * row_bytes(dim, f)
                   for n, f in zip(local, self.formats, strict=True)]  # fmt: skip
        self.written = 0
        self.file = path.open("wb")
        self.file.truncate(self.bytes)

    def write(self, start: int, rows: torch.Tensor) -> None:
        """fp32 ``rows [r, E]`` at table row ``start`` of the concatenated tables."""
        if rows.shape[1] != self.dim or start < 0 or start + rows.shape[0] > self.rows:
            raise ValueError(f"{self.path.name}: rows {start}+{rows.shape[0]} do not fit")
        t, end = bisect.bisect_right(self.starts, start) - 1, start + rows.shape[0]
        while start < end:  # a chunk may cross tables (and so formats)
            stop = min(end, self.starts[t + 1])
            fmt = self.formats[t]
            self.file.seek(self.at[t] + (start - self.starts[t]) * row_bytes(self.dim, fmt))
            part = rows[start - end + rows.shape[0] : stop - end + rows.shape[0]]
            self.file.write(pack(part, fmt).numpy().data)  # the bytes, no extra copy
            self.written += stop - start
            start, t = stop, t + 1

    def close(self) -> dict[str, Any]:
        self.file.close()
        if self.written != self.rows:
            raise ValueError(f"{self.path.name}: {self.written} rows written for {self.rows}")
        digest = sha256(self.path)
        drop_cached(self.path)
        record = {"file": self.path.name, "format": self.fmt, "rows": self.rows,
                  "dim": self.dim, "bytes": self.bytes, "sha256": digest}  # fmt: skip
        return record | ({"formats": self.formats} if self.fmt == MIXED else {})


def write_tables(
    path: Path, total_rows: int, dim: int, fmt: str, chunks: Iterable[tuple[int, torch.Tensor]],
    tables: list[tuple[int, str]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """:class:`TableWriter` over ``chunks`` of ``(first row, fp32 rows [r, E])``."""
    writer = TableWriter(path, total_rows, dim, fmt, tables)
    for start, rows in chunks:
        writer.write(start, rows)
    return writer.close()
