"""The rows a continuous delta compares (training/continuous/touched.py): every id a file's
rows look up (hashed as the loader hashes raw ids), kept across a restart, and good only
against the served state it started from."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from training.continuous.touched import Touched
from training.data.loader import Arrays, Joined

ROWS = [10, 1000] + [7] * 24  # 26 tables


def _arrays(ids: list[list[int]], hashed: bool) -> Arrays:
    sparse = np.full((len(ids), 26), -1, dtype=np.int64)
    for i, row in enumerate(ids):
        sparse[i, : len(row)] = row
    n = len(ids)
    return Arrays(np.zeros(n, np.int8), np.zeros((n, 13), np.float32), sparse, None,
                  tuple(ROWS) if hashed else None)  # fmt: skip


def test_rows_are_the_ids_looked_up_hashed_as_the_loader_does(tmp_path: Path) -> None:
    t = Touched(tmp_path / "touched.npz", ROWS, step=0)
    state = ("/store/deltas/m/5", "")
    assert t.since(state) is None  # nothing known yet: every row is compared
    t.add(_arrays([[3, 999], [3, -1]], hashed=True))  # before any state: a no-op
    t.restart(state, step=5)
    raw = _arrays([[13, 2001, 8]], hashed=False)  # raw ids: id mod rows
    t.add(Joined(_arrays([[4]], hashed=True), _arrays([[6]], hashed=True)), None, raw)
    got = t.since(state)
    assert got is not None
    assert got[0].tolist() == [3, 4, 6] and got[1].tolist() == [1] and got[2].tolist() == [1]
    assert all(len(g) == 0 for g in got[3:])
    assert t.since(("/store/deltas/m/5", "0001-9.pt")) is None  # another chain end


def test_the_set_survives_a_restart_but_not_a_resume_from_before_its_state(tmp_path: Path) -> None:
    path = tmp_path / "touched.npz"
    t = Touched(path, ROWS, step=0)
    state = ("/store/deltas/m/5", "0002-40.pt")
    t.restart(state, step=40)
    t.add(_arrays([[1, 500]], hashed=True))
    again = Touched(path, ROWS, step=48)  # resumed at a checkpoint after the state
    got = again.since(state)
    assert got is not None and got[0].tolist() == [1] and got[1].tolist() == [500]
    assert Touched(path, ROWS, step=32).since(state) is None  # resumed before it: unknown
    assert Touched(path, [10, 999] + [7] * 24, step=48).since(state) is None  # other tables
    off = Touched(path, ROWS, step=48, enabled=False)
    off.restart(state, step=50)
    assert off.since(state) is None and Touched(path, ROWS, step=48).since(state) is not None
