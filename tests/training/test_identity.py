"""Identity by content, not by name or mtime: the files the continuous loop consumed
(training.continuous.inbox), the archives it publishes (training.continuous.publish), and the
one file order both the inbox and the Criteo reader use (recsys_stack.datafile.natural_key).
Unit-level and fast; the loops that use them end to end are in test_continuous.py."""

from __future__ import annotations

import json
import logging
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from recsys_stack.datafile import natural_key
from training.continuous import inbox, publish
from training.continuous.inbox import Ledger
from training.data.criteo import resolve_data_paths


def _consume(ledger: Ledger, path: Path) -> None:
    record = ledger.start(path.name, 10, inbox.content_of(path))
    record.done = True


def test_a_consumed_name_with_other_content_is_pending_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    day = tmp_path / "day_1.tsv"
    day.write_text("1\t2\n" * 50)
    ledger = Ledger()
    _consume(ledger, day)
    assert inbox.pending(tmp_path, ledger.consumed) == []
    os.utime(day, (1, 1))  # the same bytes with another mtime (a plain copy): still consumed
    assert inbox.pending(tmp_path, ledger.consumed) == []
    st = day.stat()
    day.write_text("0\t2\n" * 50)  # new rows, the same size, and the mtime put back
    os.utime(day, ns=(st.st_atime_ns, st.st_mtime_ns))
    with caplog.at_level(logging.WARNING, logger="training.continuous"):
        assert inbox.pending(tmp_path, ledger.consumed) == [day]
        assert inbox.pending(tmp_path, ledger.consumed) == [day]  # said once, not every poll
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("day_1.tsv: the name of a consumed file, with other content (200 ")
    assert "taken as a new file" in line
    _consume(ledger, day)  # trained: both contents are now consumed under the name
    assert inbox.pending(tmp_path, ledger.consumed) == []
    assert [f.index for f in ledger.done] == [0, 1] and len(ledger.consumed["day_1.tsv"]) == 2


def test_a_ledger_from_before_contents_matches_by_name(tmp_path: Path) -> None:
    (tmp_path / "day_1.tsv").write_text("1\t2\n")
    (tmp_path / "day_2.tsv").write_text("1\t2\n")
    raw = {"files": [{"file": "day_1.tsv", "rows": 1, "index": 0, "done": True}]}
    ledger = Ledger.from_json(raw)
    assert ledger.files[0].content is None
    assert inbox.pending(tmp_path, ledger.consumed) == [tmp_path / "day_2.tsv"]


def test_the_inbox_and_the_reader_share_one_natural_order(tmp_path: Path) -> None:
    names = ["day_10.tsv", "day_2.tsv", "day_1.tsv", "day_0.tsv", "day_11.tsv"]
    for n in names:
        (tmp_path / n).write_text("x\n")
    want = sorted(names, key=natural_key)
    assert want == ["day_0.tsv", "day_1.tsv", "day_2.tsv", "day_10.tsv", "day_11.tsv"]
    assert [p.name for p in inbox.pending(tmp_path, {})] == want
    assert [p.name for p in resolve_data_paths(tmp_path)] == want


def _checkpoint(root: Path, step: int, saved_at: float) -> Path:
    """A step directory as far as its identity goes: meta.json, .metadata and a shard."""
    ckpt = root / "checkpoints" / f"step_{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"progress": {"step": step}, "saved_at": saved_at}))
    (ckpt / ".metadata").write_bytes(b"dcp")
    (ckpt / "__0_0.distcp").write_bytes(b"\0" * 64)
    return ckpt


def _published(store: Path, name: str, ident: dict | None) -> Path:
    """An archive in the store, stamped the way publish stamps what it exported."""
    built = store / ".built.mar"
    with zipfile.ZipFile(built, "w") as z:
        z.writestr("MAR-INF/MANIFEST.json", "{}")
    mar = store / f"{name}.mar"
    if ident is None:
        os.replace(built, mar)
    else:
        publish._stamp_and_place(built, mar, ident)
        built.unlink()
    return mar


def test_an_archive_is_reused_only_for_this_run_and_this_checkpoint(tmp_path: Path) -> None:
    run, store = tmp_path / "run", tmp_path / "store"
    store.mkdir()
    rid = publish.run_id(run)
    assert publish.run_id(run) == rid and len(rid) == 32  # made once, kept in the run dir
    ckpt = _checkpoint(run, 78, 1.0)
    ident = {"run_id": rid, **publish.checkpoint_identity(ckpt)}
    assert ident["step"] == 78
    assert publish.choose_version(store, "dlrm-tiny", ident) == ("78", False, [])
    _published(store, "dlrm-tiny-78", ident)
    assert publish.choose_version(store, "dlrm-tiny", ident) == ("78", True, [])  # a restart
    # the run directory deleted and the same config run again: a new run id, the same step
    shutil.rmtree(run)
    again = {
        "run_id": publish.run_id(run),
        **publish.checkpoint_identity(_checkpoint(run, 78, 2.0)),
    }
    assert again["run_id"] != rid
    version, reuse, collisions = publish.choose_version(store, "dlrm-tiny", again)
    assert (version, reuse) == (f"78-{again['run_id'][:8]}", False)
    assert collisions == [f"{store / 'dlrm-tiny-78.mar'} is another model (run {rid[:8]}, "
                          f"checkpoint {ident['digest'][:8]})"]  # fmt: skip
    _published(store, f"dlrm-tiny-{version}", again)
    assert publish.choose_version(store, "dlrm-tiny", again)[:2] == (version, True)
    # the same run, step 78 saved again (resumed from an earlier step): another checkpoint
    shutil.rmtree(run / "checkpoints")
    resaved = {**again, **publish.checkpoint_identity(_checkpoint(run, 78, 3.0))}
    assert resaved["digest"] != again["digest"]
    assert publish.choose_version(store, "dlrm-tiny", resaved)[:2] == (
        f"78-{again['run_id'][:8]}-{resaved['digest'][:8]}",
        False,
    )


def test_an_archive_without_identity_is_never_reused(tmp_path: Path) -> None:
    run, store = tmp_path / "run", tmp_path / "store"
    store.mkdir()
    ident = {"run_id": publish.run_id(run), **publish.checkpoint_identity(_checkpoint(run, 5, 1))}
    _published(store, "dlrm-tiny-5", None)  # exported by hand, or killed before its stamp
    (store / f"dlrm-tiny-5-{ident['run_id'][:8]}.mar").write_text("not a zip")
    bad = _published(store, f"dlrm-tiny-5-{ident['run_id'][:8]}-{ident['digest'][:8]}", None)
    version, reuse, collisions = publish.choose_version(store, "dlrm-tiny", ident)
    assert version is None and not reuse and len(collisions) == 3
    assert collisions[-1] == f"{bad} is another model (no identity.json)"
