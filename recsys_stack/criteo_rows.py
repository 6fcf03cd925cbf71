"""Criteo TSV rows: the one set of rules, and their wording, that every reader of the files applies.

A row is 40 TAB-separated fields: ``label`` (``0`` or ``1``), ``I1..I13`` (decimal integers, a
leading ``-`` allowed, at most 18 digits) and ``C1..C26`` (hex ids, upper or lower case, that fit
in int64). An empty field is missing: dense -> 0, sparse -> :data:`MISSING_ID`; an empty label is
malformed. A trailing ``'\\r'`` is ignored, the last line may lack its newline, and empty lines at
the very end of a file are its end; any other empty line is malformed.

The trainer (``training/data/criteo.py``) scans lines with :class:`LineScan` and converts them in
bulk with numpy byte tables, then names the first bad column of a rejected row with
:func:`diagnose`; the serving tools (client, evaluate, rollout) read with :func:`scan_rows`, which
runs the same :class:`LineScan` and :func:`parse_fields` per row and stops at the first
malformed row. Messages are ``path:line: column C7: 'zz12' is not hex`` in both. Serving never
imports training: this module is what they share (numpy only). Shapes: ``N`` rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
DENSE_NAMES: list[str] = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
SPARSE_NAMES: list[str] = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]
MISSING_ID = -1  # an empty categorical field
MAX_HEX_DIGITS = 16  # ids must fit in int64
MAX_DEC_DIGITS = 18  # every 18-digit integer fits in int64
_INT64_MAX = 2**63 - 1
_HEX = b"0123456789abcdefABCDEF"

EMPTY_LINE = f"empty line, expected {NUM_FIELDS} fields"


def field_count(got: int, want: int = NUM_FIELDS) -> str:
    """The wording of a line with the wrong number of fields."""
    return f"expected {want} tab-separated fields, got {got}"


class FieldError(ValueError):
    """One malformed row: ``reason`` (``field count``, ``label``, ``dense``, ``sparse``) and
    ``detail`` (``column C7: 'zz12' is not hex``), without the file and line."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class RowError(ValueError):
    """A malformed row of a file, one line: ``path:line: detail``."""

    def __init__(self, source: str, line: int, reason: str, detail: str) -> None:
        super().__init__(f"{source}:{line}: {detail}")
        self.source, self.line, self.reason, self.detail = source, line, reason, detail


def _show(value: bytes) -> str:
    text = value.decode("utf-8", "replace")
    return repr(text if len(text) <= 40 else text[:37] + "...")


def parse_label(value: bytes) -> int:
    """``b'0'`` / ``b'1'`` -> 0 / 1; anything else (empty included) is malformed."""
    if value == b"0" or value == b"1":
        return value[0] - 48
    raise FieldError("label", f"column label: {_show(value)} is not 0 or 1")


def parse_dense(name: str, value: bytes) -> int:
    """A decimal integer field (empty -> 0)."""
    if not value:
        return 0
    digits = value[1:] if value[:1] == b"-" else value
    if not digits.isdigit():  # bytes.isdigit: ASCII digits only, False when empty
        raise FieldError("dense", f"column {name}: {_show(value)} is not an integer")
    if len(digits) > MAX_DEC_DIGITS:
        raise FieldError(
            "dense", f"column {name}: {_show(value)} has more than {MAX_DEC_DIGITS} digits"
        )
    return int(value)


def parse_sparse(name: str, value: bytes) -> int:
    """A hex id field (empty -> :data:`MISSING_ID`)."""
    if not value:
        return MISSING_ID
    if value.translate(None, _HEX):  # a byte that is not a hex digit is left over
        raise FieldError("sparse", f"column {name}: {_show(value)} is not hex")
    if len(value) > MAX_HEX_DIGITS or int(value, 16) > _INT64_MAX:
        raise FieldError("sparse", f"column {name}: {_show(value)} does not fit in int64")
    return int(value, 16)


def parse_fields(parts: Sequence[bytes]) -> tuple[int | None, list[int], list[int]]:
    """The fields of one row (40, or 39 without the label) -> ``(label or None, 13 dense ints,
    26 ids)``; :class:`FieldError` names the first bad column, in column order."""
    label = parse_label(parts[0]) if len(parts) == NUM_FIELDS else None
    values = parts[len(parts) - NUM_DENSE - NUM_SPARSE :]
    dense = [parse_dense(n, v) for n, v in zip(DENSE_NAMES, values[:NUM_DENSE], strict=True)]
    sparse = [parse_sparse(n, v) for n, v in zip(SPARSE_NAMES, values[NUM_DENSE:], strict=True)]
    return label, dense, sparse


def diagnose(parts: list[bytes]) -> tuple[str, str]:
    """First problem of a 40-field row the trainer's fast path rejected, ``(reason, detail)``."""
    try:
        parse_fields(parts)
    except FieldError as e:
        return e.reason, e.detail
    return "other", "row rejected by the fast parser but no column is wrong (parser bug)"


BadRow = tuple[int, str, str]
"""A malformed line: ``(line number, reason, 'column X: ...')``."""


