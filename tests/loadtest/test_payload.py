"""The load generator's working set and request pool, in-process: drawn across the whole file,
seeded, stated."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loadtest.payload import RUN_ROWS, request_pool, sample_lines, working_set


def _tsv(path: Path, rows: int) -> Path:
    """Row i: label i % 2, dense I1 = i, every C field the hex of i: row i's ids are its own
    (26 distinct (feature, id) pairs per row) and I1 names the row. Fixed-width fields: every
    line the same length, so a byte offset names a row."""
    with path.open("w") as f:
        for i in range(rows):
            f.write("\t".join([str(i % 2), f"{i:06d}", *["7"] * 12, *[f"{i:06x}"] * 26]) + "\n")
    return path


def test_a_small_file_is_the_whole_working_set(tmp_path: Path) -> None:
    ws = working_set(_tsv(tmp_path / "small.tsv", 300), rows=300)
    assert ws.info["sampled"] is False and ws.info["rows"] == ws.info["file_rows"] == 300
    assert ws.info["distinct_ids"] == 300 * 26
    assert ws.dense[:, 0].tolist() == list(range(300))


def test_a_large_file_is_sampled_across_all_of_it(tmp_path: Path) -> None:
    # 20,000 rows, a working set of 512: 8 runs of 64 consecutive rows, one per eighth of the
    # file. The first 20,000 rows (what the load test used to read) would be rows 0..511.
    path = _tsv(tmp_path / "large.tsv", 20_000)
    ws = working_set(path, rows=512, seed=3)
    ids = ws.dense[:, 0].astype(int)
    assert ws.info["sampled"] is True and ws.info["seed"] == 3
    assert ws.info["rows"] == len(ids) == len(set(ids.tolist())) == 512  # no overlap here
    eighths = np.bincount(ids * 8 // 20_000, minlength=8)
    assert eighths.tolist() == [RUN_ROWS] * 8, eighths  # every part of the file, evenly
    assert ws.info["distinct_ids"] == 512 * 26
    assert abs(ws.info["file_rows_est"] - 20_000) < 2_000  # from the sample's line length
    # the same seed the same rows (every load process builds the same set); another, others
    assert working_set(path, rows=512, seed=3).dense[:, 0].tolist() == ids.tolist()
    assert working_set(path, rows=512, seed=4).dense[:, 0].tolist() != ids.tolist()
    # a sample bigger than its file's slices would hold: overlapping runs count once
    lines, sampled = sample_lines(_tsv(tmp_path / "mid.tsv", 600), rows=590)
    assert sampled and len({off for off, _ in lines}) == len(lines) <= 590


def test_the_pool_deals_every_row_and_none_twice_in_a_request(tmp_path: Path) -> None:
    ws = working_set(_tsv(tmp_path / "w.tsv", 1000), rows=1000)
    pool = request_pool(ws, examples=30, size=8, seed=1)
    assert len(pool) == 34  # ceil(1000 / 30): enough requests for every row to be in one
    rows = [[int(x) for x in r.dense[0::13]] for r in pool]  # I1 of each example
    assert all(len(set(r)) == len(r) == 30 for r in rows)
    assert set().union(*map(set, rows)) == set(range(1000))
    assert len(request_pool(ws, examples=30, size=100)) == 100
    with pytest.raises(ValueError, match="fewer than --examples 2000"):
        request_pool(ws, examples=2000)


def test_a_bad_row_is_named_by_its_byte_offset(tmp_path: Path) -> None:
    path = _tsv(tmp_path / "bad.tsv", 5000)
    text = path.read_bytes()
    at = text.index(b"\n", len(text) // 2) + 1  # the first row after the middle
    path.write_bytes(text[:at] + b"x" + text[at + 1 :])  # its label: not 0 or 1
    with pytest.raises(ValueError, match=rf"bad.tsv: the row at byte {at:,}: column label"):
        working_set(path, rows=5000)
