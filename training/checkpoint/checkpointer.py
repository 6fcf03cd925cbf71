"""When and what the training loop checkpoints, and how a run resumes from a checkpoint.

:class:`Checkpointer` owns the schedule (``should_save`` every ``train.checkpoint_every`` steps
and at the end) and the stateful pieces a checkpoint restores: the trainer's model and
optimizer state and the :class:`~training.checkpoint.store.Progress` that the data stream resumes
from. The on-disk format lives in :mod:`training.checkpoint.store`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from training.checkpoint import store as checkpoint
from training.checkpoint.store import Progress
from training.config import Config
from training.data.loader import ReadLedger
from training.features import SPARSE_NAMES, table_name
from training.metrics.monitor import Monitor
from training.trainer import Trainer

logger = logging.getLogger("training")


class Checkpointer:
    """Saves ``trainer`` and ``progress`` under ``root`` and restores them on resume.

    ``meta`` (config, world size, data, versions) is recorded with every save, together with
    the latest evaluation record and, given ``reads``, every rank's :class:`ReadLedger` record
    (``reads``: where each rank ran and which training rows it read; also ``self.reads``).
    Given ``monitor`` (:class:`~training.metrics.monitor.Monitor`), its state is recorded
    (``monitor``) and restored, and ``checkpoints/best`` kept naming the best of this run.
    ``files(folder)`` writes rank 0's own files into each checkpoint (the continuous loop's
    baseline).
    """

    def __init__(
        self,
        root: Path,
        trainer: Trainer,
        progress: Progress,
        cfg: Config,
        meta: dict[str, Any],
        reads: ReadLedger | None = None,
        monitor: Monitor | None = None,
        files: Callable[[Path], None] | None = None,
    ) -> None:
        self.root, self.trainer, self.progress, self.meta = root, trainer, progress, meta
        self.ledger, self.monitor, self.files = reads, monitor, files
        self.reads: list[dict[str, Any]] = []  # every rank's ledger record at the last save
        self.every = cfg.train.checkpoint_every
        self.keep_last = cfg.train.keep_last
        self.table_rows = {
            table_name(f): r for f, r in zip(SPARSE_NAMES, cfg.model.rows(), strict=True)
        }
        self.last_saved = -1  # step of the newest checkpoint in root (-1: none this run)

    def restore(self, path: Path, meta: dict[str, Any], rank: int) -> None:
        """Load ``path`` (collective; resharded onto this run's plan) into trainer and progress."""
        state, skipped = checkpoint.load(path, self.trainer.state_dict(), self.table_rows)
        self.trainer.load_state_dict(state)
        self.progress.load_state_dict(meta["progress"])
        if path.parent == self.root:  # resuming in place: this step needs no second save
            self.last_saved = self.progress.step
        if self.monitor is not None:
            self._restore_best(meta.get("monitor") if path.parent == self.root else None, rank)
        if rank == 0:
            p = self.progress
            logger.info("resumed from %s at step %d (epoch %d)", path, p.step, p.epoch)
            if skipped:
                logger.warning(
                    "optimizer state not restored (its sharding kind changed): %s", skipped
                )

    def _restore_best(self, state: dict[str, Any] | None, rank: int) -> None:
        """The monitor as the checkpoint left it, ``best`` naming its best again (what a
        later save made best is of steps this run redoes). A best whose directory is gone, or
        another run's (a checkpoint resumed from elsewhere), is dropped: this run's next
        evaluation is its first best."""
        assert self.monitor is not None
        self.monitor.load_state_dict(state)
        step = self.monitor.best_step
        if step is not None and not checkpoint.is_complete(
            self.root / checkpoint.step_dir_name(step)
        ):
            if rank == 0:
                logger.warning("the best checkpoint (step %d) is gone; best starts afresh", step)
            self.monitor.reset()
            step = None
        if rank == 0:
            checkpoint.set_best(self.root, step)

    def forget_best(self, rank: int) -> None:
        """A fresh start: a ``best`` left by an earlier run in ``root`` names none of this run."""
        if rank == 0 and self.root.is_dir():
            checkpoint.set_best(self.root, None)

    def should_save(self, step: int, at_end: bool) -> bool:
        return bool(self.every and step % self.every == 0) or at_end

    def saved(self, step: int) -> bool:
        """Whether ``root`` already holds a checkpoint of ``step``."""
        return self.last_saved == step

    def save(self, metrics: dict[str, Any], best: bool = False) -> None:
        """Collective: a complete checkpoint of the current step (see :func:`checkpoint.save`),
        named ``best`` too when ``best``."""
        extra: dict[str, Any] = {"metrics": metrics}
        if self.monitor is not None:
            extra["monitor"] = self.monitor.state_dict()
        if self.ledger is not None:
            self.reads = self._gather(self.ledger.record())
            extra["reads"] = self.reads
        checkpoint.save(
            self.root,
            self.progress,
            self.trainer.state_dict(),
            {**self.meta, **extra},
            self.trainer.plan,
            self.keep_last,
            best=best,
            files=self.files,
        )
        self.last_saved = self.progress.step

    @staticmethod
    def _gather(record: dict[str, Any]) -> list[dict[str, Any]]:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return [record]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, record)
        return out