class LineScan:
    """The lines of an open Criteo file, from where it stands to its end, in batches.

    Iterating yields ``(rows, lines, bad)``: about ``chunk_rows`` lines with ``fields`` fields,
    their 1-based line numbers (counted from where ``f`` stood) and the malformed lines seen since
    the last batch (:data:`BadRow`); the trainer's ``convert_rows`` or :func:`parse_fields`
    validates the rows. An empty line is malformed once a non-empty line follows it. Once
    iterated: ``lines`` read, ``last`` (the last non-empty line, 0 if none) and ``trailing_empty``
    (empty lines after ``last``: the end of the file, or malformed if what ``f`` was cut from goes
    on with a non-empty line).
    """

    def __init__(self, f: Iterable[bytes], chunk_rows: int, fields: int = NUM_FIELDS) -> None:
        self.f = f
        self.chunk_rows = max(1, chunk_rows)
        self.fields = fields
        self.lines = self.last = self.trailing_empty = 0

    def __iter__(self) -> Iterator[tuple[list[bytes], list[int], list[BadRow]]]:
        rows: list[bytes] = []  # lines with the right number of fields, not yet validated
        lines: list[int] = []  # their line numbers
        bad: list[BadRow] = []
        empty: list[int] = []  # empty lines, malformed unless only more empties follow
        last = lineno = 0
        for lineno, raw in enumerate(self.f, 1):
            line = raw.rstrip(b"\r\n")
            if not line:
                empty.append(lineno)
                continue
            if empty:
                bad += [(n, "field count", EMPTY_LINE) for n in empty]
                empty = []
            last = lineno
            tabs = line.count(b"\t")
            if tabs != self.fields - 1:
                bad.append((lineno, "field count", field_count(tabs + 1, self.fields)))
                continue
            rows.append(line)
            lines.append(lineno)
            if len(lines) + len(bad) >= self.chunk_rows:
                yield rows, lines, bad
                rows, lines, bad = [], [], []
        self.lines, self.last, self.trailing_empty = lineno, last, len(empty)
        if rows or bad:
            yield rows, lines, bad


@dataclass
class ParsedRows:
    """Well-formed rows of one file, as the tools send them."""

    labels: np.ndarray | None  # int8[N], 0 or 1; None for rows without a label
    dense: np.ndarray  # float32[N, 13], raw integers, missing -> 0
    sparse: np.ndarray  # int64[N, 26], raw ids, missing -> MISSING_ID
    lines: np.ndarray  # int64[N], the 1-based line of each row in its file

    def __len__(self) -> int:
        return len(self.dense)

    @classmethod
    def concat(cls, parts: Sequence[ParsedRows]) -> ParsedRows:
        """Batches (all labelled, or none) as one (no batches: no rows, no labels)."""
        labels = [p.labels for p in parts if p.labels is not None]
        if not parts:
            return cls(None, np.zeros((0, NUM_DENSE), np.float32),
                       np.zeros((0, NUM_SPARSE), np.int64), np.zeros(0, np.int64))  # fmt: skip
        return cls(
            labels=np.concatenate(labels) if labels else None,
            dense=np.concatenate([p.dense for p in parts]).reshape(-1, NUM_DENSE),
            sparse=np.concatenate([p.sparse for p in parts]).reshape(-1, NUM_SPARSE),
            lines=np.concatenate([p.lines for p in parts]).astype(np.int64),
        )


def _first_fields(f: Iterator[bytes]) -> tuple[int, Iterator[bytes]]:
    """The field count of the first non-empty line of ``f`` (0: none), and ``f`` unconsumed."""
    head: list[bytes] = []
    for raw in f:
        head.append(raw)
        line = raw.rstrip(b"\r\n")
        if line:
            return line.count(b"\t") + 1, itertools.chain(head, f)
    return 0, iter(head)


def scan_rows(
    f: Iterable[bytes],
    source: str,
    batch: int,
    *,
    labelled: bool | None = True,
    first_line: int = 1,
) -> Iterator[ParsedRows]:
    """The rows of an open file from where it stands, ``batch`` at a time, by the trainer's rules.

    ``labelled``: True = 40 fields, label first; False = 39, no label; None = as the first
    non-empty line has it (40 or 39), the same for every row. ``first_line``: the line ``f``
    stands at (errors and :attr:`ParsedRows.lines` are the file's own line numbers). Raises
    :class:`RowError` (``source:line: detail``) at the first malformed row, before yielding the
    batch it is in.
    """
    it = iter(f)
    if labelled is None:
        got, it = _first_fields(it)
        labelled = got != NUM_FIELDS - 1  # anything but 39: judged as a labelled row
    fields = NUM_FIELDS if labelled else NUM_FIELDS - 1
    for rows, lines, bad in LineScan(it, batch, fields):
        labels: list[int | None] = []
        dense: list[list[int]] = []
        sparse: list[list[int]] = []
        for line, lineno in zip(rows, lines, strict=True):
            if bad and bad[0][0] < lineno:
                break
            try:
                label, d, s = parse_fields(line.split(b"\t"))
            except FieldError as e:
                bad = [(lineno, e.reason, e.detail)]
                break
            labels.append(label)
            dense.append(d)
            sparse.append(s)
        if bad:
            lineno, reason, detail = bad[0]
            raise RowError(source, first_line - 1 + lineno, reason, detail)
        yield ParsedRows(
            labels=np.asarray(labels, np.int8) if labelled else None,
            dense=np.asarray(dense, np.float32).reshape(-1, NUM_DENSE),
            sparse=np.asarray(sparse, np.int64).reshape(-1, NUM_SPARSE),
            lines=np.asarray(lines, np.int64) + (first_line - 1),
        )
