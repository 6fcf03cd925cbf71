"""Tests of training.data: the Criteo reader, synthetic data, binary shards.

``tests/data/criteo_edge_cases.tsv`` (shipped; trainer tests train on it) holds 10 lines,
no trailing newline, 9 well-formed rows and 1 malformed one. The base id list leaves C22 empty.

====  =====  ===============================================================================
line  label  what it exercises
====  =====  ===============================================================================
1     0      typical row: I1..I13 = 1..13, 8-hex lowercase ids
2     1      empty dense fields, I2 = -1, empty C6, C7 and C21..C26
3     0      every dense field empty, ids in reverse order
4     1      I2 = -3, upper-case ``DEADBEEF`` and mixed-case ``AbCdEf01`` ids
5     0      CRLF line ending, last field (C26) empty
6     1      every categorical field empty
7     0      MALFORMED: C7 = ``zz12`` is not hex
8     1      I1 = 1234567, C1 = 7fffffffffffffff (largest int64), C2 = ``0``, C3 = ``1a``
9     0      every int 0
10    1      typical row, no trailing newline
====  =====  ===============================================================================
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from recsys_stack.metrics import roc_auc
from training.data import binary, synthetic
from training.data.binary import ensure_binary, load_binary, preprocess
from training.data.criteo import CriteoChunk, ParseReport, read_criteo, resolve_data_paths
from training.data.synthetic import SyntheticSpec, generate, prob_sidecar
from training.errors import DataError
from training.features import MISSING_ID

EDGE = Path(__file__).resolve().parents[1] / "data" / "criteo_edge_cases.tsv"
IDS = ["68fd1e64", "80e26c9b", "fb936136", "7b4723c4", "25c83c98", "7e0ccccf", "de7995b8"]


def _row(label: str = "0", dense: list[str] | None = None, sparse: list[str] | None = None) -> str:
    dense = [str(i) for i in range(1, 14)] if dense is None else dense
    sparse = (IDS * 4)[:26] if sparse is None else sparse
    return "\t".join([label, *dense, *sparse])


def _replace(row: str, column: int, value: str) -> str:
    fields = row.split("\t")
    fields[column] = value
    return "\t".join(fields)


def _read_all(paths: list[Path], **kw: Any) -> tuple[CriteoChunk, ParseReport]:
    reader = read_criteo(paths, progress=False, **kw)
    chunks = list(reader)
    merged = CriteoChunk(
        np.concatenate([c.labels for c in chunks]),
        np.concatenate([c.dense for c in chunks]),
        np.concatenate([c.sparse for c in chunks]),
        chunks[0].path,
        np.concatenate([c.line_numbers for c in chunks]),
    )
    return merged, reader.report


# ----------------------------------------------------------------------------- criteo reader


def test_edge_case_file() -> None:
    rows, report = _read_all([EDGE])
    assert (report.rows_ok, report.rows_bad) == (9, 1)
    assert report.by_reason == {"sparse": 1}
    assert report.examples == [f"{EDGE}:7: column C7: 'zz12' is not hex"]
    assert rows.line_numbers.tolist() == [1, 2, 3, 4, 5, 6, 8, 9, 10]
    assert rows.labels.tolist() == [0, 1, 0, 1, 0, 1, 1, 0, 1]
    assert rows.labels.dtype == np.int8 and rows.dense.dtype == np.float32
    assert rows.sparse.dtype == np.int64 and rows.sparse.shape == (9, 26)
    assert rows.dense[0].tolist() == list(range(1, 14))
    assert rows.dense[1].tolist() == [0, -1, 0, 7, 0, 0, 3, 0, 0, 0, 0, 0, 2]
    assert (rows.dense[2] == 0).all()
    assert rows.sparse[0, 0] == 0x68FD1E64 and rows.sparse[0, 21] == MISSING_ID
    assert rows.sparse[1, 5] == rows.sparse[1, 6] == MISSING_ID
    assert rows.sparse[3, :2].tolist() == [0xDEADBEEF, 0xABCDEF01] and rows.dense[3, 1] == -3
    assert rows.sparse[4, 25] == MISSING_ID and rows.sparse[4, 24] == 0xE8B83407  # CRLF
    assert (rows.sparse[5] == MISSING_ID).all()
    assert rows.sparse[6, :3].tolist() == [2**63 - 1, 0, 0x1A] and rows.dense[6, 0] == 1234567
    assert rows.sparse[8, 25] == 0x9727DD16  # last line, no newline


def test_malformed_rows_counts_and_messages(tmp_path: Path) -> None:
    good = _row()
    lines = [
        good,
        "\t".join(good.split("\t")[:39]),  # 2: 39 fields
        _replace(good, 20, "zz12"),  # 3: C7
        _replace(good, 3, "1.5"),  # 4: I3
        _replace(good, 0, "2"),  # 5: label
        "",  # 6: empty line in the middle
        _replace(good, 5, "-"),  # 7: lone minus
        _replace(good, 14, "1" * 17),  # 8: 17 hex digits
        _replace(good, 15, "8000000000000000"),  # 9: > int64
        _replace(good, 16, "0x1f"),  # 10
        _replace(good, 1, "--4"),  # 11
        _replace(good, 2, "4-"),  # 12
        _replace(good, 17, "-1f"),  # 13
        _replace(good, 0, ""),  # 14: empty label
        _replace(good, 2, " 5"),  # 15
        good + "\t",  # 16: 41 fields
        _replace(good, 18, "ab\x00"),  # 17: NUL byte
        _replace(good, 1, "-12"),  # 18: fine
        _replace(good, 13, "1" * 19),  # 19: I13 too long
        "",  # empty lines at the end are EOF
        "",
    ]
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join(lines) + "\n")
    rows, report = _read_all([path], max_bad_rows=100)
    assert rows.line_numbers.tolist() == [1, 18]
    assert rows.dense[1, 0] == -12
    assert report.by_reason == {"field count": 3, "sparse": 6, "dense": 6, "label": 2}
    assert report.rows_bad == 17 and report.rows_ok == 2
    assert report.examples[:9] == [
        f"{path}:2: expected 40 tab-separated fields, got 39",
        f"{path}:3: column C7: 'zz12' is not hex",
        f"{path}:4: column I3: '1.5' is not an integer",
        f"{path}:5: column label: '2' is not 0 or 1",
        f"{path}:6: empty line, expected 40 fields",
        f"{path}:7: column I5: '-' is not an integer",
        f"{path}:8: column C1: '11111111111111111' does not fit in int64",
        f"{path}:9: column C2: '8000000000000000' does not fit in int64",
        f"{path}:10: column C3: '0x1f' is not hex",
    ]
    assert f"{path}:16: expected 40 tab-separated fields, got 41" in report.examples
    assert f"{path}:17: column C5: 'ab\\x00' is not hex" in report.examples
    assert f"{path}:19: column I13: '{'1' * 19}' has more than 18 digits" in report.examples
    assert "17 malformed" in report.summary() and report.to_dict()["rows_bad"] == 17


def _reference_parse(line: str) -> tuple[int, list[int], list[int]] | None:
    """Obviously-correct scalar parser the vectorized one must agree with."""
    f = line.split("\t")
    if len(f) != 40 or f[0] not in ("0", "1"):
        return None
    dense = []
    for v in f[1:14]:
        body = v[1:] if v.startswith("-") else v
        if v and not (body and len(body) <= 18 and all(c in "0123456789" for c in body)):
            return None
        dense.append(int(v) if v else 0)
    sparse = []
    for v in f[14:]:
        if v and not (len(v) <= 16 and all(c in "0123456789abcdefABCDEF" for c in v)):
            return None
        if v and int(v, 16) >= 2**63:
            return None
        sparse.append(int(v, 16) if v else MISSING_ID)
    return int(f[0]), dense, sparse


def test_vectorized_parser_agrees_with_reference(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    noise = ["", "-", "x", "1.5", "-7", "7fffffffffffffff", "ffffffffffffffff", "00000000000000000",
             "123456789012345678", "1234567890123456789", "Ab", "1 ", "+1", "9", "--1"]  # fmt: skip
    lines = []
    for _ in range(3000):
        fields = _row().split("\t")
        for _ in range(int(rng.integers(0, 3))):
            fields[int(rng.integers(0, 40))] = noise[int(rng.integers(len(noise)))]
        lines.append("\t".join(fields))
    path = tmp_path / "fuzz.tsv"
    path.write_text("\n".join(lines))
    rows, report = _read_all([path], max_bad_rows=10**6, chunk_rows=700)
    expected = {i + 1: r for i, line in enumerate(lines) if (r := _reference_parse(line))}
    assert rows.line_numbers.tolist() == sorted(expected)
    assert report.rows_bad == len(lines) - len(expected) > 100
    assert "other" not in report.by_reason  # every fast-path reject was explained
    for i, n in enumerate(rows.line_numbers.tolist()):
        label, dense, sparse = expected[n]
        assert (
            rows.labels[i] == label
            and rows.dense[i].tolist() == np.asarray(dense, np.float32).tolist()
        )
        assert rows.sparse[i].tolist() == sparse


def test_on_bad_fail_raises_first_row(tmp_path: Path) -> None:
    path = tmp_path / "x.tsv"
    path.write_text("\n".join([_row(), _replace(_row(), 3, "1.5"), _replace(_row(), 0, "2")]))
    with pytest.raises(DataError, match=rf"^{path}:2: column I3: '1.5' is not an integer"):
        _read_all([path], on_bad="fail")


def test_over_max_bad_rows_raises(tmp_path: Path) -> None:
    path = tmp_path / "x.tsv"
    path.write_text("\n".join([_row()] + [_replace(_row(), 0, "2")] * 3))
    _, report = _read_all([path], max_bad_rows=3)
    assert report.rows_bad == 3
    with pytest.raises(DataError) as err:
        _read_all([path], max_bad_rows=2)
    msg = str(err.value)
    assert "3 malformed rows" in msg and "max_bad_rows=2" in msg
    assert f"{path}:2: column label: '2' is not 0 or 1" in msg


def test_missing_file_and_directory_resolution(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data file not found: .*nope\.tsv"):
        read_criteo([tmp_path / "nope.tsv"])
    with pytest.raises(DataError, match=r"no \*\.tsv or day_<n> files"):
        resolve_data_paths(tmp_path)
    for name in ["day_10", "day_2", "a.tsv", "notes.txt", "a.prob.npy", "day_1.tsv"]:
        (tmp_path / name).write_text(_row() + "\n")
    names = [p.name for p in resolve_data_paths(tmp_path)]
    assert names == ["a.tsv", "day_1.tsv", "day_2", "day_10"]
    assert resolve_data_paths(tmp_path / "day_2") == [tmp_path / "day_2"]
    assert _read_all([tmp_path])[1].rows_ok == 4


def test_chunks_never_span_files(tmp_path: Path) -> None:
    for name in ("a.tsv", "b.tsv"):
        (tmp_path / name).write_text("\n".join([_row()] * 5))
    chunks = list(read_criteo([tmp_path], chunk_rows=3, progress=False))
    assert [(c.path.name, len(c)) for c in chunks] == [
        ("a.tsv", 3),
        ("a.tsv", 2),
        ("b.tsv", 3),
        ("b.tsv", 2),
    ]
    assert chunks[1].line_numbers.tolist() == [4, 5]


# ----------------------------------------------------------------------------- synthetic


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20k default-spec rows."""
    return generate(
        SyntheticSpec(rows=20_000, seed=3), tmp_path_factory.mktemp("syn") / "s.tsv", progress=False
    )


