"""The data record and its check (recsys_stack/datafile.py), and finding the held-out rows from
the end of the files (serving/tools/evaldata.py), on small files written here. The tools using
them against a real stack: tests/serving/test_defaults.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from recsys_stack import datafile
from serving.tools import client, evaldata, evaluate


def _rows(n: int, start: int = 0) -> list[str]:
    """Well-formed rows: label, I1 = i, the other 38 fields empty."""
    return [f"{i % 2}\t{i}" + "\t" * 38 + "\n" for i in range(start, start + n)]


def _read(window: evaldata.Window) -> tuple[list[int], list[tuple[int, int]]]:
    """The I1 (= row number) of each row read from ``window``, 7 at a time, and its
    ``(file index, line)``."""
    values, where = [], []
    for path, rows in evaldata.window_rows(window, 7):
        values += rows.dense[:, 0].astype(int).tolist()
        where += [(window.paths.index(path), n) for n in rows.lines.tolist()]
    return values, where


def test_a_changed_file_is_told_apart_and_a_copy_is_not(tmp_path: Path) -> None:
    big = tmp_path / "big.tsv"  # over 2 MiB: both ends hashed, the middle not
    big.write_text("".join(_rows(60_000)))
    rec = datafile.record([big], rows=60_000, skipped_rows=0, eval_fraction=0.1, eval_rows=6000)
    assert datafile.check(rec, "m v1") == [big.resolve()]
    assert datafile.heldout(rec) == (54_000, 6000)
    os.utime(big, (1, 1))  # another mtime, same bytes: the same data
    assert datafile.check(rec, "m v1")
    text = big.read_text()
    big.write_text(text[:-3] + "x\t\n")  # the last row changed, same size
    with pytest.raises(datafile.DataMismatch, match=r"big.tsv is not the file m v1 was trained on"):
        datafile.check(rec, "m v1")
    big.unlink()
    with pytest.raises(
        datafile.DataMismatch, match=r"m v1 was trained on .*big.tsv, which is missing"
    ):
        datafile.check(rec, "m v1")
    with pytest.raises(datafile.DataMismatch, match="records no training data"):
        datafile.check(None, "m v1")
    assert datafile.heldout({**rec, "skipped_rows": 2}) == (None, 6000)


def test_the_held_out_rows_are_found_from_the_end_across_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(evaldata, "CHUNK", 64)  # many chunks, newlines at their edges
    rows = _rows(300)
    paths = []
    for i, (lo, hi) in enumerate([(0, 120), (120, 123), (123, 300)]):
        p = tmp_path / f"day_{i}"
        p.write_text("".join(rows[lo:hi]) + ("\n\n" if i == 1 else ""))  # trailing empties
        paths.append(p)
    at = [(i, n) for i, size in enumerate([120, 3, 177]) for n in range(1, size + 1)]
    for count in (1, 177, 178, 180, 181, 300):
        walked = evaldata.Window(paths, 300 - count, count)
        sought = evaldata.Window(paths, 300 - count, count, start=evaldata.tail_start(paths, count))
        assert _read(sought)[0] == _read(walked)[0] == list(range(300 - count, 300))
        assert _read(walked)[1] == at[300 - count :]  # walked: each row at its file's line
    rec = datafile.record(paths, rows=300, skipped_rows=0, eval_fraction=0.1, eval_rows=30)
    window = evaldata.model_window({"data": rec}, "m v1", rows=5)
    assert (window.first, window.count) == (270, 5)
    assert _read(window)[0] == list(range(270, 275))
    assert window.describe().startswith("rows 271..275 of ")


def test_rows_read_from_the_end_are_named_by_their_own_file_and_line(tmp_path: Path) -> None:
    # The held-out rows are found from the end of the files (no walk through the rows before
    # them), yet a malformed one is named by its file's own line number, as the trainer does.
    rows = _rows(300)
    rows[290] = "2" + rows[290][1:]  # day_1's line 291 - 123 = 168
    paths = [tmp_path / "day_0", tmp_path / "day_1"]
    paths[0].write_text("".join(rows[:123]))
    paths[1].write_text("".join(rows[123:]))
    rec = datafile.record(paths, rows=300, skipped_rows=0, eval_fraction=0.1, eval_rows=30)
    window = evaldata.model_window({"data": rec}, "m v1", rows=0)
    assert window.start is not None  # sought, not walked
    with pytest.raises(ValueError, match=rf"^{paths[1]}:168: column label: '2' is not 0 or 1$"):
        list(evaluate.batches(window, 7))
    with pytest.raises(ValueError, match=rf"^{paths[1]}:168: column label"):
        client.read_rows(window)
