"""Which labelled rows the tools score: by default, rows the served model never trained on.

``make score``, ``make evaluate`` and ``make rollout`` without ``DATA=`` take the rows the
version's ``schema.json`` records as **unseen** by it (``data.unseen``,
:mod:`recsys_stack.datafile`): a batch run's test split (the last ``test_rows`` rows of its
data: what the trainer's final report is of, and no decision of the run saw; a run from before
the test split: its held-out rows), a continuous run's next file (the one that arrived after
the checkpoint, scored before any model trained on it), each file checked against its recorded
fingerprint, and the printed line says which and why. ``make score`` and ``make evaluate``
take the served version's (``make serve``'s ``serve.json``: its plan's default, or the version
asked for; its archive ``<model store>/<model>-<version>.mar``), ``make rollout`` the
candidate's (:func:`provenance` then says whether the default's record shows it trained on
them). With nothing serving, with no such record (a continuous checkpoint exported without
``--unseen-data``, or by a version of the loop that trained on its "held-out" rows), with the
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
from recsys_stack.datafile import DataMismatch, check, fingerprint, same, shown, unseen
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
    """The rows ``schema`` records as unseen by its model (at most ``rows``; 0 = all);
    :class:`DataMismatch` (one line) when there are none, or their data is missing or changed."""
    data = schema.get("data")
    if not data:
        raise DataMismatch(f"{who}'s schema.json records no training data (re-export it)")
    metrics = schema.get("training_metrics") or {}
    if "unseen" not in data and "file_index" in metrics:  # the loop trained its "held-out" rows
        raise DataMismatch(
            f"{who} was exported by continuous training before unseen rows were recorded: the "
            "held-out rows its record names were trained on (re-export it with --unseen-data "
            "FILE of a later file)"
        )
    entry = unseen(data)
    if entry is None:
        raise DataMismatch(
            f"{who}'s schema.json records no rows it never trained on (a continuous "
            "checkpoint exported without --unseen-data: it trained on every row of its files)"
        )
    paths = check(entry, who, "{who}'s unseen rows are in")
    first, count = entry["first_row"], int(entry["rows"])
    at_end = entry.get("at_end", True)
    if first is None:  # malformed rows were skipped: the rows end where the lines end
        first = _count(paths) - count
    if count < 1 or first < 0:
        raise DataMismatch(f"{who}'s data record holds no unseen rows: {entry}")
    # the held-out rows are found from the end: no walk through the training rows before them
    start = tail_start(paths, count) if at_end else None
    count = min(count, rows) if rows else count
    return Window(paths, first, count, f" (unseen by {who}: {entry.get('why', '')})", start)


def unseen_by(schema: dict[str, Any], window: Window, who: str) -> tuple[bool | None, str]:
    """Whether the model of ``schema`` never trained on the rows of ``window``, as far as its
    record says: ``(True, why)`` inside its own unseen rows or in no file it trained on,
    ``(False, why)`` in a file it trained on, ``(None, why)`` when its record cannot tell."""
    data = schema.get("data")
    if not data:
        return None, f"{who}'s schema.json records no training data"
    try:
        own: Window | None = model_window(schema, who, 0)
    except DataMismatch:
        own = None
    mine = [Path(p).resolve() for p in window.paths]
    if own is not None and _inside(window, own):
        return True, f"within the rows {who} never trained on"
    valid = int(data.get("valid_rows") or 0)  # a batch run's validation rows, before its test
    if own is not None and own.first >= valid > 0:
        held = Window(own.paths, own.first - valid, own.count + valid)
        if _inside(window, held):
            return True, (f"within the rows {who} never trained on (its validation rows among "
                          "them chose its checkpoint)")  # fmt: skip
    trained = data.get("trained_files") or data.get("files") or []
    for path in mine:
        if any(same(fingerprint(path), t) for t in trained):
            return False, f"{who} trained on {shown(path)}"
    if "trained_files" not in data and "file_index" in (schema.get("training_metrics") or {}):
        return None, f"{who}'s record does not list every file it trained on"
    return True, f"{who}'s record names no such file"


def _inside(window: Window, outer: Window) -> bool:
    """Whether the rows of ``window`` are rows of ``outer`` (the same files, in order)."""
    same_files = [Path(p).resolve() for p in window.paths] == [
        Path(p).resolve() for p in outer.paths
    ]
    end, outer_end = window.first + window.count, outer.first + outer.count
    return same_files and outer.first <= window.first and end <= outer_end


def provenance(window: Window, models: dict[str, tuple[dict[str, Any], str]]) -> dict[str, Any]:
    """The rows of ``window`` as a record: files, 1-based row range, count, and for each model
    of ``models`` (``role: (schema, who)``) ``unseen_by_<role>`` (:func:`unseen_by`: True,
    False or None) and ``<role>_record`` (why)."""
    out: dict[str, Any] = {
        "files": [str(p) for p in window.paths],
        "first_row": window.first + 1,
        "last_row": window.first + window.count,
        "rows": window.count,
        "chosen": window.origin.strip()[1:-1] if window.origin else "a file given",
    }
    for role, (schema, who) in models.items():
        out[f"unseen_by_{role}"], out[f"{role}_record"] = unseen_by(schema, window, who)
    return out


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
    """The unseen rows of the served ``version`` (:func:`served_schema`,
    :func:`model_window`); :class:`NoDefault` (one line naming ``flag``) when there are none."""
    try:
        schema, who = served_schema(workdir, version)
        return model_window(schema, who, rows)
    except (NoDefault, DataMismatch, plan_io.PlanError, OSError) as e:
        raise refusal(e, flag) from None