def test_synthetic_deterministic(tmp_path: Path) -> None:
    spec = SyntheticSpec(rows=3000, seed=7, vocab_sizes=[50] * 26)
    a = generate(spec, tmp_path / "a.tsv", chunk_rows=1000, progress=False, processes=1)
    # bytes depend on (spec, chunk_rows), not on the workers writing blocks to files in turn
    b = generate(spec, tmp_path / "b.tsv", chunk_rows=900, progress=False, processes=3)
    assert a.read_bytes() != b.read_bytes()  # other blocks, other rows
    b = generate(spec, tmp_path / "b.tsv", chunk_rows=1000, progress=False, processes=3)
    assert a.read_bytes() == b.read_bytes()
    assert prob_sidecar(a).read_bytes() == prob_sidecar(b).read_bytes()
    c = generate(
        SyntheticSpec(rows=3000, seed=8, vocab_sizes=[50] * 26), tmp_path / "c.tsv", progress=False
    )
    assert a.read_bytes() != c.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a.prob.npy", "a.tsv", "b.prob.npy", "b.tsv", "c.prob.npy", "c.tsv",
    ]  # fmt: skip


def test_synthetic_content(synth: Path) -> None:
    prob = np.load(prob_sidecar(synth))
    rows, report = _read_all([synth])
    assert report.rows_bad == 0 and len(rows.labels) == len(prob) == 20_000
    assert prob.dtype == np.float32
    assert abs(rows.labels.mean() - 0.25) < 0.02 and abs(prob.mean() - 0.25) < 0.01
    assert 0.75 < roc_auc(rows.labels, prob) < 0.88
    assert (rows.dense[:, 1] < 0).any() and (rows.dense[:, [0, *range(2, 13)]] >= 0).all()
    assert 0.01 < (rows.sparse == MISSING_ID).mean() < 0.05
    assert (rows.sparse < 2**32).all()
    lines = synth.read_text().splitlines()
    assert all(len(f) in (0, 8) for f in lines[0].split("\t")[14:])
    _, counts = np.unique(rows.sparse[:, 0][rows.sparse[:, 0] != MISSING_ID], return_counts=True)
    assert counts.max() > 20 * np.median(counts)  # Zipf: the head id dominates


