"""Rows of a file carried into the next one, so that no row of an arriving file is dropped.

A pass over a file trains whole global batches of ``train.batch_size`` rows; the last rows of
its order, fewer than a batch, do not fill one. They are **carried**: copied to
``RUN/carry/file_<index>/`` (``labels``, ``dense``, ``sparse`` and, on synthetic days,
``prob`` ``.npy``: less than a batch of rows) when the file's pass ends, and trained first in
the next file's pass, before its own rows (:class:`FileStream`: the older rows first, as they
arrived; each part in a shuffled order of its own). The ledger records both ends of each file
(``carried_in``, ``carried_out``: training/continuous/inbox.py), so each row is trained exactly
once: per file ``carried_in + rows == row + carried_out``, and the last file's
``carried_out`` rows wait for the next file.

A carried folder is kept while a retained checkpoint may resume the file that takes it in (the
two newest), then removed; a resume that finds it gone trains the file without those rows and
says how many were lost.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from training.continuous.inbox import FileRecord
from training.data.loader import Arrays, Joined, TrainStream
from training.errors import DataError

logger = logging.getLogger("training")

FOLDER = "carry"
COLUMNS = ("labels", "dense", "sparse", "prob")


def folder(run_dir: Path, index: int) -> Path:
    """Where the rows carried out of file number ``index`` are kept."""
    return run_dir / FOLDER / f"file_{index:06d}"


def save(run_dir: Path, index: int, rows: Arrays, info: dict[str, Any]) -> None:
    """Keep ``rows`` (carried out of file ``index``) with ``info``; replaces an earlier copy
    (a file redone after a resume) by a rename, so a reader sees one copy or the other."""
    final = folder(run_dir, index)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in COLUMNS:
        column = getattr(rows, name)
        if column is not None:
            np.save(tmp / f"{name}.npy", np.asarray(column))
    meta = {**info, "rows": len(rows), "hashed_for": rows.hashed_for}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def load(run_dir: Path, index: int) -> Arrays | None:
    """The rows carried out of file ``index``; None when their folder is gone."""
    d = folder(run_dir, index)
    if not (d / "meta.json").is_file():
        return None
    meta = json.loads((d / "meta.json").read_text())
    prob = np.load(d / "prob.npy") if (d / "prob.npy").is_file() else None
    hashed = meta.get("hashed_for")
    return Arrays(np.load(d / "labels.npy"), np.load(d / "dense.npy"), np.load(d / "sparse.npy"),
                  prob, None if hashed is None else tuple(hashed))  # fmt: skip


def prune(run_dir: Path, keep_from: int) -> None:
    """Remove the rows carried out of files numbered below ``keep_from``."""
    root = run_dir / FOLDER
    for d in root.glob("file_*") if root.is_dir() else ():
        if int(d.name.split("_", 1)[1]) < keep_from:
            shutil.rmtree(d, ignore_errors=True)


class FileStream(TrainStream):
    """A file's pass: the ``carried`` rows that open ``arrays`` (a :class:`Joined`) first, in
    a shuffled order of their own, then the file's rows in theirs; both seeded by the run's
    seed and the file's number, the same on every rank and world size. Whole batches only:
    the last rows, fewer than a batch, are carried into the next file's pass (not padded as a
    batch run's epoch is: they still have a file to join)."""

    def __init__(self, arrays: Arrays | Joined, carried: int, **kwargs: Any) -> None:
        super().__init__(arrays, pad_last=False, **kwargs)
        self.carried = carried

    def order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        own = rng.permutation(len(self.arrays) - self.carried) + self.carried
        if not self.carried:  # nothing carried in: the order a plain pass has
            return own
        first = np.random.default_rng([self.seed, epoch, 1]).permutation(self.carried)
        return np.concatenate([first, own])


def carried_in(
    run_dir: Path, record: FileRecord, done: list[FileRecord], say: bool
) -> Arrays | None:
    """The rows carried into ``record`` from the previous file of ``done`` (None: none),
    decided when its pass begins (the ledger keeps it for a resume, which raises DataError
    when they are gone: its position could not be placed). ``say``: log (rank 0)."""
    if record.steps:  # resumed inside its pass: the rows it began with
        if not record.carried_in:
            return None
        assert record.carry_from is not None
        rows = load(run_dir, record.carry_from)
        if rows is None or len(rows) != record.carried_in:
            raise DataError(
                f"{folder(run_dir, record.carry_from)} (the {record.carried_in} rows carried "
                f"into {record.file}, whose pass this checkpoint is in) is gone: restore it, "
                "or resume from the checkpoint before that file (--resume)"
            )
        return rows
    prev = done[-1] if done else None
    record.carry_from, record.carried_in = None, 0
    if prev is None or not prev.carried_out:
        return None
    rows = load(run_dir, prev.index)
    if rows is None or len(rows) != prev.carried_out:
        if say:
            logger.warning(
                "%s: the %d rows carried out of %s are gone (%s): not trained",
                record.file, prev.carried_out, prev.file, folder(run_dir, prev.index),
            )  # fmt: skip
        return None
    record.carry_from, record.carried_in = prev.index, len(rows)
    return rows


def carry_out(
    run_dir: Path, record: FileRecord, stream: FileStream, rows: Arrays | Joined, write: bool
) -> None:
    """Keep the rows of ``stream``'s order past its last whole batch (``record.row`` on) for
    the next file's pass (``write``: rank 0 writes them, every rank waits for it)."""
    left = np.sort(stream.order(record.index)[record.row :])
    record.carried_out = len(left)
    if write and len(left):
        save(run_dir, record.index, rows.take(left),
             {"file": record.file, "positions": [record.row, len(rows)]})  # fmt: skip
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # written before any rank may read it (the next file's pass)
