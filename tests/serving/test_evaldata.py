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


def _read_all(window: evaldata.Window) -> list[int]:
    return _read(window)[0]


def test_the_default_rows_are_the_rows_the_version_never_trained_on(tmp_path: Path) -> None:
    """A batch run's unseen rows: its held-out split (also from a record written before
    ``unseen`` existed); a continuous run's: the next file, from its first row; a record that
    names none, or a continuous export of before (its "held-out" rows were trained), refused."""
    day2, day3 = tmp_path / "day_2.tsv", tmp_path / "day_3.tsv"
    day2.write_text("".join(_rows(100)))
    day3.write_text("".join(_rows(50, 1000)))
    batch = datafile.record([day2], rows=100, skipped_rows=0, eval_fraction=0.1, eval_rows=10)
    window = evaldata.model_window({"data": batch}, "m v1", 0)
    assert _read_all(window) == list(range(90, 100)) and window.start is not None
    assert window.describe().endswith("(unseen by m v1: its held-out split, the last 10 rows "
                                      "(data.eval_fraction 0.1))")  # fmt: skip
    older = {k: v for k, v in batch.items() if k != "unseen"}
    assert _read_all(evaldata.model_window({"data": older}, "m v1", 0)) == list(range(90, 100))
    cont = {**batch, "eval_rows": 0, "trained_files": [{"name": "day_2.tsv", **batch["files"][0]}],
            "unseen": datafile.unseen_entry([day3], 0, 50, "the next file")}  # fmt: skip
    window = evaldata.model_window({"data": cont}, "m v2", 20)
    assert _read_all(window) == list(range(1000, 1020)) and window.start is None
    assert window.describe() == f"rows 1..20 of {day3} (unseen by m v2: the next file)"
    legacy = {"data": older, "training_metrics": {"file_index": 2, "auc": 0.8}}
    with pytest.raises(datafile.DataMismatch, match="held-out rows its record names were trained"):
        evaldata.model_window(legacy, "m v0", 0)
    with pytest.raises(datafile.DataMismatch, match="records no rows it never trained on"):
        evaldata.model_window({"data": {**cont, "unseen": None}}, "m v2", 0)
    day3.write_text("".join(_rows(50, 2000)))  # replaced: not the rows it never saw
    with pytest.raises(
        datafile.DataMismatch, match=r"day_3.tsv is not the file m v2's unseen rows are in"
    ):
        evaldata.model_window({"data": cont}, "m v2", 0)


def test_the_rollout_judges_on_rows_the_candidate_never_saw_and_says_whom_they_are_new_to(
    tmp_path: Path,
) -> None:
    from serving.tools import rollout

    day2, day3, other = (tmp_path / f"{n}.tsv" for n in ("day_2", "day_3", "other"))
    day2.write_text("".join(_rows(100)))
    day3.write_text("".join(_rows(50, 1000)))
    other.write_text("".join(_rows(30, 5000)))
    batch = datafile.record([day2], rows=100, skipped_rows=0, eval_fraction=0.1, eval_rows=10)
    default = {"data": batch}  # a batch run on day 2, held out its last 10 rows
    cand = {"data": {**batch, "eval_rows": 0, "unseen": datafile.unseen_entry([day3], 0, 50, "x"),
                     "trained_files": [{"name": "day_2.tsv", **batch["files"][0]}]}}  # fmt: skip
    models = {"candidate": (cand, "m v2"), "default": (default, "m v1")}
    cfg = rollout.RolloutConfig(version="2", eval_rows=40)
    window = rollout.eval_window(cfg, models["candidate"])  # the default: the candidate's own
    assert (window.paths, window.first, window.count) == ([day3], 0, 40)
    source = evaldata.provenance(window, models)
    assert source["first_row"] == 1 and source["last_row"] == 40 and source["rows"] == 40
    assert source["unseen_by_candidate"] and source["unseen_by_default"], source
    assert rollout.seen_rows(source) is None
    # rows given: the default's held-out rows are new to it, and the candidate trained on them
    given = evaldata.file_window(day2, 0.1, 0)
    source = evaldata.provenance(given, models)
    assert source["unseen_by_default"] is True and source["unseen_by_candidate"] is False
    assert source["candidate_record"] == f"m v2 trained on {day2}"
    why = rollout.seen_rows(source)
    assert why is not None and "would flatter it" in why
    # a file neither record names: new to both; a record that cannot tell: refused
    elsewhere = evaldata.file_window(other, 0, 0)
    assert evaldata.provenance(elsewhere, models)["unseen_by_candidate"]
    legacy = {"data": {**batch, "unseen": None}, "training_metrics": {"file_index": 1}}
    source = evaldata.provenance(elsewhere, {"candidate": (legacy, "m v0")})
    assert source["unseen_by_candidate"] is None and rollout.seen_rows(source)
    assert evaldata.unseen_by({}, given, "m v9") == (
        None,
        "m v9's schema.json records no training data",
    )
