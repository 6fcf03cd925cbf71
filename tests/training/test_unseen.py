"""Rows no model trained on, and no row dropped, in continuous training: the rows of a file's
last partial batch carried into the next file's pass (training/continuous/carry.py), the
export's record of which rows a version never saw (training/export/record.py), and what the
loop keeps of a rollout's report. Unit-level and fast; the loop end to end, counting every
file's rows, is in test_continuous.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from training.config import Config
from training.continuous import carry, publish
from training.continuous.inbox import FileRecord
from training.data.loader import Arrays, Joined, make_batch
from training.errors import DataError
from training.export.record import data_record

TABLES = (97,) * 26


def _arrays(n: int, start: int = 0, prob: bool = True) -> Arrays:
    """``n`` rows whose dense[:, 0] is their number (``start`` on): each row told apart."""
    rng = np.random.default_rng(start)
    dense = rng.random((n, 13), dtype=np.float32)
    dense[:, 0] = np.arange(start, start + n)
    sparse = rng.integers(-1, 97, (n, 26)).astype(np.int32)
    labels = (np.arange(start, start + n) % 2).astype(np.int8)
    p = rng.random(n, dtype=np.float32) if prob else None
    return Arrays(labels, dense, sparse, p, TABLES)


def _stream(rows: Arrays | Joined, carried: int, index: int = 3) -> carry.FileStream:
    return carry.FileStream(rows, carried, global_batch=8, rank=0, world_size=1,
                            rows_per_table=list(TABLES), seed=7, epochs=index + 1,
                            start_epoch=index)  # fmt: skip


def test_joined_rows_batch_as_the_rows_copied_together() -> None:
    head, tail = _arrays(5, 1000), _arrays(30)
    joined = Joined(head, tail)
    together = Arrays(*(np.concatenate([getattr(head, k), getattr(tail, k)])
                        for k in ("labels", "dense", "sparse", "prob")), TABLES)  # fmt: skip
    idx = np.array([0, 3, 4, 5, 9, 34])  # both parts, and the edges between them
    a, b = make_batch(joined, idx, np.array(TABLES)), make_batch(together, idx, np.array(TABLES))
    for x, y in ((a.batch.dense_features, b.batch.dense_features), (a.batch.labels, b.batch.labels),
                 (a.batch.sparse_features.values(), b.batch.sparse_features.values()),
                 (a.prob, b.prob)):  # fmt: skip
        assert x is not None and y is not None and bool((x == y).all())
    no_prob = Joined(_arrays(5, 1000, prob=False), tail).take(idx)
    assert no_prob.prob is None and no_prob.dense[:, 0].tolist() == [1000, 1003, 1004, 0, 4, 29]
    with pytest.raises(ValueError, match="hashed for tables of"):
        Joined(Arrays(head.labels, head.dense, head.sparse, None, (5,) * 26), tail)


def test_the_carried_rows_open_the_order_and_the_rest_is_carried_on(tmp_path: Path) -> None:
    """Two files: 30 rows, then 5 carried + 30; batches of 8. Each row is trained once or
    carried, counted from the ledger and told apart by its number."""
    first = FileRecord("day_0.tsv", 30, 0)
    s0 = _stream(_arrays(30), 0, 0)
    assert s0.order(0).tolist() == np.random.default_rng([7, 0]).permutation(30).tolist()
    first.begin(0), first.advance(0, 24, 3)  # three whole batches: 24 positions
    carry.carry_out(tmp_path, first, s0, _arrays(30), write=True)
    assert first.carried_out == 6 and carry.folder(tmp_path, 0).is_dir()
    carried_numbers = sorted(s0.order(0)[24:].tolist())

    second = FileRecord("day_1.tsv", 30, 1)
    head = carry.carried_in(tmp_path, second, [first], say=True)
    assert head is not None and (second.carried_in, second.carry_from) == (6, 0)
    assert head.dense[:, 0].astype(int).tolist() == carried_numbers  # the rows themselves
    rows = Joined(head, _arrays(30, 100))
    s1 = _stream(rows, 6, 1)
    order = s1.order(1)
    assert sorted(order[:6].tolist()) == list(range(6))  # the carried rows first
    assert sorted(order[6:].tolist()) == list(range(6, 36))
    trained = (len(rows) // 8) * 8
    second.begin(3), second.advance(0, trained, 7)
    # the stream hands out whole batches only: the last 4 rows wait for the next file, they
    # are not padded into a batch as a batch run's epoch is (training/data/loader.py)
    assert s1.steps_per_epoch == 4 and [len(b.labels) for b in s1] == [8] * 4
    assert s1.reads.end == (1, trained) and s1.reads.rows == trained
    carry.carry_out(tmp_path, second, s1, rows, write=True)
    # every row of both files: trained once, or carried to the next file, none dropped
    assert first.carried_in + first.rows == first.row + first.carried_out
    assert second.carried_in + second.rows == second.row + second.carried_out
    numbers = [rows.take(np.sort(order[:trained])).dense[:, 0], np.sort(s0.order(0)[:24])]
    left = carry.load(tmp_path, 1)
    assert left is not None and len(left) == second.carried_out == 4
    seen = np.concatenate([*numbers, left.dense[:, 0]]).astype(int).tolist()
    assert sorted(seen) == list(range(30)) + list(range(100, 130))

    carry.prune(tmp_path, 0)  # the end of the second file: what a resume inside it needs stays
    assert carry.folder(tmp_path, 0).is_dir() and carry.folder(tmp_path, 1).is_dir()
    resumed = carry.carried_in(tmp_path, second, [first], say=False)
    assert resumed is not None and resumed.dense[:, 0].tolist() == head.dense[:, 0].tolist()
    carry.prune(tmp_path, 1)  # the end of the file after it: the first's rows are done with
    assert not carry.folder(tmp_path, 0).exists() and carry.folder(tmp_path, 1).is_dir()
    with pytest.raises(DataError, match=r"the 6 rows carried into day_1.tsv, .* is gone"):
        carry.carried_in(tmp_path, second, [first], say=False)


def test_a_carry_gone_before_the_pass_begins_is_said_and_not_trained(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prev = FileRecord("day_0.tsv", 30, 0, row=24, carried_out=6, done=True)
    nxt = FileRecord("day_1.tsv", 30, 1)
    with caplog.at_level(logging.WARNING, logger="training"):
        assert carry.carried_in(tmp_path, nxt, [prev], say=True) is None
    assert "the 6 rows carried out of day_0.tsv are gone" in caplog.text
    assert (nxt.carried_in, nxt.carry_from) == (0, None)


def _tsv(path: Path, n: int) -> Path:
    path.write_text("".join(f"{i % 2}\t{i}" + "\t" * 38 + "\n" for i in range(n)))
    return path


def test_the_data_record_says_which_rows_a_version_never_saw(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = Config()
    cfg.data.path, cfg.data.cache_dir = str(_tsv(tmp_path / "day_1.tsv", 40)), str(tmp_path / "c")
    batch = data_record(cfg, {"data": {"rows": 40, "eval_rows": 4}})
    assert batch["eval_rows"] == 4 and batch["unseen"]["first_row"] == 36
    assert batch["unseen"]["at_end"] and "held-out split" in batch["unseen"]["why"]
    content = {k: batch["files"][0][k] for k in ("bytes", "sha256_ends")}
    ledger = {"files": [{"file": "day_0.tsv", "row": 24, "content": {"bytes": 1, "sha256_ends": "a"}},
                        {"file": "day_1.tsv", "row": 32, "content": content},
                        {"file": "old.tsv", "row": 32}]}  # fmt: skip
    meta = {"data": {"rows": 40, "train_rows": 40}, "continuous": ledger}
    nxt = _tsv(tmp_path / "day_2.tsv", 25)
    record = data_record(cfg, meta, nxt)
    assert record["eval_rows"] == 0  # a continuous pass trains every row of its files
    assert [f["name"] for f in record["trained_files"]] == ["day_0.tsv", "day_1.tsv"]
    unseen = record["unseen"]
    assert (unseen["first_row"], unseen["rows"], unseen["at_end"]) == (0, 25, False)
    assert unseen["files"][0]["path"] == str(nxt.resolve())
    with caplog.at_level(logging.WARNING, logger="training.export"):
        assert data_record(cfg, meta)["unseen"] is None  # never the rows it trained on
    assert "exported without --unseen-data" in caplog.text


def test_the_rollout_record_keeps_the_rows_and_who_never_saw_them(tmp_path: Path) -> None:
    source = {"files": ["/d/day_3.tsv"], "first_row": 1, "last_row": 2000, "rows": 2000,
              "unseen_by_candidate": True, "unseen_by_default": True}  # fmt: skip
    report = {"from": "156", "evaluation": {"source": source, "default": {"auc": 0.71},
                                            "candidate": {"auc": 0.73}}}  # fmt: skip
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    out = f"evaluation rows: ...\nrefused: v234 is withdrawn; v156 keeps all traffic\nreport: {path}\n"
    got = publish.rollout_outcome(1, out)
    assert got["eval"] == source and (got["auc_default"], got["auc_candidate"]) == (0.71, 0.73)
    assert got["from"] == "156" and got["reason"].startswith("refused: v234")
    assert "reason" not in publish.rollout_outcome(0, out)
