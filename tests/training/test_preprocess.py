"""Tests of the parallel, resumable, compact binary cache (training.data.build / parts / layout).

Tiny inputs cut into parts of a few hundred bytes, so a few thousand rows make dozens of parts
spread over 2-3 worker processes: the cache must be the very bytes one process writes, name
malformed rows with the line numbers a single pass gives, resume after a worker is killed, and
be keyed by the table sizes and the id hash.
"""

from __future__ import annotations

import fcntl
import json
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from training.config import DataConfig
from training.data import binary, build, layout
from training.data.binary import ensure_binary, load_binary, preprocess
from training.data.criteo import CriteoReader
from training.data.loader import Arrays, make_batch
from training.data.parts import Job, Part, parse_part
from training.data.prep import prepare_data
from training.data.synthetic import SyntheticSpec, generate
from training.errors import DataError
from training.features import MISSING_ID, NUM_SPARSE

ROOT = Path(__file__).resolve().parents[2]
SMALL = 3000  # part size in bytes: about 12 rows
TABLES = [3 + 11 * i for i in range(NUM_SPARSE)]  # 3 .. 278 rows: int16 ids
BAD_LINES = [40, 333, 777, 1203]  # a.tsv lines made malformed


def _files(tmp_path: Path) -> list[Path]:
    """a.tsv: 1500 lines: malformed rows spread out, a CRLF line, 3 empty lines mid-file
    (malformed), 5 empty lines at the end (EOF). b.tsv: 4600 lines, 4000 of them empty in a run
    (several whole parts), no final newline. Sidecars line up (the lines replace rows)."""
    a = generate(SyntheticSpec(rows=1500, seed=5), tmp_path / "a.tsv", progress=False)
    b = generate(SyntheticSpec(rows=4600, seed=6), tmp_path / "b.tsv", progress=False)
    lines = a.read_text().split("\n")[:-1]
    for n in BAD_LINES:
        fields = lines[n - 1].split("\t")
        fields[20] = "zz12"  # C7
        lines[n - 1] = "\t".join(fields)
    lines[99] += "\r"
    lines[500:503] = ["", "", ""]  # lines 501-503
    a.write_text("\n".join(lines) + "\n" + "\n" * 5)
    lines = b.read_text().split("\n")[:-1]
    lines[300:4300] = [""] * 4000  # lines 301-4300
    b.write_text("\n".join(lines))
    return [a, b]


