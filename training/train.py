"""Train a sharded DLRM: ``torchrun --nproc_per_node=N -m training.train --config <preset>.toml``.

``main()`` parses and reports errors; ``train()`` does the work as a schedule of named pieces:
data -> :func:`~training.trainer.build_trainer` (planner -> DMP with the embedding optimizer
fused into backward) -> :class:`~training.checkpoint.checkpointer.Checkpointer` restore -> the
TorchRec train pipeline stepped by :class:`~training.step_loop.TrainLoop` in
:func:`~training.step_loop.run_schedule`, with the :class:`~training.metrics.evaluator.Evaluator`
(AUC/NE on the validation split), the :class:`~training.metrics.monitor.Monitor` (the best
checkpoint, early stopping: validation) and the checkpointer called when due; the final record
(the test split's figures, the validation split's under ``valid``: training/data/prep.py) gets
the linear baseline's figures (:mod:`training.metrics.baseline`, scored on the test rows) and
the run's warnings (:mod:`training.metrics.advice`). Gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

if __name__ == "__main__":  # a bad config in one line before torch's import (issue 46 item 4)
    from training.config import parse_args as _parse
    from training.launch import check_early, first_run_note

    first_run_note(check_early(_parse))

import datetime
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from recsys_stack import logs
from recsys_stack.net import free_ports
from recsys_stack.progress import progress as progress_bar
from training.checkpoint import interrupt
from training.checkpoint import store as checkpoint
from training.checkpoint.checkpointer import Checkpointer
from training.checkpoint.peers import EXIT_PEER_LOST, lost_peer
from training.checkpoint.peers import message as peer_lost_message
from training.config import Config, RunArgs, config_to_dict, parse_args
from training.data.loader import Arrays, ReadLedger, TrainStream, epoch_order
from training.data.prep import Splits, prepare_data
from training.errors import DataError, RecsysError
from training.metrics import advice
from training.metrics.baseline_search import fit_and_score
from training.metrics.baseline_search import judge as judge_baseline
from training.metrics.evaluator import Evaluator
from training.metrics.log import MetricsLog
from training.metrics.monitor import Monitor
from training.metrics.tb import for_run as scalars_for_run
from training.sharding import format_plan
from training.step_loop import TrainLoop, run_schedule
from training.trainer import Trainer, build_trainer, make_pipeline

logger = logging.getLogger("training")


def setup_distributed(timeout_s: int = 1800) -> tuple[int, int, torch.device]:
    """Join torchrun's process group (a 1-process group when run without torchrun); its
    collectives fail after ``timeout_s`` seconds without the other ranks."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_ports(1)[0]))
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def preflight_checkpoint(args: RunArgs) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint to resume (if any) and its meta, checked against this config's model."""
    resume_from = checkpoint.resolve(args.resume, args.run_dir / "checkpoints")
    meta = checkpoint.read_meta(resume_from) if resume_from else None
    if resume_from and meta:
        checkpoint.check_compatible(resume_from, meta, config_to_dict(args.config)["model"])
    return resume_from, meta


def prepare(args: RunArgs) -> None:
    """``--prepare-only``: everything that can fail on bad input, in one process, no group
    (the batch is checked against the rows of the ``--world-size`` ranks torchrun will start)."""
    preflight_checkpoint(args)
    cfg = args.config
    train_arrays = prepare_data(
        cfg.data, rank=0, progress=args.progress, rows_per_table=cfg.model.rows()
    ).train
    check_batch(cfg.train.batch_size, len(train_arrays), args.world_size)


def check_batch(batch_size: int, train_rows: int, world: int) -> None:
    """DataError, in one line with the setting to change, when ``batch_size`` cannot be split
    over ``world`` ranks or is larger than the training rows (not one step could run): checked
    before any table is built, as a preset made for millions of rows meets a small file."""
    if batch_size % world:
        raise DataError(
            f"train.batch_size = {batch_size} is not divisible by {world} processes; "
            f"set ARGS='--train.batch-size {max(world, batch_size - batch_size % world)}'"
        )
    if train_rows < batch_size:
        raise DataError(
            f"train.batch_size = {batch_size:,} ({batch_size // world:,} rows per rank and step) "
            f"is larger than the {train_rows:,} training rows ({train_rows // world:,} per rank "
            f"on {world} processes): not one step can run; set "
            f"ARGS='--train.batch-size {suggest_batch(train_rows, world)}' (or train on more rows)"
        )


