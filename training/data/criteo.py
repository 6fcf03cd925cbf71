"""Read Criteo TSV files (Kaggle / Terabyte layout) into numpy chunks, validating every field.

A row is 40 TAB-separated fields: ``label`` (0 or 1), ``I1..I13`` (integers, may be negative)
and ``C1..C26`` (hex ids, at most 16 digits, upper or lower case). An empty field is missing:
dense -> 0, sparse -> ``MISSING_ID``. A trailing ``'\\r'`` is ignored, the last line may lack its
newline, and empty lines at the very end of a file are EOF; any other empty line is malformed.

Speed: lines are split in Python, then every field of a chunk is validated and converted at once
with byte lookup tables in numpy; only rows that fail are re-examined one by one to produce a
``file:line: column X: reason`` message. Shapes: ``N`` rows in a chunk.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from recsys_stack.progress import progress as progress_bar
from training.errors import DataError
from training.features import DENSE_NAMES, MISSING_ID, NUM_DENSE, NUM_SPARSE, SPARSE_NAMES

if TYPE_CHECKING:
    from tqdm import tqdm

log = logging.getLogger(__name__)

NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
MAX_HEX_DIGITS = 16  # ids must fit in int64
MAX_DEC_DIGITS = 18  # every 18-digit integer fits in int64
MAX_EXAMPLES = 20
_WARN_FIRST = 5
_BLOCK = 8192  # rows converted at once
_INT64_MAX = np.uint64(2**63 - 1)
_DAY_FILE = re.compile(r"day_\d+(\.tsv)?")

OnBad = Literal["skip", "fail"]

# Byte lookup tables: the digit's value, or a code for '-' / anything invalid (NUL included).
_MINUS, _INVALID = 253, 255
_HEX_LUT = np.full(256, _INVALID, np.uint8)
_DEC_LUT = np.full(256, _INVALID, np.uint8)
for _i, _c in enumerate(b"0123456789"):
    _HEX_LUT[_c] = _DEC_LUT[_c] = _i
for _i, _c in enumerate(b"abcdef"):
    _HEX_LUT[_c] = _HEX_LUT[_c - 32] = 10 + _i
_DEC_LUT[ord("-")] = _MINUS


@dataclass
class ParseReport:
    """What a read accepted and rejected, by reason, with the first few messages."""

    rows_ok: int = 0
    rows_bad: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    """Malformed rows per category: ``field count``, ``label``, ``dense``, ``sparse``."""
    examples: list[str] = field(default_factory=list)
    """The first :data:`MAX_EXAMPLES` messages, ``path:line: column C7: 'zz12' is not hex``."""

    def add_bad(self, reason: str, message: str) -> None:
        """Count one malformed row."""
        self.rows_bad += 1
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(message)

    def summary(self) -> str:
        """One line, e.g. ``9 rows ok, 1 malformed (sparse: 1); first: ...``."""
        text = f"{self.rows_ok} rows ok, {self.rows_bad} malformed"
        if self.rows_bad:
            reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.by_reason.items()))
            text += f" ({reasons}); first: {self.examples[0]}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy."""
        return {
            "rows_ok": self.rows_ok,
            "rows_bad": self.rows_bad,
            "by_reason": dict(self.by_reason),
            "examples": list(self.examples),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParseReport:
        """Inverse of :meth:`to_dict`."""
        return cls(
            rows_ok=int(data["rows_ok"]),
            rows_bad=int(data["rows_bad"]),
            by_reason={str(k): int(v) for k, v in data["by_reason"].items()},
            examples=[str(e) for e in data["examples"]],
        )


@dataclass
class CriteoChunk:
    """Up to ``chunk_rows`` well-formed rows of one file (a chunk never spans two files)."""

    labels: np.ndarray  # int8[N], 0 or 1
    dense: np.ndarray  # float32[N, 13], raw integers, missing -> 0
    sparse: np.ndarray  # int64[N, 26], hex ids, missing -> MISSING_ID
    path: Path  # the file these rows came from
    line_numbers: np.ndarray  # int64[N], 1-based line of each row in ``path``

    def __len__(self) -> int:
        return len(self.labels)


def _natural_key(path: Path) -> list[Any]:
    """Sort ``day_2`` before ``day_10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def resolve_data_paths(path: Path | str) -> list[Path]:
    """A file -> ``[file]``; a directory -> its ``*.tsv`` and ``day_<n>`` files, naturally sorted.

    Raises :class:`DataError` when the path does not exist or a directory holds no data file.
    """
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.exists():
        raise DataError(f"data file not found: {path}")
    found = [
        p
        for p in path.iterdir()
        if p.is_file() and (p.suffix == ".tsv" or _DAY_FILE.fullmatch(p.name))
    ]
    if not found:
        raise DataError(f"no *.tsv or day_<n> files in data directory {path}; check the path")
    return sorted(found, key=_natural_key)


def _show(value: bytes) -> str:
    text = value.decode("utf-8", "replace")
    return repr(text if len(text) <= 40 else text[:37] + "...")


def _diagnose(parts: list[bytes]) -> tuple[str, str]:
    """First problem of a 40-field row as ``(reason, 'column X: ...')``; mirrors the fast path."""
    label = parts[0]
    if label not in (b"0", b"1"):
        return "label", f"column label: {_show(label)} is not 0 or 1"
    for name, value in zip(DENSE_NAMES, parts[1 : 1 + NUM_DENSE], strict=True):
        if not value:
            continue
        digits = value[1:] if value[:1] == b"-" else value
        if not digits.isdigit():
            return "dense", f"column {name}: {_show(value)} is not an integer"
        if len(digits) > MAX_DEC_DIGITS:
            return "dense", f"column {name}: {_show(value)} has more than {MAX_DEC_DIGITS} digits"
    for name, value in zip(SPARSE_NAMES, parts[1 + NUM_DENSE :], strict=True):
        if not value:
            continue
        if not all(c in b"0123456789abcdefABCDEF" for c in value):
            return "sparse", f"column {name}: {_show(value)} is not hex"
        if len(value) > MAX_HEX_DIGITS or int(value, 16) > 2**63 - 1:
            return "sparse", f"column {name}: {_show(value)} does not fit in int64"
    return "other", "row rejected by the fast parser but no column is wrong (parser bug)"


def _field_bytes(
    buf: np.ndarray, starts: np.ndarray, lens: np.ndarray, lut: np.ndarray, max_len: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """For ``k < max_len``: (``bool[...]`` field has a k-th byte, its ``lut`` code ``uint8[...]``)."""
    last = len(buf) - 1
    for k in range(min(int(lens.max(initial=0)), max_len)):
        present = lens > k
        yield present, lut[buf[np.minimum(starts + k, last)]]


def _parse_hex(
    buf: np.ndarray, starts: np.ndarray, lens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Hex fields at ``starts``/``lens`` -> ``int64[...]`` (empty -> MISSING_ID), bad mask."""
    bad = lens > MAX_HEX_DIGITS
    acc = np.zeros(starts.shape, np.uint64)
    for present, code in _field_bytes(buf, starts, lens, _HEX_LUT, MAX_HEX_DIGITS):
        bad |= present & (code >= 16)
        acc = np.where(present, acc * np.uint64(16) + (code & 15), acc)
    bad |= acc > _INT64_MAX
    out = acc.astype(np.int64)
    out[lens == 0] = MISSING_ID
    return out, bad


def _parse_dec(
    buf: np.ndarray, starts: np.ndarray, lens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Decimal integer fields -> ``int64[...]`` (empty -> 0) and a bad mask; '-' only leads."""
    neg = (lens > 0) & (buf[np.minimum(starts, len(buf) - 1)] == ord("-"))
    digits = lens - neg
    bad = (digits > MAX_DEC_DIGITS) | (neg & (digits == 0))
    acc = np.zeros(starts.shape, np.int64)
    for k, (present, code) in enumerate(
        _field_bytes(buf, starts, lens, _DEC_LUT, MAX_DEC_DIGITS + 1)
    ):
        digit = present & (code < 10)
        bad |= present & ~(digit | neg if k == 0 else digit)
        acc = np.where(digit, acc * 10 + (code & 15), acc)
    return np.where(neg, -acc, acc), bad


def _convert(lines: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``N`` lines of 40 fields -> (labels, dense, sparse, ``bool[N]`` bad-row mask).

    The lines are joined with TABs into one buffer, so field ``j`` of row ``i`` is field
    ``40 * i + j`` of the buffer; every field is then decoded by byte gathers, no per-field objects.
    """
    n = len(lines)
    buf = np.frombuffer(b"\t".join(lines), dtype=np.uint8)
    tabs = np.flatnonzero(buf == ord("\t"))
    starts = np.concatenate(([0], tabs + 1)).reshape(n, NUM_FIELDS)
    ends = np.concatenate((tabs, [len(buf)])).reshape(n, NUM_FIELDS)
    lens = ends - starts
    first = buf[np.minimum(starts[:, 0], len(buf) - 1)]
    bad = (lens[:, 0] != 1) | ((first != ord("0")) & (first != ord("1")))
    dense, dense_bad = _parse_dec(buf, starts[:, 1 : 1 + NUM_DENSE], lens[:, 1 : 1 + NUM_DENSE])
    sparse, sparse_bad = _parse_hex(buf, starts[:, 1 + NUM_DENSE :], lens[:, 1 + NUM_DENSE :])
    bad |= dense_bad.any(axis=1) | sparse_bad.any(axis=1)
    return (first == ord("1")).astype(np.int8), dense.astype(np.float32), sparse, bad


class CriteoReader:
    """Iterate :class:`CriteoChunk` s over Criteo TSV files; ``.report`` counts what was read.

    ``report`` is reset at the start of each iteration and is final once the iteration ends
    (an iteration stopped early leaves a partial report). ``file_rows`` maps each file to its
    number of data lines (kept + malformed), which is how sidecars indexed by row line up.

    Malformed rows: ``on_bad="fail"`` raises :class:`DataError` on the first one;
    ``on_bad="skip"`` drops them, warns about the first few and raises once more than
    ``max_bad_rows`` have been seen.
    """

    def __init__(
        self,
        paths: Sequence[Path | str],
        *,
        on_bad: OnBad = "skip",
        max_bad_rows: int = 1000,
        chunk_rows: int = 65536,
        progress: bool = True,
    ) -> None:
        if on_bad not in ("skip", "fail"):
            raise ValueError(f"on_bad must be 'skip' or 'fail', got {on_bad!r}")
        self.paths = [p for path in paths for p in resolve_data_paths(path)]
        self.on_bad = on_bad
        self.max_bad_rows = max_bad_rows
        self.chunk_rows = max(1, chunk_rows)
        self.progress = progress
        self.report = ParseReport()
        self.file_rows: dict[Path, int] = {}

    def __iter__(self) -> Iterator[CriteoChunk]:
        self.report = ParseReport()
        self.file_rows = {}
        total = sum(p.stat().st_size for p in self.paths)
        with progress_bar(
            total=total,
            unit="B",
            unit_scale=True,
            desc="parse",
            disable=not self.progress,
        ) as bar:
            for path in self.paths:
                yield from self._read_file(path, bar)
        if self.report.rows_bad:
            log.warning("parsed with malformed rows: %s", self.report.summary())
        else:
            log.info("parsed %s", self.report.summary())

    def _read_file(self, path: Path, bar: tqdm) -> Iterator[CriteoChunk]:
        """Chunks of one file; a malformed row is recorded as ``(line, reason, message)``."""
        try:
            f = path.open("rb")
        except FileNotFoundError:
            raise DataError(f"data file not found: {path}") from None
        with f:
            rows: list[bytes] = []  # lines with 40 fields, not yet validated
            lines: list[int] = []  # their line numbers
            bad: list[tuple[int, str, str]] = []
            empty: list[int] = []  # empty lines, malformed unless only more empties follow
            last = pos = 0
            for lineno, raw in enumerate(f, 1):
                line = raw.rstrip(b"\r\n")
                if not line:
                    empty.append(lineno)
                    continue
                if empty:
                    bad += [(n, "field count", "empty line, expected 40 fields") for n in empty]
                    empty = []
                last = lineno
                tabs = line.count(b"\t")
                if tabs != NUM_FIELDS - 1:
                    detail = f"expected {NUM_FIELDS} tab-separated fields, got {tabs + 1}"
                    bad.append((lineno, "field count", detail))
                    continue
                rows.append(line)
                lines.append(lineno)
                if len(lines) + len(bad) >= self.chunk_rows:
                    yield from self._emit(path, rows, lines, bad)
                    rows, lines, bad = [], [], []
                    bar.update(f.tell() - pos)
                    pos = f.tell()
            yield from self._emit(path, rows, lines, bad)
            bar.update(f.tell() - pos)
            self.file_rows[path] = last

    def _emit(
        self, path: Path, rows: list[bytes], lines: list[int], bad: list[tuple[int, str, str]]
    ) -> Iterator[CriteoChunk]:
        """Convert buffered rows, apply the malformed-row policy, yield the good rows."""
        line_numbers = np.asarray(lines, dtype=np.int64)
        if rows:
            # Blocks of a few thousand rows keep the byte gathers in cache (~1.5x faster).
            parts = [_convert(rows[i : i + _BLOCK]) for i in range(0, len(rows), _BLOCK)]
            lab, den, spa, row_bad = (np.concatenate(arrays) for arrays in zip(*parts, strict=True))
            for i in np.flatnonzero(row_bad).tolist():
                bad.append((lines[i], *_diagnose(rows[i].split(b"\t"))))
            keep = ~row_bad
            lab, den, spa, line_numbers = lab[keep], den[keep], spa[keep], line_numbers[keep]
        for lineno, reason, detail in sorted(bad):
            self._reject(f"{path}:{lineno}: {detail}", reason)
        if len(line_numbers):
            self.report.rows_ok += len(line_numbers)
            yield CriteoChunk(lab, den, spa, path, line_numbers)

    def _reject(self, message: str, reason: str) -> None:
        if self.on_bad == "fail":
            raise DataError(f"{message} (on_bad='fail'; use on_bad='skip' to drop malformed rows)")
        self.report.add_bad(reason, message)
        if self.report.rows_bad <= _WARN_FIRST:
            log.warning("skipping malformed row: %s", message)
        if self.report.rows_bad > self.max_bad_rows:
            raise DataError(
                f"{self.report.rows_bad} malformed rows, more than max_bad_rows="
                f"{self.max_bad_rows}; first: {self.report.examples[0]}; fix the data or "
                "raise max_bad_rows"
            )


def read_criteo(
    paths: Sequence[Path | str],
    *,
    on_bad: OnBad = "skip",
    max_bad_rows: int = 1000,
    chunk_rows: int = 65536,
    progress: bool = True,
) -> CriteoReader:
    """Iterable of :class:`CriteoChunk` s over ``paths`` (files or directories, in order).

    Iterate the result, then read ``.report`` (a :class:`ParseReport`)::

        reader = read_criteo([path])
        for chunk in reader: ...
        print(reader.report.summary())

    Raises :class:`DataError` for a missing path at once, and during iteration for malformed
    rows according to ``on_bad`` and ``max_bad_rows`` (see :class:`CriteoReader`).
    """
    return CriteoReader(
        paths, on_bad=on_bad, max_bad_rows=max_bad_rows, chunk_rows=chunk_rows, progress=progress
    )
