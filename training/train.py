"""Train a sharded DLRM: ``torchrun --nproc_per_node=N -m training.train --config <preset>.toml``.

``main()`` parses and reports errors; ``train()`` does the work: data -> planner -> DMP with
the embedding optimizer fused into backward -> TorchRec train pipeline -> periodic AUC/NE
evaluation and sharded checkpoints. Gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from training import checkpoint
from training.config import Config, RunArgs, config_to_dict, parse_args
from training.data_prep import prepare_data
from training.errors import DataError, RecsysError
from training.features import SPARSE_NAMES, table_name
from training.loader import Arrays, TrainStream, eval_batches
from training.loop import TrainLoop, mean_over_ranks
from training.metrics import EvalMetrics, MetricsLog
from training.model import build_train_model
from training.sharding import format_plan, make_plan, plan_summary, sharders

logger = logging.getLogger("training")


def setup_distributed() -> tuple[int, int, torch.device]:
    """Join torchrun's process group (a 1-process group when run without torchrun)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size(), device


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _embedding_optimizer(name: str) -> type[torch.optim.Optimizer]:
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    return {
        "rowwise_adagrad": RowWiseAdagrad,
        "adagrad": torch.optim.Adagrad,
        "sgd": torch.optim.SGD,
        "adam": torch.optim.Adam,
    }[name]


def _dense_optimizer(name: str) -> Callable[..., torch.optim.Optimizer]:
    return {"adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[name]


@dataclass
class Trainer:
    """The sharded model, its combined optimizer and the plan it was built with."""

    model: nn.Module  # DistributedModelParallel(DLRMTrain)
    optimizer: Any  # CombinedOptimizer(fused embedding optimizer, dense optimizer)
    plan: list[dict[str, Any]]

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}


def build_trainer(cfg: Config, device: torch.device) -> Trainer:
    """DLRMTrain on meta -> fused optimizer in backward -> planner -> DMP -> combined optimizer."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(cfg.train.seed)
    model = build_train_model(cfg.model, device="meta")
    if cfg.train.compile_dense:
        dlrm = model.model
        dlrm.dense_arch = torch.compile(dlrm.dense_arch)  # type: ignore[assignment]
        dlrm.over_arch = torch.compile(dlrm.over_arch)  # type: ignore[assignment]
    apply_optimizer_in_backward(
        _embedding_optimizer(cfg.optim.embedding),
        model.model.sparse_arch.parameters(),
        {"lr": cfg.optim.embedding_lr},
    )
    module_sharders = sharders()
    tables = [table_name(f) for f in SPARSE_NAMES]
    plan = make_plan(model, cfg.sharding, tables, device, module_sharders)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=module_sharders)
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense_cls = _dense_optimizer(cfg.optim.dense)
    dense_opt = KeyedOptimizerWrapper(dense_params, lambda ps: dense_cls(ps, lr=cfg.optim.dense_lr))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense_opt])
    return Trainer(model=dmp, optimizer=optimizer, plan=plan_summary(plan))


def make_pipeline(kind: str, trainer: Trainer, device: torch.device) -> Any:
    """``sparse_dist`` overlaps batch i+1's input all-to-all with batch i's compute."""
    from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

    cls = TrainPipelineSparseDist if kind == "sparse_dist" else TrainPipelineBase
    return cls(trainer.model, trainer.optimizer, device)


def evaluate(
    model: nn.Module, arrays: Arrays, cfg: Config, rank: int, world: int
) -> dict[str, float]:
    """AUC, NE (and oracle AUC on synthetic data) over ``arrays``, gathered over all ranks."""
    local_batch = cfg.train.batch_size // world
    metrics = EvalMetrics(local_batch, with_oracle=arrays.prob is not None)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for mb in eval_batches(
            arrays,
            batch_size=local_batch,
            rank=rank,
            world_size=world,
            rows_per_table=cfg.model.rows(),
        ):
            batch = mb.batch.to(next(model.parameters()).device)
            _, (_, logits, labels) = model(batch)
            metrics.update(torch.sigmoid(logits.float().cpu()), labels.cpu(), mb.weights, mb.prob)
    model.train(was_training)
    return metrics.compute()


def preflight_checkpoint(args: RunArgs) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint to resume (if any) and its meta, checked against this config's model."""
    resume_from = checkpoint.resolve(args.resume, args.run_dir / "checkpoints")
    meta = checkpoint.read_meta(resume_from) if resume_from else None
    if resume_from and meta:
        checkpoint.check_compatible(resume_from, meta, config_to_dict(args.config)["model"])
    return resume_from, meta


def prepare(args: RunArgs) -> None:
    """``--prepare-only``: everything that can fail on bad input, in one process, no group."""
    preflight_checkpoint(args)
    prepare_data(args.config.data, rank=0, progress=args.progress)


