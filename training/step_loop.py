"""One training step and its bookkeeping, shared by ``train()`` and the benchmark.

Keeping the step in one place means the benchmark's "trainer" row measures exactly what the
trainer runs: the TorchRec pipeline step, the data position, the loss check, the loss log.

The step never waits for the device: each step's loss stays a device tensor in the
:class:`Window` until a logging step (every ``train.log_every``), an evaluation or a checkpoint
reads the pending ones in one transfer (as torchtitan syncs only when it logs), so a GPU runs
ahead of Python instead of draining its queue every step. The values read, their sums and the
finiteness check (with the exact step of the first bad loss) are the same as reading each
loss at its own step.
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

from training.checkpoint.store import Progress
from training.errors import DataError
from training.metrics.log import MetricsLog


def mean_over_ranks(value: float) -> float:
    """Mean of a per-rank float over the process group (itself without one)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


@dataclass
class Window:
    """Samples, loss and training time since the last evaluation.

    Losses are added as device tensors (:meth:`add_loss`, no sync) and read off the device
    together by :meth:`flush`, which ``loss_sum`` calls: every reader sees them all.
    """

    start: float = field(default_factory=time.perf_counter)
    samples: int = 0
    steps: int = 0
    _loss_sum: float = 0.0
    _pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (step, loss)

    @property
    def loss_sum(self) -> float:
        """Sum of the window's step losses (reads the pending ones off the device)."""
        self.flush()
        return self._loss_sum

    def add_loss(self, step: int, loss: torch.Tensor) -> None:
        """Record ``step``'s loss (a scalar tensor, on any device) without reading it."""
        self._pending.append((step, loss.detach()))
        self.steps += 1

    def flush(self) -> float | None:
        """Read the pending losses in one device-to-host copy, check they are finite, add them
        to the sum in step order; returns the latest loss (None when nothing was pending).

        Raises DataError naming the first step whose loss is NaN or infinite."""
        if not self._pending:
            return None
        values = torch.stack([loss for _, loss in self._pending]).cpu().tolist()
        steps = [step for step, _ in self._pending]
        self._pending.clear()
        for step, value in zip(steps, values, strict=True):
            if not math.isfinite(value):
                raise DataError(
                    f"training loss became {value} at step {step}; lower the learning rates"
                )
            self._loss_sum += value
        return float(values[-1])

    def reset(self) -> None:
        self.flush()  # the check covers every step, even one no reader looked at
        self.start, self.samples, self._loss_sum, self.steps = time.perf_counter(), 0, 0.0, 0

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
        self.window.add_loss(p.step, loss)  # no device sync here (see the module docstring)
        self.window.samples += g
        if self.bar is not None:
            self.bar.update(1)
        if p.step % self.log_every == 0 or p.step == self.total:
            value = self.window.flush()  # the one sync: this step's loss and the ones before it
            assert value is not None
            mean_loss = mean_over_ranks(value)
            self.loss_log.write({"step": p.step, "loss": mean_loss})
            if self.bar is not None:
                rate = self.window.samples_per_sec() or 0.0
                self.bar.set_postfix(loss=f"{mean_loss:.4f}", samples_s=f"{rate:,.0f}")
        return True
