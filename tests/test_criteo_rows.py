"""One set of Criteo row rules: the trainer's numpy reader (training/data/criteo.py) and the
serving tools' reader (recsys_stack/criteo_rows.py ``scan_rows``) fed the same rows agree on
every value and on every error message, word for word and line for line."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from recsys_stack import criteo_rows
from recsys_stack.criteo_rows import ParsedRows, RowError, scan_rows
from training import features
from training.data.criteo import read_criteo

EDGE = Path(__file__).resolve().parent / "data" / "criteo_edge_cases.tsv"
GOOD = "\t".join(["0", *map(str, range(1, 14)), *[f"{i:x}" for i in range(100, 126)]])


def _set(column: int, value: str, row: str = GOOD) -> str:
    fields = row.split("\t")
    fields[column] = value
    return "\t".join(fields)


MALFORMED = [  # at most 20: the trainer's report keeps the first 20 messages
    "\t".join(GOOD.split("\t")[:39]),  # 39 fields
    _set(20, "zz12"),
    _set(3, "1.5"),
    _set(0, "2"),
    "",  # empty line in the middle
    _set(5, "-"),
    _set(14, "1" * 17),
    _set(15, "8000000000000000"),
    _set(16, "0x1f"),
    _set(1, "--4"),
    _set(17, "-1f"),
    _set(0, ""),  # empty label
    _set(2, " 5"),
    _set(2, "+5"),
    _set(2, "1_000"),
    _set(18, "1_f"),
    GOOD + "\t",  # 41 fields
    _set(18, "ab\x00"),
    _set(13, "1" * 19),
    "   ",  # spaces are not an empty line
]
WELL_FORMED = [
    GOOD,
    _set(1, "-12"),
    _set(14, "7fffffffffffffff", _set(15, "0")),
    _set(14, "DEADBEEF", _set(15, "AbCdEf01")),
    _set(13, "9" * 18),
    "\t".join(["1"] + [""] * 39),  # every feature missing
    GOOD + "\r",
]


def _trainer(path: Path) -> tuple[ParsedRows, list[str]]:
    reader = read_criteo([path], progress=False, max_bad_rows=1000)
    chunks = list(reader)
    rows = ParsedRows(
        np.concatenate([c.labels for c in chunks]),
        np.concatenate([c.dense for c in chunks]),
        np.concatenate([c.sparse for c in chunks]),
        np.concatenate([c.line_numbers for c in chunks]),
    )
    return rows, reader.report.examples


def _tools(data: bytes, source: str, first_line: int = 1, batch: int = 3) -> ParsedRows:
    return ParsedRows.concat(
        list(scan_rows(io.BytesIO(data), source, batch, first_line=first_line))
    )


def _same(a: ParsedRows, b: ParsedRows) -> None:
    for name in ("labels", "dense", "sparse", "lines"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name


def test_both_readers_take_the_same_values_and_name_the_same_errors(tmp_path: Path) -> None:
    # good and bad rows interleaved, empty lines at the end (the end of the file)
    lines = [x for pair in zip(WELL_FORMED * 3, MALFORMED, strict=False) for x in pair]
    path = tmp_path / "mixed.tsv"
    path.write_text("\n".join(lines) + "\n\n\n")
    data = path.read_bytes().splitlines(keepends=True)
    rows, messages = _trainer(path)
    assert len(messages) == len(MALFORMED) and len(rows) == len(MALFORMED)
    # the tools stop at the first malformed row: read from each one on, it is the error
    for message in messages:
        line = int(message.split(":")[1])
        with pytest.raises(RowError) as err:
            _tools(b"".join(data[line - 1 :]), str(path), first_line=line)
        assert str(err.value) == message
    # and the well-formed rows, each read alone at its line, are the trainer's values
    for i, line in enumerate(rows.lines.tolist()):
        got = _tools(data[line - 1], str(path), first_line=line)
        _same(got, ParsedRows(rows.labels[i : i + 1], rows.dense[i : i + 1],
                              rows.sparse[i : i + 1], rows.lines[i : i + 1]))  # fmt: skip


def test_the_shipped_edge_cases_read_alike(tmp_path: Path) -> None:
    rows, messages = _trainer(EDGE)
    assert messages == [f"{EDGE}:7: column C7: 'zz12' is not hex"]
    data = EDGE.read_bytes().splitlines(keepends=True)
    with pytest.raises(RowError, match=f"^{EDGE}:7: column C7: 'zz12' is not hex$"):
        _tools(b"".join(data), str(EDGE))
    head, tail = _tools(b"".join(data[:6]), str(EDGE)), _tools(b"".join(data[7:]), str(EDGE), 8)
    _same(ParsedRows.concat([head, tail]), rows)


def test_the_layout_is_the_trainers() -> None:
    assert criteo_rows.DENSE_NAMES == features.DENSE_NAMES
    assert criteo_rows.SPARSE_NAMES == features.SPARSE_NAMES
    assert criteo_rows.MISSING_ID == features.MISSING_ID


def test_rows_without_a_label_are_judged_by_the_first(tmp_path: Path) -> None:
    unlabelled = GOOD.split("\t", 1)[1]
    (rows,) = scan_rows(io.BytesIO(f"{unlabelled}\n{unlabelled}\n".encode()), "u", 10,
                        labelled=None)  # fmt: skip
    assert rows.labels is None and rows.dense.shape == (2, 13) and rows.lines.tolist() == [1, 2]
    mixed = io.BytesIO(f"{unlabelled}\n{GOOD}\n".encode())
    with pytest.raises(RowError, match=r"^u:2: expected 39 tab-separated fields, got 40$"):
        list(scan_rows(mixed, "u", 10, labelled=None))
