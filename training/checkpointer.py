"""When and what the training loop checkpoints, and how a run resumes from a checkpoint.

:class:`Checkpointer` owns the schedule (``should_save`` every ``train.checkpoint_every`` steps
and at the end) and the stateful pieces a checkpoint restores: the trainer's model and
optimizer state and the :class:`~training.checkpoint.Progress` that the data stream resumes
from. The on-disk format lives in :mod:`training.checkpoint`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from training import checkpoint
from training.checkpoint import Progress
from training.config import Config
from training.features import SPARSE_NAMES, table_name
from training.trainer import Trainer

logger = logging.getLogger("training")


class Checkpointer:
    """Saves ``trainer`` and ``progress`` under ``root`` and restores them on resume.

    ``meta`` (config, world size, data, versions) is recorded with every save, together with
    the latest evaluation record.
    """

    def __init__(
        self, root: Path, trainer: Trainer, progress: Progress, cfg: Config, meta: dict[str, Any]
    ) -> None:
        self.root, self.trainer, self.progress, self.meta = root, trainer, progress, meta
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
        checkpoint.save(
            self.root,
            self.progress,
            self.trainer.state_dict(),
            {**self.meta, "metrics": metrics},
            self.trainer.plan,
            self.keep_last,
        )
        self.last_saved = self.progress.step