def _tree(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("tables", [None, TABLES])
def test_parallel_cache_is_byte_identical_to_one_process(
    tmp_path: Path, tables: list[int] | None
) -> None:
    files = _files(tmp_path)
    kw: dict[str, Any] = {"progress": False, "max_bad_rows": 10_000, "rows_per_table": tables}
    one = preprocess(files, tmp_path / "one", processes=1, part_bytes=1 << 30, **kw)
    many = preprocess(files, tmp_path / "many", processes=3, part_bytes=SMALL, chunk_rows=2, **kw)
    assert _tree(tmp_path / "one") == _tree(tmp_path / "many")
    parts = build.plan_parts(files, SMALL)
    assert len(parts) > 50 and any(p.end - p.start == SMALL for p in parts)  # all empty
    # and both are what the single-pass reader reads, hashed with the one hash
    reader = CriteoReader(files, max_bad_rows=10_000, progress=False)
    chunks = list(reader)
    assert one.report == many.report == reader.report
    arrays = load_binary(tmp_path / "many")
    raw = np.concatenate([c.sparse for c in chunks])
    if tables is None:
        assert arrays.sparse.dtype == np.int64
        np.testing.assert_array_equal(arrays.sparse, raw)
    else:
        assert arrays.sparse.dtype == np.int16 and arrays.meta.bytes_per_row() == 1 + 52 + 52 + 4
        expected = np.where(raw < 0, MISSING_ID, raw % np.asarray(TABLES))
        np.testing.assert_array_equal(arrays.sparse, expected)
    np.testing.assert_array_equal(arrays.dense, np.concatenate([c.dense for c in chunks]))
    assert arrays.prob is not None and len(arrays.prob) == len(arrays) == 1500 - 4 - 3 + 600
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_shares_then_merge_is_one_process_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job array's way (deploy/slurm/prepare.sbatch): each share parses its parts and stops,
    then one preprocess only merges (it parses nothing): the bytes of one process's cache. A
    share never raises the malformed-row policy; the merge does, in the single pass's words."""
    files = _files(tmp_path)
    kw: dict[str, Any] = {"progress": False, "max_bad_rows": 10_000, "rows_per_table": TABLES}
    preprocess(files, tmp_path / "one", processes=1, part_bytes=1 << 30, **kw)
    counts = [
        build.preprocess_share(files, tmp_path / "shared", i, 3, part_bytes=SMALL, **kw)
        for i in range(3)
    ]
    total = len(build.plan_parts(files, SMALL))
    assert sum(n for n, _ in counts) == total and {t for _, t in counts} == {total}
    assert all(n >= total // 3 for n, _ in counts)  # round-robin: even shares

    def no_parsing(job: Job, part: Part) -> dict[str, Any]:
        raise AssertionError(f"part {part} parsed again")

    with monkeypatch.context() as m:
        m.setattr(build, "parse_part", no_parsing)
        preprocess(files, tmp_path / "shared", processes=1, part_bytes=SMALL, **kw)
    assert _tree(tmp_path / "one") == _tree(tmp_path / "shared")
    strict = {**kw, "max_bad_rows": 5}
    for i in range(2):
        build.preprocess_share(files, tmp_path / "strict", i, 2, part_bytes=SMALL, **strict)
    with pytest.raises(DataError) as e:
        preprocess(files, tmp_path / "strict", processes=1, part_bytes=SMALL, **strict)
    assert str(e.value).startswith("6 malformed rows, more than max_bad_rows=5")
    with pytest.raises(ValueError, match="share 3 of 3"):
        build.preprocess_share(files, tmp_path / "x", 3, 3, **kw)


def test_malformed_rows_named_by_file_line_from_any_worker(tmp_path: Path) -> None:
    files = _files(tmp_path)
    meta = preprocess(
        files, tmp_path / "c", processes=2, part_bytes=SMALL, progress=False, max_bad_rows=4007
    )
    a, b = files
    expected = [f"{a}:{n}: column C7: 'zz12' is not hex" for n in BAD_LINES]
    expected[2:2] = [f"{a}:{n}: empty line, expected 40 fields" for n in (501, 502, 503)]
    empty = [f"{b}:{n}: empty line, expected 40 fields" for n in range(301, 4301)]
    report = meta.report
    assert report.examples == (expected + empty)[:20]
    assert report.rows_bad == 4 + 3 + 4000
    assert report.by_reason == {"sparse": 4, "field count": 4003}

    def single(**kw: Any) -> str:
        with pytest.raises(DataError) as e:
            list(CriteoReader(files, progress=False, **kw))
        return str(e.value)

    for kw in ({"on_bad": "fail"}, {"max_bad_rows": 5}, {"max_bad_rows": 100}):
        with pytest.raises(DataError) as e:
            preprocess(files, tmp_path / "d", processes=2, part_bytes=SMALL, progress=False, **kw)
        assert str(e.value) == single(**kw)
    assert "a.tsv:40: column C7: 'zz12' is not hex" in single(on_bad="fail")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


_KILL_PART = -1  # a part whose worker kills itself (module level: the pool pickles by name)


def _dying_parse_part(job: Job, part: Part) -> dict[str, Any]:
    if part.index == _KILL_PART:
        os.kill(os.getpid(), signal.SIGKILL)
    return parse_part(job, part)


def test_killed_preprocessing_resumes_with_finished_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _files(tmp_path)
    kw: dict[str, Any] = {"progress": False, "max_bad_rows": 10_000, "rows_per_table": TABLES}
    preprocess(files, tmp_path / "clean", processes=1, part_bytes=SMALL, **kw)
    parts = build.plan_parts(files, SMALL)
    monkeypatch.setattr(build, "parse_part", _dying_parse_part)
    monkeypatch.setattr(sys.modules[__name__], "_KILL_PART", len(parts) // 2)
    out = tmp_path / "cache"
    before = set(mp.active_children())
    with pytest.raises(DataError, match=r"worker died .* run again to resume"):
        preprocess(files, out, processes=2, part_bytes=SMALL, **kw)
    # No worker of the failed run is left to finish a part after the error is out (seen at
    # load: the resumed run below found 2 more parts done than were on disk a moment before).
    assert set(mp.active_children()) <= before
    work = tmp_path / ".cache.parts"
    finished = len(list(work.glob("*/done.json")))
    assert 0 < finished < len(parts) and not out.exists()
    parsed: list[int] = []

    def counting(job: Job, part: Part) -> dict[str, Any]:
        parsed.append(part.index)
        return parse_part(job, part)

    monkeypatch.setattr(build, "parse_part", counting)
    preprocess(files, out, processes=1, part_bytes=SMALL, **kw)
    assert len(parsed) == len(parts) - finished
    assert _tree(out) == _tree(tmp_path / "clean") and not work.exists()


_SLOW_RUN = """
import os, sys, time
from pathlib import Path
from training.data import build, parts

def slow(job, part):
    with open(sys.argv[2], "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(0.05)
    return parts.parse_part(job, part)

build.parse_part = slow
files = [Path(p) for p in sys.argv[4:]]
build.preprocess(files, Path(sys.argv[1]), processes=2, part_bytes=int(sys.argv[3]), max_bad_rows=10000)
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="workers die with their parent on Linux")
def test_killed_parent_leaves_no_workers_nor_lock_and_resumes(tmp_path: Path) -> None:
    files = _files(tmp_path)
    out, pids, work = tmp_path / "cache", tmp_path / "pids", tmp_path / ".cache.parts"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", _SLOW_RUN, str(out), str(pids), str(SMALL), *map(str, files)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list(work.glob("*/done.json"))) < 10:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    workers = {int(pid) for pid in pids.read_text().split()}
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, f"orphaned workers {workers}"
        time.sleep(0.05)
    lock = tmp_path / ".cache.lock"
    with lock.open("a") as f:  # the killed parent's lock file is left, but nobody holds it
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    done = len(list(work.glob("*/done.json")))
    meta = preprocess(
        files, out, processes=2, part_bytes=SMALL, progress=False, max_bad_rows=10_000
    )
    assert done >= 10 and meta.rows == 1500 - 4 - 3 + 600
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("change", ["truncate", "vanish"])
def test_input_changed_during_preprocessing_is_one_error_and_no_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    files = _files(tmp_path)
    real = build.plan_parts

    def plan_then_change(paths: list[Path], part_bytes: int) -> list[Part]:
        parts = real(paths, part_bytes)
        if change == "truncate":
            os.truncate(paths[0], paths[0].stat().st_size // 2)
        else:
            paths[1].unlink()
        return parts

    monkeypatch.setattr(build, "plan_parts", plan_then_change)
    with pytest.raises(DataError) as e:
        preprocess(files, tmp_path / "c", processes=2, part_bytes=SMALL, progress=False)
    path, what = (files[0], "truncated") if change == "truncate" else (files[1], "vanished")
    assert str(e.value).startswith(f"{path}: {what} during preprocessing")
    assert "nothing was cached" in str(e.value) and "\n" not in str(e.value)
    assert not [p for p in tmp_path.iterdir() if p.name in ("c",) or p.name.startswith(".")]


def test_cache_keyed_by_table_sizes_and_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tsv,) = _files(tmp_path)[:1]
    cache = tmp_path / "cache"
    kw: dict[str, Any] = {"progress": False, "max_bad_rows": 100}
    out_a, meta_a = ensure_binary([tsv], cache, rows_per_table=TABLES, **kw)
    out_b, meta_b = ensure_binary([tsv], cache, rows_per_table=[*TABLES[:-1], 99_999], **kw)
    assert out_a != out_b and meta_b.rows_per_table == [*TABLES[:-1], 99_999]
    assert load_binary(out_b).sparse.dtype == np.int32 and meta_a.dtypes["sparse"] == "int16"
    out_raw, meta_raw = ensure_binary([tsv], cache, **kw)
    assert out_raw not in (out_a, out_b) and meta_raw.rows_per_table is None
    calls: list[int] = []
    monkeypatch.setattr(binary, "preprocess", lambda *a, **k: calls.append(1))
    assert ensure_binary([tsv], cache, rows_per_table=TABLES, **kw)[0] == out_a and calls == []
    for module in (layout, build):  # the key's and the meta's
        monkeypatch.setattr(module, "id_hash_tag", lambda: "mod-another-hash")
    monkeypatch.setattr(binary, "preprocess", build.preprocess)
    out_c, meta_c = ensure_binary([tsv], cache, rows_per_table=TABLES, **kw)
    assert out_c not in (out_a, out_b, out_raw) and meta_c.id_hash == "mod-another-hash"


def test_old_format_cache_is_rebuilt_with_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tsv,) = _files(tmp_path)[:1]
    cache = tmp_path / "cache"
    kw: dict[str, Any] = {"progress": False, "max_bad_rows": 100, "rows_per_table": TABLES}
    inputs = build.fingerprint([tsv])
    legacy = cache / f"criteo-{layout.legacy_key(inputs)[:16]}"  # where format 1 kept it
    legacy.mkdir(parents=True)
    np.save(legacy / "sparse.npy", np.zeros((3, NUM_SPARSE), np.int64))
    meta_v1 = {"rows": 3, "inputs": inputs, "parse_report": {}, "has_prob": False}
    (legacy / "meta.json").write_text(json.dumps({**meta_v1, "format_version": 1}))
    with caplog.at_level(logging.INFO, logger="training.data"):
        out, meta = ensure_binary([tsv], cache, **kw)
    lines = [r.getMessage() for r in caplog.records if "format-1" in r.getMessage()]
    assert lines == [f"replacing the format-1 cache {legacy} (raw int64 ids) with {out}"]
    assert not legacy.exists() and meta.rows == 1500 - 4 - 3
    # an older format at the same key: never read, rebuilt in place with one line
    meta_path = out / "meta.json"
    meta_path.write_text(
        meta_path.read_text().replace('"format_version": 2', '"format_version": 1')
    )
    with pytest.raises(DataError, match="cache format 1, this code reads 2"):
        load_binary(out)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="training.data"):
        assert ensure_binary([tsv], cache, **kw)[0] == out
    rebuilt = [r.getMessage() for r in caplog.records if "cache format 1" in r.getMessage()]
    assert rebuilt == [f"rebuilding {out}: cache format 1, this code writes 2"]
    assert load_binary(out).meta.format_version == 2


def test_prepare_data_hashes_once_at_preprocessing(tmp_path: Path) -> None:
    cfg = DataConfig(
        synthetic_rows=2000,
        synthetic_vocab=5000,
        cache_dir=str(tmp_path / "cache"),
        synthetic_dir=str(tmp_path / "syn"),
        preprocess_processes=2,
    )
    s = prepare_data(cfg, rank=0, progress=False, rows_per_table=TABLES)
    train, info = s.train, s.info
    s = prepare_data(cfg, rank=0, progress=False)
    raw, info_raw = s.train, s.info
    assert info["binary"] != info_raw["binary"] and train.hashed_for == tuple(TABLES)
    assert train.sparse.dtype == np.int16 and raw.hashed_for is None
    assert int(np.asarray(raw.sparse).max()) > max(TABLES)  # raw ids: bigger than the tables
    idx = np.arange(0, 1000, 7)
    hashed = make_batch(train, idx, np.asarray(TABLES)).batch.sparse_features
    direct = make_batch(raw, idx, np.asarray(TABLES)).batch.sparse_features
    assert hashed.values().tolist() == direct.values().tolist()
    assert hashed.lengths().tolist() == direct.lengths().tolist()
    with pytest.raises(ValueError, match="hashed for tables of"):
        make_batch(train, idx, np.asarray([*TABLES[:-1], 7]))
    assert isinstance(train.rows(0, 5), Arrays) and train.rows(0, 5).hashed_for == tuple(TABLES)


def test_same_size_new_content_with_the_mtime_kept_is_preprocessed_again(tmp_path: Path) -> None:
    """``cp -p``, ``rsync -t`` or ``tar x`` put new bytes in with the old size and mtime: the
    cache is keyed on the content (recsys_stack.datafile's fingerprint), so the next prepare
    builds a new cache and trains on the new rows."""
    tsv = generate(SyntheticSpec(rows=600, seed=7), tmp_path / "clicks.tsv", progress=False)
    tsv.with_suffix(".prob.npy").unlink()  # rewritten rows: the old probabilities are wrong
    cfg = DataConfig(path=str(tsv), cache_dir=str(tmp_path / "cache"), preprocess_processes=1)
    s = prepare_data(cfg, rank=0, progress=False)
    train, info = s.train, s.info
    labels = np.asarray(train.labels).copy()
    st = tsv.stat()
    flipped = [("1" if line[0] == "0" else "0") + line[1:] for line in tsv.read_text().split("\n")
               if line]  # fmt: skip
    tsv.write_text("\n".join(flipped) + "\n")  # the same size: one label character a row
    os.utime(tsv, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (tsv.stat().st_size, tsv.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    s = prepare_data(cfg, rank=0, progress=False)
    again, info_again = s.train, s.info
    assert info_again["binary"] != info["binary"]  # a cache of its own, the old one left
    assert np.array_equal(np.asarray(again.labels), 1 - labels)  # the new rows, not the cache
    info_same = prepare_data(cfg, rank=0, progress=False).info  # reused while unchanged
    assert info_same["binary"] == info_again["binary"]
    os.utime(tsv)  # a new mtime, the same bytes (a plain copy): still the same cache
    assert prepare_data(cfg, rank=0, progress=False).info["binary"] == info_again["binary"]
