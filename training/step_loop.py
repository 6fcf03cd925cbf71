"""The training loop: one step and its bookkeeping, and the schedule around the steps.

:class:`TrainLoop` is the step, shared by ``train()`` and the benchmark, so the benchmark's
"trainer" row measures exactly what the trainer runs: the TorchRec pipeline step, the data
position, the loss check, the loss log.

The step never waits for the device: each step's loss stays a device tensor in the
:class:`Window` until a logging step (every ``train.log_every``), an evaluation or a checkpoint
reads the pending ones in one transfer (as torchtitan syncs only when it logs), so a GPU runs
ahead of Python instead of draining its queue every step. The values read, their sums and the
finiteness check (with the exact step of the first bad loss) are the same as reading each
loss at its own step.

:func:`run_schedule` steps the loop to its end as a schedule of named calls (torchtitan's
loop): evaluate (:class:`~training.metrics.evaluator.Evaluator`) and checkpoint
(:class:`~training.checkpoint.checkpointer.Checkpointer`) when due. Each evaluation goes through
the :class:`~training.metrics.monitor.Monitor`: one that improves ``train.monitor`` is saved as a
checkpoint of its own (``train.keep_best``) and named ``checkpoints/best``, as Lightning's
``ModelCheckpoint(monitor=...)`` does; when early stopping's patience runs out the loop stops.
The run ends with a final evaluation on the whole validation split and on the test split
(training/metrics/evaluator.py), completed by ``finish`` (the baseline's figures, the run's
warnings) before it is written, and a final checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from training.checkpoint.store import Progress, step_dir_name
from training.data.loader import step_rows
from training.metrics.log import MetricsLog
from training.metrics.monitor import Monitor
from training.metrics.window import Window, mean_over_ranks
from training.trainer import Trainer, unwrapped_model

if TYPE_CHECKING:  # (the evaluator imports this module's Window and mean_over_ranks)
    from training.checkpoint.checkpointer import Checkpointer
    from training.metrics.evaluator import Evaluator

logger = logging.getLogger("training")
Finish = Callable[[dict[str, Any]], None]


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
        pad_last: bool = False,
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
        self.pad_last = pad_last  # the stream's: an epoch's last rows padded, not left out
        self.window = Window()

    def step(self) -> bool:
        """One optimizer step; False when the data ran out."""
        try:
            loss = self.pipeline.progress(self.batches)[0]
        except StopIteration:
            return False
        p, g, n = self.progress, self.batch_size, self.train_rows
        rows = step_rows(p.rows_in_epoch, g, n, self.pad_last)  # the stream's rule
        p.step += 1
        p.samples_seen += rows
        p.rows_in_epoch += rows
        if p.rows_in_epoch + (1 if self.pad_last else g) > n:  # the epoch's rows are done
            p.epoch, p.rows_in_epoch = p.epoch + 1, 0
        self.window.add_loss(p.step, loss)  # no device sync here (see the module docstring)
        self.window.samples += rows
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


def run_schedule(
    loop: TrainLoop,
    trainer: Trainer,
    evaluator: Evaluator,
    checkpointer: Checkpointer,
    monitor: Monitor,
    finish: Finish = lambda record: None,
) -> None:
    """Step to ``loop.total`` (or an early stop), evaluating and checkpointing when due and at
    each new best; then a final evaluation (on the whole validation and test splits, completed
    by ``finish``) and checkpoint unless the last step already had them."""
    progress = loop.progress
    while progress.step < loop.total and loop.step():
        at_end = progress.step >= loop.total
        best = False
        if evaluator.should_evaluate(progress.step, at_end):
            best = evaluate(loop, trainer, evaluator, monitor, at_end, finish)
            loop.window.reset()
        if checkpointer.should_save(progress.step, at_end) or best:
            loop.window.flush()  # a NaN loss since the last log stops training before the save
            with loop.window.excluded():
                checkpointer.save(evaluator.last, best=best)
        if monitor.should_stop:
            if evaluator.rank == 0:
                logger.info("%s", monitor.stop_reason)
            break
    if loop.bar is not None:
        loop.bar.close()
    best = False
    if not (evaluator.evaluated(progress.step) and evaluator.last.get("final")):
        # the data ran out before `total`, or early stopping: the final evaluation, on all rows
        best = evaluate(loop, trainer, evaluator, monitor, True, finish)
    if best or not checkpointer.saved(progress.step):
        checkpointer.save(evaluator.last, best=best)


def evaluate(
    loop: TrainLoop,
    trainer: Trainer,
    evaluator: Evaluator,
    monitor: Monitor,
    final: bool,
    finish: Finish,
) -> bool:
    """One evaluation, counted by ``monitor`` (rank 0's judgement on every rank: a save is
    collective); a final one is completed by ``finish`` and says what the best was. Returns
    whether it is a new best to save (``train.keep_best``)."""
    model = unwrapped_model(loop.pipeline, trainer)
    record = evaluator.measure(model, loop.progress, loop.window, final)
    improved = _agree(monitor, monitor.update(record, final))
    if final:
        record["final"] = True
        if monitor.stop_reason:
            record["stopped_early"] = monitor.stop_reason
        if monitor.keep_best and monitor.best_step is not None:
            record["best"] = monitor.summary(step_dir_name(monitor.best_step))
        finish(record)
    evaluator.record(record)
    return improved and monitor.keep_best


def _agree(monitor: Monitor, improved: bool) -> bool:
    """Rank 0's monitor state and ``improved`` on every rank (each computed the same figures,
    but a save or a stop that one rank decides alone would leave the others waiting)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return improved
    box: list[Any] = [(monitor.state_dict(), monitor.stop_reason, improved)]
    dist.broadcast_object_list(box, src=0)
    state, reason, improved = box[0]
    monitor.load_state_dict(state)  # (clears stop_reason: set after)
    monitor.stop_reason = reason
    return bool(improved)