def train(args: RunArgs, rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """Run (or resume) training; returns the last evaluation record."""
    cfg, run_dir = args.config, args.run_dir
    if cfg.train.batch_size % world:
        raise DataError(
            f"train.batch_size = {cfg.train.batch_size} is not divisible by {world} processes"
        )
    ckpt_root = run_dir / "checkpoints"
    resume_from, meta = preflight_checkpoint(args)
    train_arrays, eval_arrays, data_info = prepare_data(cfg.data, rank, progress=args.progress)
    # Periodic evals may use a prefix of the eval split; the final one always uses all of it.
    eval_subset = eval_arrays.rows(0, cfg.train.eval_rows) if cfg.train.eval_rows else eval_arrays

    trainer = build_trainer(cfg, device)
    if rank == 0:
        logger.info(
            "sharding plan (%d ranks, %s):\n%s", world, device.type, format_plan(trainer.plan)
        )

    progress = checkpoint.Progress()
    last_saved = -1
    if resume_from is not None:
        rows = {table_name(f): r for f, r in zip(SPARSE_NAMES, cfg.model.rows(), strict=True)}
        state, skipped = checkpoint.load(resume_from, trainer.state(), rows)
        trainer.model.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optim"])
        assert meta is not None
        progress = checkpoint.Progress(**meta["progress"])
        if resume_from.parent == ckpt_root:
            last_saved = progress.step
        if rank == 0:
            logger.info(
                "resumed from %s at step %d (epoch %d)", resume_from, progress.step, progress.epoch
            )
            if skipped:
                logger.warning(
                    "optimizer state not restored (its sharding kind changed): %s", skipped
                )

    stream = TrainStream(
        train_arrays,
        global_batch=cfg.train.batch_size,
        rank=rank,
        world_size=world,
        rows_per_table=cfg.model.rows(),
        seed=cfg.train.seed,
        epochs=cfg.train.epochs,
        start_epoch=progress.epoch,
        start_row=progress.rows_in_epoch,
    )
    if stream.steps_per_epoch == 0:
        raise DataError(
            f"{len(train_arrays)} training rows cannot fill one global batch of {cfg.train.batch_size}"
        )
    total = cfg.train.epochs * stream.steps_per_epoch
    if cfg.train.max_steps:
        total = min(total, cfg.train.max_steps)

    metrics_log = MetricsLog(run_dir / "metrics.jsonl", enabled=rank == 0)
    loss_log = MetricsLog(run_dir / "train_loss.jsonl", enabled=rank == 0)
    metrics_log.truncate_after(progress.step)
    loss_log.truncate_after(progress.step)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))

    ckpt_meta = {
        "config": config_to_dict(cfg),
        "world_size": world,
        "data": data_info,
        "versions": {"torch": torch.__version__},
    }

    def save() -> None:
        nonlocal last_saved
        checkpoint.save(
            ckpt_root,
            progress,
            trainer.state(),
            {**ckpt_meta, "metrics": last_eval},
            trainer.plan,
            cfg.train.keep_last,
        )
        last_saved = progress.step

    def run_eval(final: bool) -> dict[str, Any]:
        model = pipeline.detach() if hasattr(pipeline, "detach") else trainer.model
        w = loop.window
        record: dict[str, Any] = {
            "step": progress.step,
            "epoch": progress.epoch,
            "samples_seen": progress.samples_seen,
            "samples_per_sec": round(w.samples_per_sec() or 0.0, 1) or None,
            "train_loss": mean_over_ranks(w.loss_sum / w.steps) if w.steps else None,
        }
        record.update(evaluate(model, eval_arrays if final else eval_subset, cfg, rank, world))
        if "oracle_auc" in record:
            record["auc_vs_oracle"] = record["auc"] / record["oracle_auc"]
        metrics_log.write(record)
        if rank == 0:
            rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}
            logger.info("eval %s", rounded)
        return record

    pipeline = make_pipeline(cfg.train.pipeline, trainer, device)
    last_eval: dict[str, Any] = {}
    bar = tqdm(
        total=total,
        initial=progress.step,
        disable=rank != 0 or not args.progress,
        unit="step",
        dynamic_ncols=True,
        desc="train",
    )
    loop = TrainLoop(
        pipeline,
        iter(stream),
        progress,
        batch_size=cfg.train.batch_size,
        train_rows=len(train_arrays),
        total=total,
        log_every=cfg.train.log_every,
        loss_log=loss_log,
        bar=bar,
    )
    t = cfg.train
    while progress.step < total and loop.step():
        at_end = progress.step >= total
        if (t.eval_every and progress.step % t.eval_every == 0) or at_end:
            last_eval = run_eval(final=at_end)
            loop.window.reset()
        if (t.checkpoint_every and progress.step % t.checkpoint_every == 0) or at_end:
            t_save = time.perf_counter()
            save()
            loop.window.exclude(time.perf_counter() - t_save)
    bar.close()
    if not last_eval or last_eval.get("step") != progress.step:
        last_eval = run_eval(final=True)
    if last_saved != progress.step:
        save()
    if rank == 0:
        from training.plot import plot_run

        logger.info("learning curves: %s", plot_run(run_dir))
    return last_eval


_LIBRARIES = re.compile(r"[/\\](torch|torchrec|fbgemm_gpu)[/\\]")


def _quiet_libraries(record: logging.LogRecord) -> bool:
    """Drop library records below ERROR (TorchRec logs per table and per rank, some via root)."""
    return record.levelno >= logging.ERROR or not _LIBRARIES.search(record.pathname)


def configure_logging(rank: int, verbose: bool) -> None:
    """Our INFO logs on rank 0; the libraries' warnings (many per rank and step) only if verbose."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,  # torchrec configures the root logger at import
    )
    if not verbose:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_quiet_libraries)
        logging.getLogger("torch").setLevel(logging.ERROR)  # torch._logging has its own handler
        warnings.filterwarnings("ignore", module=r"(torch|torchrec|fbgemm_gpu)(\.|$)")


def main(argv: Sequence[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    configure_logging(rank, verbose=os.environ.get("RECSYS_VERBOSE", "") not in ("", "0"))
    try:
        args = parse_args(argv)
        if args.prepare_only:
            prepare(args)
            return 0
        rank, world, device = setup_distributed()
        final = train(args, rank, world, device)
        if rank == 0:
            print(json.dumps({"final": final, "run_dir": str(args.run_dir)}))
        return 0
    except RecsysError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
