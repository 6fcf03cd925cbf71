"""Which labelled rows the tools score: by default, the served model's own held-out rows.

``make score``, ``make evaluate`` and ``make rollout`` without ``DATA=`` take the data the served
version was trained on, as the ``schema.json`` inside its archive records it
(:mod:`recsys_stack.datafile`): its files, each checked against its recorded fingerprint, and
the held-out split (the last ``eval_rows`` rows: what the trainer evaluated on and the export's
parity report was computed on). The served version is the running stack's (``make serve``'s
``serve.json``: its plan's default, or the version asked for; its archive
``<model store>/<model>-<version>.mar``). With nothing serving, with no record, with the
data missing or changed, they refuse with one line ending ``pass DATA=... to choose``. A file
given (``DATA=``, ``--data``) is taken as it is (``--holdout`` chooses its last fraction).

Rows are read by the trainer's rules (:mod:`recsys_stack.criteo_rows`): a row is a non-empty
line, and the first malformed row of those scored (a label other than 0/1, an empty line between
rows, ...) is an error naming its file and its line in that file, however the rows were found.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recsys_stack.criteo_rows import ParsedRows, RowError, scan_rows
from recsys_stack.datafile import DataMismatch, check, heldout, shown
from serving import plan as plan_io
from serving.tools.state import read_state, replicas


class NoDefault(ValueError):
    """No default rows: nothing is serving, or its data is missing or changed (one line)."""


CHUNK = 1 << 23  # bytes read at a time when looking for the held-out rows from the end


@dataclass
class Window:
    """Rows ``first .. first + count`` (0-based) of the non-empty lines of ``paths``, in order."""

    paths: list[Path]
    first: int
    count: int
    origin: str = ""
    """How they were chosen, for the printed line (empty: a file given)."""
    start: tuple[int, int] | None = None
    """``(file index, byte offset)`` where row ``first`` begins, when known: reading starts
    there instead of walking every line before it (the held-out rows of a large file)."""

    def describe(self) -> str:
        files = ", ".join(shown(p) for p in self.paths)
        return f"rows {self.first + 1}..{self.first + self.count} of {files}{self.origin}"


def _nonempty(line: bytes) -> bool:
    """A row's line (the trainer's rule: a line of only ``\\r``/``\\n`` is empty; spaces are not)."""
    return bool(line.rstrip(b"\r\n"))


def _take(f: Iterable[bytes], rows: int) -> Iterator[bytes]:
    """The lines of ``f`` up to its ``rows``-th non-empty one: nothing past the window is read."""
    for raw in f:
        yield raw
        rows -= _nonempty(raw)
        if rows <= 0:
            return


def _skip(f: Iterable[bytes], rows: int) -> tuple[int, int]:
    """Read past ``rows`` non-empty lines of ``f``: ``(rows passed, lines passed)``."""
    passed = lines = 0
    for raw in f if rows else ():
        lines += 1
        passed += _nonempty(raw)
        if passed == rows:
            break
    return passed, lines


def _line_at(path: Path, offset: int) -> int:
    """The 1-based line that byte ``offset`` of ``path`` begins (counted only for an error)."""
    count = 0
    with path.open("rb") as f:
        while offset > 0 and (buf := f.read(min(offset, CHUNK))):
            count += buf.count(b"\n")
            offset -= len(buf)
    return count + 1


def window_rows(
    window: Window, batch: int, labelled: bool | None = True
) -> Iterator[tuple[Path, ParsedRows]]:
    """The rows of ``window`` parsed (:func:`recsys_stack.criteo_rows.scan_rows`), at most
    ``batch`` at a time, a batch never spanning two files: ``(file, rows)``. Raises
    :class:`RowError` (``file:line: ...``, the line in that file) at the first malformed row.
    ``rows.lines`` are the file's line numbers too, except where ``window.start`` sought the
    rows from the end: there they count from the sought offset (the lines before it are counted
    only for an error). ``labelled``: as ``scan_rows`` (None: as the first row has it, then the
    same for every file). Fewer rows than ``window.count`` when the files end first."""
    index, offset = window.start or (0, 0)
    skip, left = (window.first if window.start is None else 0), window.count
    for i, path in enumerate(window.paths[index:], index):
        if left <= 0:
            break
        with path.open("rb") as f:
            seek = offset if i == index else 0
            f.seek(seek)
            passed, line = _skip(f, skip)
            skip -= passed
            if skip:
                continue  # the window starts in a later file
            try:
                for rows in scan_rows(_take(f, left), str(path), batch, labelled=labelled,
                                      first_line=line + 1):  # fmt: skip
                    labelled = rows.labels is not None
                    left -= len(rows)
                    yield path, rows
            except RowError as e:
                if not seek:
                    raise
                line = _line_at(path, seek) + e.line - 1  # counted from the sought offset
                raise RowError(e.source, line, e.reason, e.detail) from None


def _tail(path: Path, need: int) -> tuple[int, int]:
    """``(byte offset, lines)``: where the last ``need`` lines of ``path`` begin (its trailing
    empty lines aside), or ``(0, lines in the file)`` when it has fewer."""
    with path.open("rb") as f:
        end = f.seek(0, 2)
        while end > 0:  # past the trailing newline and empty lines
            f.seek(max(0, end - 4096))
            block = f.read(end - max(0, end - 4096))
            kept = len(block.rstrip(b"\r\n"))
            end -= len(block) - kept
            if kept:
                break
        found, pos = 0, end
        while pos > 0:
            lo = max(0, pos - CHUNK)
            f.seek(lo)
            buf = f.read(pos - lo)
            if found + buf.count(b"\n") >= need:  # the need-th newline from the end is here
                cut = len(buf)
                for _ in range(need - found):
                    cut = buf.rfind(b"\n", 0, cut)
                return lo + cut + 1, need
            found += buf.count(b"\n")
            pos = lo
    return 0, found + (1 if end else 0)


def tail_start(paths: Sequence[Path], count: int) -> tuple[int, int]:
    """``(file index, byte offset)`` where the last ``count`` lines of ``paths`` begin."""
    for i in range(len(paths) - 1, -1, -1):
        offset, got = _tail(paths[i], count)
        if got >= count:
            return i, offset
        count -= got
    return 0, 0


def _count(paths: Sequence[Path]) -> int:
    total = 0
    for path in paths:
        with path.open("rb") as f:
            total += sum(map(_nonempty, f))
    return total


def row_window(path: Path, holdout: float, rows: int) -> tuple[int, int]:
    """``(first row, row count)`` to score: the last ``holdout`` fraction, at most ``rows``."""
    total = _count([path])
    first = total - round(total * holdout) if holdout else 0
    count = total - first
    if rows:
        count = min(count, rows)
    if count < 1:
        raise ValueError(f"{path}: no rows to score ({total} rows, holdout {holdout})")
    return first, count


def file_window(path: Path, holdout: float, rows: int) -> Window:
    """The rows of a file given (:func:`row_window`)."""
    return Window([path], *row_window(path, holdout, rows))


def model_window(schema: dict[str, Any], who: str, rows: int) -> Window:
    """The held-out rows ``schema`` records (at most ``rows``; 0 = all); :class:`DataMismatch`
    when its data is missing or changed."""
    data = schema.get("data")
    paths = check(data, who)
    assert data is not None
    first, count = heldout(data)
    if first is None:  # malformed rows were skipped: the split ends where the lines end
        first = _count(paths) - count
    if count < 1 or first < 0:
        raise DataMismatch(f"{who}'s data record holds no held-out rows: {data}")
    start = tail_start(paths, count)  # found from the end: no walk through the training rows
    count = min(count, rows) if rows else count
    return Window(paths, first, count, f" (the held-out rows {who} was trained with)", start)


def served_schema(workdir: Path, version: str = "") -> tuple[dict[str, Any], str]:
    """``(schema.json, "<model> v<version>")`` of the running stack's ``version`` (default:
    its plan's default), from that version's archive in the model store."""
    state = read_state(workdir)
    reps = replicas(workdir)
    if not state.get("plan") or not reps:
        raise NoDefault(f"nothing is serving from {workdir} (run `make serve` first)")
    plan = plan_io.load(Path(state["plan"]))
    version = version or plan.default
    mar = reps[0].model_store / f"{plan.model}-{version}.mar"
    return plan_io.read_mar_schema(mar), f"{plan.model} v{version}"


def refusal(reason: object, flag: str) -> NoDefault:
    """The one line: why there are no default rows, and how to choose some."""
    return NoDefault(f"{reason}: pass DATA=FILE.tsv (make) or {flag} FILE.tsv to choose")


def default_window(workdir: Path, version: str, rows: int, flag: str) -> Window:
    """The held-out rows of the served ``version``'s data (:func:`served_schema`,
    :func:`model_window`); :class:`NoDefault` (one line naming ``flag``) when there are none."""
    try:
        schema, who = served_schema(workdir, version)
        return model_window(schema, who, rows)
    except (NoDefault, DataMismatch, plan_io.PlanError, OSError) as e:
        raise refusal(e, flag) from None
