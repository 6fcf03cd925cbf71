"""The training loop's loss bookkeeping: read off the device on logging steps only, with the
values, sums and NaN check that reading every step's loss gave."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from training.checkpoint.store import Progress
from training.errors import DataError
from training.metrics.log import MetricsLog, read_metrics
from training.metrics.window import Window
from training.step_loop import TrainLoop


class _Pipeline:
    """``progress(batches)`` of a TorchRec pipeline: here the batches are the losses."""

    def progress(self, batches: Iterator[torch.Tensor]) -> tuple[torch.Tensor, Any]:
        return next(batches), None


def _loop(tmp_path: Path, losses: list[float], log_every: int) -> TrainLoop:
    return TrainLoop(
        _Pipeline(),
        iter([torch.tensor(v, dtype=torch.float32) for v in losses]),
        Progress(),
        batch_size=4,
        train_rows=1000,
        total=len(losses),
        log_every=log_every,
        loss_log=MetricsLog(tmp_path / "train_loss.jsonl", enabled=True),
    )


def test_losses_are_read_only_on_logging_steps(tmp_path: Path, monkeypatch: Any) -> None:
    losses = [0.7, 0.6931471805599453, 0.1 + 0.2, 1e-8, 0.5, 0.25, 0.3]
    loop = _loop(tmp_path, losses, log_every=3)
    reads: list[int] = []
    flush = Window.flush

    def counted(self: Window) -> float | None:
        reads.append(loop.progress.step)
        return flush(self)

    monkeypatch.setattr(Window, "flush", counted)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a per-step .item()"))
    while loop.step():
        pass
    assert reads == [3, 6, 7]  # the logging steps (and the last), never the others
    as_read = [float(torch.tensor(v, dtype=torch.float32)) for v in losses]  # what .item() gave
    logged = read_metrics(tmp_path / "train_loss.jsonl")
    assert logged == [{"step": s, "loss": as_read[s - 1]} for s in (3, 6, 7)]
    total = 0.0
    for v in as_read:  # the sum the per-step loop kept, in the same order
        total += v
    assert loop.window.loss_sum == total and loop.window.steps == 7
    assert loop.window.samples == 28 and loop.progress.samples_seen == 28


def test_a_bad_loss_is_named_by_its_own_step(tmp_path: Path) -> None:
    loop = _loop(tmp_path, [0.5, float("nan"), 0.4, 0.3], log_every=3)
    assert loop.step() and loop.step()  # step 2's NaN is still on the device
    with pytest.raises(DataError, match=r"training loss became nan at step 2; lower"):
        loop.step()  # step 3 logs: the read finds it
    assert not (tmp_path / "train_loss.jsonl").exists()


def test_readers_between_logs_see_every_loss(tmp_path: Path) -> None:
    """An evaluation (``loss_sum``) or a checkpoint (``flush``) between logging steps reads the
    pending losses first, and ``reset`` checks what nobody read."""
    loop = _loop(tmp_path, [1.0, 2.0, float("inf"), 4.0], log_every=10)
    loop.step()
    loop.step()
    assert loop.window.loss_sum == 3.0 and loop.window.steps == 2
    loop.window.reset()
    loop.step()
    with pytest.raises(DataError, match="inf at step 3"):
        loop.window.reset()
