"""The feature log's parts without processes: request ids, the C line formatter against its
Python twin (and recsys_stack/online.py's criteo_row), the rolling files (size, age,
retention, no partial file in view) and the queue's bound."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import numpy as np
import pytest

from recsys_stack.online import CLICKS, IMPRESSIONS, criteo_row
from serving.gateway import featurelog
from serving.gateway.featurelog import FeatureLog, FeatureLogConfig, format_impressions, heads
from serving.gateway.featurelog_files import RollingFiles
from serving.gateway.request_ids import KeyFileError, RequestIds, load_key

fastwire = pytest.importorskip("serving.gateway._fastwire")


def _arrays(rng: np.random.Generator, b: int, odd: bool = False) -> tuple[np.ndarray, ...]:
    dense = rng.integers(-3, 10**6, (b, 13)).astype(np.float32)
    lengths = rng.integers(0, 2, (26, b)).astype(np.int32)
    if odd:
        dense[1, 4] = 2.5  # fractional: no Criteo row holds it
        lengths[7, 3] = 2  # two ids in one field: neither
    values = rng.integers(0, 2**62, int(lengths.sum())).astype(np.int64)
    return dense, values, lengths, rng.random(b).astype(np.float32)


def _sparse(values: np.ndarray, lengths: np.ndarray, b: int) -> list[list[int]]:
    starts = np.concatenate(([0], np.cumsum(lengths.reshape(-1))))
    n = lengths.shape[1]
    return [values[starts[f * n + b] : starts[f * n + b + 1]].tolist() for f in range(26)]


def test_the_c_lines_are_the_python_ones_and_criteo_rows() -> None:
    rng = np.random.default_rng(3)
    head, mid = heads("abc.0.5.ff", 1700000000123, "dlrm-tiny", 'v"1')
    for b, odd in ((0, False), (1, False), (5, True), (300, False), (300, True)):
        dense, values, lengths, scores = _arrays(rng, b, odd)
        got = fastwire.impressions(head, mid, dense, values, lengths, scores)
        assert got == format_impressions(head, mid, dense, values, lengths, scores)
        data, skipped = got
        assert skipped == ([1, 3] if odd else [])
        lines = [json.loads(x) for x in data.decode().splitlines()]
        assert [r["example"] for r in lines] == [k for k in range(b) if k not in skipped]
        for r in lines:
            k = r["example"]
            assert r["row"] == criteo_row(dense[k].tolist(), _sparse(values, lengths, k))
            assert np.float32(r["score"]) == scores[k]  # exact: %.9g round-trips a float32
            assert (r["request_id"], r["version"], r["event_time_ms"]) == (
                "abc.0.5.ff", 'v"1', 1700000000123)  # fmt: skip
    with pytest.raises(ValueError, match="add up"):  # never a read past the ids
        fastwire.impressions(head, mid, dense, values[:-1], lengths, scores)


def test_request_ids_are_checked_by_mac_and_sampled_alike(tmp_path: Path) -> None:
    key = tmp_path / "k" / "request_id.key"
    ids = RequestIds(load_key(key))  # made when missing, private
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    other = RequestIds(load_key(key))  # another gateway of the stack: the same key
    rid = ids.issue(100, 1700000000000)
    assert other.check(rid) == (1700000000000, 100)
    forged = rid[:-1] + ("0" if rid[-1] != "0" else "1")
    for bad, why in ((forged, "not issued by this stack"), ("x.y", "not a request id"),
                     ("zz.qq.1.ab", "malformed"), (rid.replace(".100.", ".101."), "not issued")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            other.check(bad)
    with pytest.raises(ValueError, match="not issued"):
        RequestIds.own().check(rid)
    many = [ids.issue(1) for _ in range(4000)]
    assert len(set(many)) == len(many)
    kept = sum(RequestIds.sampled(r, 0.25) for r in many)
    assert 800 < kept < 1200 and all(RequestIds.sampled(r, 1.0) for r in many)
    os.chmod(key, 0o666)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_key(key)


def _closed(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def test_files_roll_by_size_and_age_and_are_kept_to_max_files(tmp_path: Path) -> None:
    files = RollingFiles(tmp_path, IMPRESSIONS, "w1", max_bytes=100, max_age_s=5.0, max_files=3)
    files.write(b"x" * 60 + b"\n", now=0.0)
    assert _closed(tmp_path) == [] and files.open  # hidden while open
    assert [p.name for p in tmp_path.iterdir()] == [".impressions-w1-00000000.jsonl.tmp"]
    files.write(b"y" * 60 + b"\n", now=1.0)  # 122 bytes >= 100: closed at once
    assert _closed(tmp_path) == ["impressions-w1-00000000.jsonl"] and not files.open
    files.tick(now=100.0)  # nothing open: no empty file
    files.write(b"z\n", now=10.0)
    files.tick(now=14.9)
    assert files.open
    files.tick(now=15.0)  # open 5 s: closed however small
    assert _closed(tmp_path)[-1] == "impressions-w1-00000001.jsonl"
    assert (tmp_path / "impressions-w1-00000001.jsonl").read_bytes() == b"z\n"
    for k in range(4):
        time.sleep(0.01)  # mtimes apart: retention deletes by age
        files.write(b"%d\n" % k, now=20.0 + k)
        files.close()
    assert _closed(tmp_path) == [f"impressions-w1-{k:08d}.jsonl" for k in (3, 4, 5)]
    assert (files.closed, files.deleted) == (6, 3)


def test_a_full_queue_drops_and_counts_and_close_writes_the_rest(tmp_path: Path) -> None:
    cfg = FeatureLogConfig(enabled=True, dir=str(tmp_path), queue_examples=250,
                           max_file_age_s=3600)  # fmt: skip
    ids = featurelog.request_ids(cfg)
    log = FeatureLog(cfg, "m", ids)
    rng = np.random.default_rng(1)
    log._stop.set()  # the writer stopped: the queue only fills (its close drains it)
    log._thread.join()
    sent = []
    for _ in range(4):
        dense, values, lengths, scores = _arrays(rng, 100)
        rid = ids.issue(100)
        log.scored(rid, (dense, values, lengths), "1", scores, 1)
        sent.append(rid)
    assert (log.waiting, log.dropped_full) == (200, 200)  # two fit in 250 examples
    assert log.clicks(b'{"x": 1}\n', 1) and not log.clicks(b"", 50)
    log._run()  # what the thread does when stopped: drain, then close the files
    log.close()
    got = [json.loads(x) for p in (tmp_path / IMPRESSIONS).glob("*.jsonl")
           for x in p.read_text().splitlines()]  # fmt: skip
    assert sorted({r["request_id"] for r in got}) == sorted(sent[:2]) and len(got) == 200
    assert (tmp_path / CLICKS).glob("*.jsonl") and log.logged == {IMPRESSIONS: 200, CLICKS: 1}
    assert not [p for p in (tmp_path / IMPRESSIONS).iterdir() if p.name.startswith(".")]
