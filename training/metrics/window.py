"""What the training loop and the evaluator both read: the window of steps since the last
evaluation (:class:`Window`) and a mean over the ranks (:func:`mean_over_ranks`).

Below both (training/step_loop.py runs the steps, training/metrics/evaluator.py reads the
window when it evaluates), so neither imports the other.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from training.errors import DataError


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
