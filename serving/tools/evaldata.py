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
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recsys_stack.datafile import DataMismatch, check, heldout, shown
from serving.gateway import plan as plan_io
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


def lines(paths: Sequence[Path]) -> Iterator[str]:
    """The non-empty lines of ``paths``, one file after the other."""
    for path in paths:
        with path.open() as f:
            yield from (line for line in f if line.strip())


def window_lines(window: Window) -> Iterator[str]:
    """The lines of ``window``."""
    if window.start is None:
        return itertools.islice(lines(window.paths), window.first, window.first + window.count)
    index, offset = window.start

    def tail() -> Iterator[str]:
        for i, path in enumerate(window.paths[index:]):
            with path.open("rb") as f:
                f.seek(offset if i == 0 else 0)
                yield from (b.decode() for b in f if b.strip())

    return itertools.islice(tail(), window.count)


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
            total += sum(1 for line in f if line.strip())
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
