"""When and what the training loop checkpoints, and how a run resumes from a checkpoint.

:class:`Checkpointer` owns the schedule (``should_save`` every ``train.checkpoint_every`` steps
and at the end) and the stateful pieces a checkpoint restores: the trainer's model and
optimizer state and the :class:`~training.checkpoint.store.Progress` that the data stream resumes
from. The on-disk format lives in :mod:`training.checkpoint.store`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from training.checkpoint import store as checkpoint
from training.checkpoint.store import Progress
from training.config import Config
from training.data.loader import ReadLedger
from training.features import SPARSE_NAMES, table_name
from training.trainer import Trainer

logger = logging.getLogger("training")


class Checkpointer:
    """Saves ``trainer`` and ``progress`` under ``root`` and restores them on resume.

    ``meta`` (config, world size, data, versions) is recorded with every save, together with
    the latest evaluation record and, given ``reads``, every rank's :class:`ReadLedger` record
    (``reads``: where each rank ran and which training rows it read; also ``self.reads``).
    """

    def __init__(
        self,
        root: Path,
        trainer: Trainer,
        progress: Progress,
        cfg: Config,
        meta: dict[str, Any],
        reads: ReadLedger | None = None,
    ) -> None:
        self.root, self.trainer, self.progress, self.meta = root, trainer, progress, meta
        self.ledger = reads
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
        if rank == 0:
            p = self.progress
            logger.info("resumed from %s at step %d (epoch %d)", path, p.step, p.epoch)
            if skipped:
                logger.warning(
                    "optimizer state not restored (its sharding kind changed): %s", skipped
                )

    def should_save(self, step: int, at_end: bool) -> bool:
        return bool(self.every and step % self.every == 0) or at_end

    def saved(self, step: int) -> bool:
        """Whether ``root`` already holds a checkpoint of ``step``."""
        return self.last_saved == step

    def save(self, metrics: dict[str, Any]) -> None:
        """Collective: a complete checkpoint of the current step (see :func:`checkpoint.save`)."""
        extra: dict[str, Any] = {"metrics": metrics}
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
        )
        self.last_saved = self.progress.step

    @staticmethod
    def _gather(record: dict[str, Any]) -> list[dict[str, Any]]:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return [record]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, record)
        return out
