"""TensorBoard scalars of a run, under ``<run>/tb/`` (``tensorboard --logdir runs``).

Written with ``torch.utils.tensorboard`` by rank 0 only and flushed after every write, so a
run killed at any point leaves what it had logged readable. A run that resumes at step ``s``
opens its writer with ``purge_step = s + 1``: TensorBoard drops the events a killed run wrote
past its checkpoint, like ``metrics.jsonl``
(:meth:`training.metrics.log.MetricsLog.truncate_after`).

Tags: ``train/loss`` (every ``train.log_every`` steps), ``eval/auc``, ``eval/ne``,
``eval/samples_per_sec``, ``eval/train_loss`` (and ``eval/oracle_auc`` on synthetic data) at
each evaluation; the continuous loop adds ``progressive/*`` per file and ``rollout/*``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TB_DIR = "tb"


class Scalars:
    """A TensorBoard writer on ``log_dir`` when ``enabled`` (rank 0), else nothing at all."""

    def __init__(self, log_dir: Path, enabled: bool, purge_step: int | None = None) -> None:
        self.log_dir = log_dir
        self._writer: Any = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def add(self, prefix: str, values: Mapping[str, Any], step: int) -> None:
        """``prefix/key`` for every finite number of ``values`` (bools and ``step`` excluded)."""
        if self._writer is None:
            return
        for key, value in values.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                self._writer.add_scalar(f"{prefix}/{key}", value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def for_run(run_dir: Path, rank: int, step: int) -> Scalars:
    """The writer of ``run_dir/tb`` for a run that starts (or resumes) at ``step``."""
    return Scalars(run_dir / TB_DIR, enabled=rank == 0, purge_step=step + 1)
