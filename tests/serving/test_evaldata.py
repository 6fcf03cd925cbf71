"""The data record and its check (recsys_stack/datafile.py), and finding the held-out rows from
the end of the files (serving/tools/evaldata.py), on small files written here. The tools using
them against a real stack: tests/serving/test_defaults.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from recsys_stack import datafile
from serving.tools import evaldata


def _rows(n: int, start: int = 0) -> list[str]:
    return [f"{i % 2}\t{i}" + "\t" * 37 + "\n" for i in range(start, start + n)]


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
    for count in (1, 177, 178, 180, 181, 300):
        walked = evaldata.Window(paths, 300 - count, count)
        sought = evaldata.Window(paths, 300 - count, count, start=evaldata.tail_start(paths, count))
        assert list(evaldata.window_lines(sought)) == list(evaldata.window_lines(walked))
        assert list(evaldata.window_lines(walked)) == rows[300 - count :]
    rec = datafile.record(paths, rows=300, skipped_rows=0, eval_fraction=0.1, eval_rows=30)
    window = evaldata.model_window({"data": rec}, "m v1", rows=5)
    assert (window.first, window.count) == (270, 5)
    assert list(evaldata.window_lines(window)) == rows[270:275]
    assert window.describe().startswith("rows 271..275 of ")
