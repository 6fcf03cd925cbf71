"""The mover (streaming/mover.py, standard library only): committed Flink parts -> the loop's
inbox as files of ``min_rows`` or more, exactly once whichever step a crash interrupts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from streaming import mover as mv


def _part(staging: Path, name: str, lines: list[str]) -> None:
    staging.mkdir(parents=True, exist_ok=True)
    (staging / name).write_text("".join(x + "\n" for x in lines))


def _mover(tmp: Path, min_rows: int = 3) -> mv.Mover:
    m = mv.Mover(tmp / "staging", tmp / "inbox", tmp / "joined.jsonl", tmp / "mover.json", min_rows)
    m.recover()
    return m


def _inbox(tmp: Path) -> list[str]:
    return [
        x for f in sorted((tmp / "inbox").glob("joined-*.tsv")) for x in f.read_text().splitlines()
    ]


def test_rows_wait_for_min_rows_then_go_as_one_file_with_its_manifest_line(tmp_path: Path) -> None:
    m = _mover(tmp_path)
    _part(tmp_path / "staging", "part-a-0-0.tsv", ["1700\t1\tA", "\t0\tB"])
    _part(tmp_path / "staging", ".part-a-0-1.tsv.inprogress.x", ["\t0\tHIDDEN"])
    assert m.step() == 0 and _inbox(tmp_path) == []  # 2 rows < 3: they wait
    _part(tmp_path / "staging", "part-a-0-2.tsv", ["1800\t1\tC"])
    assert m.step() == 3
    assert _inbox(tmp_path) == ["1\tA", "0\tB", "1\tC"]
    (entry,) = [json.loads(x) for x in (tmp_path / "joined.jsonl").read_text().splitlines()]
    assert (
        entry["rows"] == 3 and entry["positives"] == 2 and entry["click_event_ms"] == [1700, 1800]
    )
    assert entry["name"] == next((tmp_path / "inbox").iterdir()).name
    assert sorted(p.name for p in (tmp_path / "staging").iterdir()) == [
        ".part-a-0-1.tsv.inprogress.x"
    ]


@pytest.mark.parametrize("crash_at", [1, 2, 3])  # os.replace calls: state, the rename, state
def test_a_crash_at_any_step_loses_and_doubles_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash_at: int
) -> None:
    m = _mover(tmp_path)
    _part(
        tmp_path / "staging", "part-a-0-0.tsv", ["1700\t1\tr0", *(f"\t0\tr{i}" for i in (1, 2, 3))]
    )
    calls, real = [0], os.replace

    def replace(a: os.PathLike, b: os.PathLike) -> None:
        calls[0] += 1
        if calls[0] == crash_at:
            raise KeyboardInterrupt("killed")
        real(a, b)

    monkeypatch.setattr(mv.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        m.step()
    monkeypatch.setattr(mv.os, "replace", real)
    m = _mover(tmp_path)  # the restart
    _part(tmp_path / "staging", "part-a-0-1.tsv", ["1800\t1\ts0", "\t0\ts1", "\t0\ts2"])
    while m.step():
        pass
    assert sorted(_inbox(tmp_path)) == sorted(
        ["1\tr0", "0\tr1", "0\tr2", "0\tr3", "1\ts0", "0\ts1", "0\ts2"]
    )
    manifest = [json.loads(x) for x in (tmp_path / "joined.jsonl").read_text().splitlines()]
    assert [e["name"] for e in manifest] == sorted(p.name for p in (tmp_path / "inbox").iterdir())
    assert sum(e["rows"] for e in manifest) == 7


def test_a_half_written_manifest_line_is_cut_and_the_batch_finished_once(tmp_path: Path) -> None:
    m = _mover(tmp_path, min_rows=1)
    _part(tmp_path / "staging", "part-a-0-0.tsv", ["\t0\tA", "1700\t1\tB"])
    m.step()
    with open(tmp_path / "joined.jsonl", "a") as f:
        f.write('{"name": "joined-')  # a crash mid-append of the next line
    _mover(tmp_path, min_rows=1)
    lines = (tmp_path / "joined.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["rows"] == 2


def test_rows_of_one_label_wait_for_the_other(tmp_path: Path) -> None:
    """The first W of a run is clicks only (zeros come when windows close): the loop would
    reject a file of one label, so those rows wait for the first zeros."""
    m = _mover(tmp_path, min_rows=2)
    _part(tmp_path / "staging", "part-a-0-0.tsv", ["1700\t1\tA", "1800\t1\tB", "1900\t1\tC"])
    assert m.step() == 0 and _inbox(tmp_path) == []
    _part(tmp_path / "staging", "part-a-0-1.tsv", ["\t0\tD"])
    assert m.step() == 4 and _inbox(tmp_path) == ["1\tA", "1\tB", "1\tC", "0\tD"]