def test_synthetic_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.tsv"
    assert (
        synthetic.main(["--rows", "500", "--out", str(out), "--vocab", "20", "--no-progress"]) == 0
    )
    assert len(out.read_text().splitlines()) == 500 and "rows/s" in capsys.readouterr().out


# ----------------------------------------------------------------------------- binary shards


def test_preprocess_round_trip(tmp_path: Path) -> None:
    meta = preprocess([EDGE], tmp_path / "bin", progress=False)
    rows, report = _read_all([EDGE])
    arrays = load_binary(tmp_path / "bin")
    assert meta.rows == len(arrays) == 9 and not meta.has_prob and arrays.prob is None
    assert meta.report == report
    np.testing.assert_array_equal(arrays.labels, rows.labels)
    np.testing.assert_array_equal(arrays.dense, rows.dense)
    np.testing.assert_array_equal(arrays.sparse, rows.sparse)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_prob_alignment_with_skipped_rows(tmp_path: Path) -> None:
    tsv = generate(SyntheticSpec(rows=400, seed=1), tmp_path / "s.tsv", progress=False)
    prob = np.load(prob_sidecar(tsv))
    lines = tsv.read_text().split("\n")
    lines[9] = _replace(lines[9], 20, "zz12")  # row 10 malformed
    tsv.write_text("\n".join(lines))
    meta = preprocess([tsv], tmp_path / "bin", progress=False, chunk_rows=64)
    arrays = load_binary(tmp_path / "bin")
    assert meta.has_prob and meta.rows == 399 and arrays.prob is not None
    np.testing.assert_array_equal(arrays.prob, np.delete(prob, 9))


