"""One training step and its bookkeeping, shared by ``train()`` and the benchmark.

Keeping the step in one place means the benchmark's "trainer" row measures exactly what the
trainer runs: the TorchRec pipeline step, the data position, the loss check, the loss log.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from training.checkpoint import Progress
from training.errors import DataError
from training.metrics import MetricsLog


def mean_over_ranks(value: float) -> float:
    """Mean of a per-rank float over the process group (itself without one)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


@dataclass
class Window:
    """Samples, loss and training time since the last evaluation."""

    start: float = field(default_factory=time.perf_counter)
    samples: int = 0
    loss_sum: float = 0.0
    steps: int = 0

    def reset(self) -> None:
        self.start, self.samples, self.loss_sum, self.steps = time.perf_counter(), 0, 0.0, 0

    def exclude(self, seconds: float) -> None:
        """Time spent outside training (a checkpoint save) does not count."""
        self.start += seconds

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """The time spent inside (a checkpoint save) does not count as training."""
        t0 = time.perf_counter()
        yield
        self.exclude(time.perf_counter() - t0)

    def samples_per_sec(self) -> float | None:
        elapsed = time.perf_counter() - self.start
        return self.samples / elapsed if self.samples and elapsed > 0 else None


class TrainLoop:
    """Advances the pipeline one step at a time and keeps ``progress`` exact for checkpoints."""

    def __init__(
        self,
        pipeline: Any,
        batches: Iterator[Any],
        progress: Progress,
        *,
        batch_size: int,
        train_rows: int,
        total: int,
        log_every: int,
        loss_log: MetricsLog,
        bar: Any = None,
    ) -> None:
        self.pipeline = pipeline
        self.batches = batches
        self.progress = progress
        self.batch_size = batch_size
        self.train_rows = train_rows
        self.total = total
        self.log_every = log_every
        self.loss_log = loss_log
        self.bar = bar
        self.window = Window()

    def step(self) -> bool:
        """One optimizer step; False when the data ran out."""
        try:
            loss = self.pipeline.progress(self.batches)[0]
        except StopIteration:
            return False
        p, g = self.progress, self.batch_size
        p.step += 1
        p.samples_seen += g
        p.rows_in_epoch += g
        if p.rows_in_epoch + g > self.train_rows:  # the stream drops the partial last batch
            p.epoch, p.rows_in_epoch = p.epoch + 1, 0
        value = float(loss.item())
        if not math.isfinite(value):
            raise DataError(
                f"training loss became {value} at step {p.step}; lower the learning rates"
            )
        self.window.samples += g
        self.window.loss_sum += value
        self.window.steps += 1
        if self.bar is not None:
            self.bar.update(1)
        if p.step % self.log_every == 0 or p.step == self.total:
            mean_loss = mean_over_ranks(value)
            self.loss_log.write({"step": p.step, "loss": mean_loss})
            if self.bar is not None:
                rate = self.window.samples_per_sec() or 0.0
                self.bar.set_postfix(loss=f"{mean_loss:.4f}", samples_s=f"{rate:,.0f}")
        return True
