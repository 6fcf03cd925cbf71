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

from recsys_stack.criteo_rows import BadRow, LineScan, diagnose
from recsys_stack.datafile import natural_key
from recsys_stack.progress import progress as progress_bar
from training.data.fields import convert_block
from training.errors import DataError
from training.features import NUM_DENSE, NUM_SPARSE

if TYPE_CHECKING:
    from tqdm import tqdm

log = logging.getLogger(__name__)

MAX_EXAMPLES = 20
_WARN_FIRST = 5
_BLOCK = 8192  # rows converted at once
_DAY_FILE = re.compile(r"day_\d+(\.tsv)?")

OnBad = Literal["skip", "fail"]


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

    def count_bad(self, reason: str, n: int) -> None:
        """Count ``n`` more malformed rows past the first :data:`MAX_EXAMPLES` (no messages)."""
        assert len(self.examples) == MAX_EXAMPLES or n == 0, "the first rows need messages"
        self.rows_bad += n
        self.by_reason[reason] = self.by_reason.get(reason, 0) + n

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
    """Sort ``day_2`` before ``day_10``: the project's one file order, shared with the
    continuous inbox (:func:`recsys_stack.datafile.natural_key`)."""
    return natural_key(path.name)


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


def convert_rows(
    rows: list[bytes], lines: list[int], bad: list[BadRow]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[BadRow]]:
    """A :class:`LineScan` batch -> the well-formed rows' (labels, dense, sparse, line numbers)
    and every malformed row of the batch, sorted by line (the fast path's rejects diagnosed)."""
    if not rows:
        empty = np.zeros((0, NUM_DENSE), np.float32), np.zeros((0, NUM_SPARSE), np.int64)
        return np.zeros(0, np.int8), *empty, np.zeros(0, np.int64), sorted(bad)
    # Blocks of a few thousand rows keep the byte gathers in cache (~1.5x faster).
    parts = [convert_block(rows[i : i + _BLOCK]) for i in range(0, len(rows), _BLOCK)]
    lab, den, spa, row_bad = (np.concatenate(arrays) for arrays in zip(*parts, strict=True))
    bad = list(bad)
    for i in np.flatnonzero(row_bad).tolist():
        bad.append((lines[i], *diagnose(rows[i].split(b"\t"))))
    keep = ~row_bad
    line_numbers = np.asarray(lines, dtype=np.int64)[keep]
    return lab[keep], den[keep], spa[keep], line_numbers, sorted(bad)


def reject(report: ParseReport, message: str, reason: str, on_bad: OnBad, max_bad: int) -> None:
    """Apply the malformed-row policy to one more malformed row (in file order)."""
    if on_bad == "fail":
        raise DataError(f"{message} (on_bad='fail'; use on_bad='skip' to drop malformed rows)")
    report.add_bad(reason, message)
    if report.rows_bad <= _WARN_FIRST:
        log.warning("skipping malformed row: %s", message)
    if report.rows_bad > max_bad:
        raise too_many_bad(report, max_bad)


def too_many_bad(report: ParseReport, max_bad: int) -> DataError:
    """The error of the first malformed row past ``max_bad`` (``report`` holds the first one)."""
    return DataError(
        f"{max_bad + 1} malformed rows, more than max_bad_rows={max_bad}; first: "
        f"{report.examples[0]}; fix the data or raise max_bad_rows"
    )


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
        self.on_bad: OnBad = on_bad
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
        """Chunks of one file, malformed rows passed through the policy in line order."""
        try:
            f = path.open("rb")
        except FileNotFoundError:
            raise DataError(f"data file not found: {path}") from None
        with f:
            scan = LineScan(f, self.chunk_rows)
            pos = 0
            for batch in scan:
                lab, den, spa, line_numbers, bad = convert_rows(*batch)
                for lineno, reason, detail in bad:
                    reject(
                        self.report,
                        f"{path}:{lineno}: {detail}",
                        reason,
                        self.on_bad,
                        self.max_bad_rows,
                    )
                bar.update(f.tell() - pos)
                pos = f.tell()
                if len(line_numbers):
                    self.report.rows_ok += len(line_numbers)
                    yield CriteoChunk(lab, den, spa, path, line_numbers)
            self.file_rows[path] = scan.last


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