def test_prob_dropped_when_sidecar_length_differs(tmp_path: Path) -> None:
    tsv = generate(SyntheticSpec(rows=100, seed=1), tmp_path / "s.tsv", progress=False)
    np.save(prob_sidecar(tsv), np.zeros(99, np.float32))
    assert not preprocess([tsv], tmp_path / "bin", progress=False).has_prob
    assert not (tmp_path / "bin" / "prob.npy").exists()


def test_load_binary_rejects_corruption(tmp_path: Path) -> None:
    preprocess([EDGE], tmp_path / "bin", progress=False)
    sparse = tmp_path / "bin" / "sparse.npy"
    sparse.write_bytes(sparse.read_bytes()[:-8])
    for mmap in (True, False):
        with pytest.raises(DataError, match=r"sparse\.npy: corrupt or truncated"):
            load_binary(tmp_path / "bin", mmap=mmap)
    np.save(sparse, np.zeros((9, 25), np.int64))
    with pytest.raises(DataError, match=r"sparse\.npy: expected int64\[9, 26\]"):
        load_binary(tmp_path / "bin")
    with pytest.raises(DataError, match=r"meta\.json: missing"):
        load_binary(tmp_path)


def test_ensure_binary_reuses_and_invalidates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    tsv = data / "edge.tsv"
    tsv.write_bytes(EDGE.read_bytes())
    cache = tmp_path / "cache"
    out, meta = ensure_binary([data], cache, progress=False)
    assert meta.rows == 9
    calls: list[int] = []
    real = binary.preprocess

    def counting(*args: Any, **kwargs: Any) -> binary.BinaryMeta:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(binary, "preprocess", counting)
    stamp = (out / "meta.json").stat().st_mtime_ns
    assert ensure_binary([tsv], cache, progress=False)[0] == out
    assert calls == [] and (out / "meta.json").stat().st_mtime_ns == stamp
    with pytest.raises(DataError, match=r"edge\.tsv:7: column C7"):
        ensure_binary([tsv], cache, on_bad="fail")
    with pytest.raises(DataError, match="max_bad_rows=0"):
        ensure_binary([tsv], cache, max_bad_rows=0)
    tsv.write_text(_row() + "\n")
    os.utime(tsv, ns=(1, 1))
    out2, meta2 = ensure_binary([tsv], cache, progress=False)
    assert out2 != out and meta2.rows == 1 and calls == [1]
    (out2 / "labels.npy").write_bytes(b"junk")  # a corrupt cache is rebuilt
    assert ensure_binary([tsv], cache, progress=False)[1].rows == 1 and calls == [1, 1]
    assert load_binary(out2).labels.tolist() == [0]


def test_preprocess_removes_stale_temp_dir(tmp_path: Path) -> None:
    stale = tmp_path / ".bin.tmp-999999"
    stale.mkdir()
    (stale / "labels.bin").write_bytes(b"x")
    preprocess([EDGE], tmp_path / "bin", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]


def test_binary_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert binary.main([str(EDGE), "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    assert "9 rows ok, 1 malformed (sparse: 1)" in capsys.readouterr().out
    assert binary.main([str(EDGE), "--out", str(tmp_path / "c"), "--on-bad", "fail"]) == 2
    assert "column C7: 'zz12' is not hex" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