def suggest_batch(train_rows: int, world: int) -> int:
    """A batch that gives at least 8 steps per epoch: the largest power of two <= rows / 8,
    a multiple of ``world`` (at least ``world``)."""
    cap = max(train_rows // 8, 1)
    batch = 1 << int(math.log2(cap))
    return max(world, batch - batch % world)


def train_stream(
    cfg: Config,
    arrays: Arrays,
    progress: checkpoint.Progress,
    rank: int,
    world: int,
    reads: ReadLedger | None = None,
) -> tuple[TrainStream, int]:
    """This rank's batches from where ``progress`` stands (counted in ``reads``), and the step
    to stop at."""
    stream = TrainStream(
        arrays,
        global_batch=cfg.train.batch_size,
        rank=rank,
        world_size=world,
        rows_per_table=cfg.model.rows(),
        seed=cfg.train.seed,
        epochs=cfg.train.epochs,
        start_epoch=progress.epoch,
        start_row=progress.rows_in_epoch,
        reads=reads,
    )
    if stream.steps_per_epoch == 0:
        raise DataError(
            f"{len(arrays)} training rows cannot fill one global batch of {cfg.train.batch_size}"
        )
    total = cfg.train.epochs * stream.steps_per_epoch
    if cfg.train.max_steps:
        total = min(total, cfg.train.max_steps)
    return stream, total


def open_logs(run_dir: Path, cfg: Config, step: int, rank: int) -> tuple[MetricsLog, MetricsLog]:
    """``metrics.jsonl`` and ``train_loss.jsonl`` (and their TensorBoard scalars) cut back to
    ``step`` (a resumed run redoes what came after its checkpoint), and ``config.json``."""
    tb = scalars_for_run(run_dir, rank, step)  # TensorBoard: RUN/tb/ (training.metrics.tb)
    metrics_log = MetricsLog(run_dir / "metrics.jsonl", enabled=rank == 0, tb=tb, tb_prefix="eval")
    loss_log = MetricsLog(run_dir / "train_loss.jsonl", enabled=rank == 0, tb=tb, tb_prefix="train")
    metrics_log.truncate_after(step)
    loss_log.truncate_after(step)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
    return metrics_log, loss_log


def make_loop(
    cfg: Config,
    trainer: Trainer,
    device: torch.device,
    stream: TrainStream,
    progress: checkpoint.Progress,
    total: int,
    loss_log: MetricsLog,
    show_bar: bool,
) -> TrainLoop:
    """The configured TorchRec pipeline over ``stream``, stepped up to ``total`` with a bar."""
    bar = progress_bar(
        total=total,
        initial=progress.step,
        disable=not show_bar,
        unit="step",
        dynamic_ncols=True,
        desc="train",
    )
    return TrainLoop(
        make_pipeline(cfg.train.pipeline, trainer, device),
        iter(stream),
        progress,
        batch_size=cfg.train.batch_size,
        train_rows=len(stream.arrays),
        total=total,
        log_every=cfg.train.log_every,
        loss_log=loss_log,
        bar=bar,
        pad_last=stream.pad_last,
    )


def train(args: RunArgs, rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """Run (or resume) training; returns the last evaluation record.

    Data -> trainer -> restore (``--resume``) -> :func:`run_schedule` -> learning curves.
    """
    cfg, run_dir = args.config, args.run_dir
    if cfg.train.batch_size % world:  # before rank 0 prepares the data
        check_batch(cfg.train.batch_size, cfg.train.batch_size, world)
    resume_from, meta = preflight_checkpoint(args)
    splits = prepare_data(cfg.data, rank, progress=args.progress, rows_per_table=cfg.model.rows())
    train_arrays, data_info = splits.train, splits.info
    check_batch(cfg.train.batch_size, len(train_arrays), world)  # before the tables are built
    trainer = build_trainer(cfg, device)
    if rank == 0:  # 26 lines at the demo shape: the summary by default, the plan with -v
        tables, plan = len(cfg.model.rows()), format_plan(trainer.plan)
        logger.info("sharding plan: %d tables on %d ranks (%s); -v prints it", tables, world,
                    device.type)  # fmt: skip
        logger.debug("sharding plan (%d ranks, %s):\n%s", world, device.type, plan)
    progress = checkpoint.Progress()
    run_meta = {
        "config": config_to_dict(cfg),
        "world_size": world,
        "data": data_info,
        "versions": {"torch": torch.__version__},
    }
    reads = ReadLedger(rank)
    monitor = Monitor.from_config(cfg.train)
    checkpointer = Checkpointer(
        run_dir / "checkpoints", trainer, progress, cfg, run_meta, reads, monitor
    )
    if resume_from is not None:
        assert meta is not None
        checkpointer.restore(resume_from, meta, rank)
    else:
        checkpointer.forget_best(rank)

    stream, total = train_stream(cfg, train_arrays, progress, rank, world, reads)
    metrics_log, loss_log = open_logs(run_dir, cfg, progress.step, rank)
    evaluator = Evaluator(cfg, splits.valid, metrics_log, rank, world, test=splits.test)
    show_bar = rank == 0 and args.progress
    loop = make_loop(cfg, trainer, device, stream, progress, total, loss_log, show_bar)

    def finish(record: dict[str, Any]) -> None:  # the final record, before it is written
        record["splits"] = data_info["splits"]  # the rows of each split (training/data/prep.py)
        if cfg.baseline.enabled and rank == 0:
            record.update(fit_baseline(cfg, stream, progress.step, splits, evaluator.scored))
        seen = advice.diagnose(evaluator.history, record, len(train_arrays))
        remedy = advice.remedy(seen, record, cfg, run_dir)
        warnings = advice.run_warnings(seen, record, cfg, run_dir)
        warnings += judge_baseline(record, remedy)
        if warnings:
            record["warnings"] = warnings

    run_schedule(loop, trainer, evaluator, checkpointer, monitor, finish)
    if rank == 0:
        from training.metrics.plot import plot_run

        logger.info("training rows read by each rank: %s", format_reads(checkpointer.reads))
        logger.info("learning curves: %s", plot_run(run_dir))
        for line in end_lines(evaluator.last, run_dir, cfg):  # last: what a user reads
            logger.info("%s", line)
        for warning in evaluator.last.get("warnings", []):
            logger.warning("%s", warning)
    return evaluator.last


def fit_baseline(
    cfg: Config, stream: TrainStream, steps: int, splits: Splits, scored: list[Any]
) -> dict[str, Any]:
    """The baselines (:mod:`training.metrics.baseline_search`) fitted on the rows the model
    trained on (the first epoch's order, as far as ``steps`` went; later epochs reread them),
    tuned on the validation rows, scored on the test rows, against the model's ``scored``
    ``[(labels, probs)]`` on them."""
    arrays = stream.arrays
    assert isinstance(arrays, Arrays), (
        "a batch run reads one dataset (rows are joined only by the continuous loop)"
    )
    rows = min(min(steps, stream.steps_per_epoch) * stream.global_batch, len(arrays))
    order = epoch_order(len(arrays), cfg.train.seed, 0)[:rows]
    paired = scored[0] if scored else None  # the model's test scores, for the paired test
    return fit_and_score(arrays, order, splits.valid, splits.test, cfg.baseline, paired)


def end_lines(final: dict[str, Any], run_dir: Path, cfg: Config) -> list[str]:
    """What the end of a run says beside its final record: an early stop and why, and the
    best checkpoint when it is not the last (with the command that exports it)."""
    lines = [final["stopped_early"]] if final.get("stopped_early") else []
    best = final.get("best") or {}
    if best.get("step") not in (None, final.get("step")):
        metric, valid = best["monitor"], final.get("valid") or final
        last = valid.get(f"subset_{metric}", valid.get(metric, math.nan))
        lines.append(
            f"best checkpoint: {run_dir / 'checkpoints' / best['checkpoint']} (validation "
            f"{metric.upper()} {best['value']:.4f} at step {best['step']}; the last, step "
            f"{final['step']}: {last:.4f}, on the same rows); export it: make export "
            f"PRESET={cfg.name} RUN={run_dir} CHECKPOINT=best"
        )
    return lines


def format_reads(reads: list[dict[str, Any]]) -> str:
    """``rank 0 (host a, torchrun node 0): 3,840, ...``: meta's ``reads``, one rank after another."""
    return ", ".join(
        f"rank {r['rank']} (host {r['host']}, torchrun node {r['node']}): {r['rows']:,}"
        for r in reads
    )


def configure_logging(rank: int, verbose: bool) -> None:
    """Our INFO logs on rank 0, WARNING on the others; the libraries' noise only if verbose
    (the one list of what is silenced: :mod:`recsys_stack.logs`)."""
    logs.configure(logging.INFO if rank == 0 else logging.WARNING, verbose=verbose)


def main(argv: Sequence[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    configure_logging(rank, verbose=logs.verbose_requested())
    interrupt.install()
    args: RunArgs | None = None
    try:
        args = parse_args(argv)
        return run(args, rank)
    except KeyboardInterrupt:  # Ctrl-C: one line from rank 0 (training.checkpoint.interrupt)
        if rank == 0 and args is not None:
            lead = "\n" if args.progress and sys.stderr.isatty() else ""  # after the bar's line
            print(f"{lead}error: {interrupt.message(args.config, args.run_dir)}", file=sys.stderr)
        return interrupt.EXIT_INTERRUPTED
    except RecsysError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2


def run(args: RunArgs, rank: int) -> int:
    """``--prepare-only`` or the training; a lost peer said in one line
    (training.checkpoint.peers)."""
    try:
        if args.prepare_only:
            prepare(args)
            return 0
        rank, world, device = setup_distributed(args.config.train.collective_timeout)
        final = train(args, rank, world, device)
        if rank == 0:
            print(json.dumps({"final": final, "run_dir": str(args.run_dir)}))
        return 0
    except (Exception, CheckpointException) as e:
        if interrupt.received():  # a peer exiting on the same Ctrl-C closed its connections
            raise KeyboardInterrupt from None
        if isinstance(e, RecsysError):
            raise
        reason = lost_peer(e)
        if reason is None:
            raise
        line = peer_lost_message(reason, args.run_dir, args.config.train.collective_timeout)
        print(f"error: {line}", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
