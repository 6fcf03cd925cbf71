"""Benchmark: the trainer's step vs the raw DMP step vs a plain PyTorch DLRM, in one process.

``python -m training.bench`` (``make bench ARGS=...``) measures samples/s of:

* **trainer**: the full training path: ``TrainStream`` reads the binary shards and builds each
  KJT, the configured TorchRec train pipeline (``make_pipeline``) runs DMP with the embedding
  optimizer fused into backward, and the loop does what ``train()``'s loop does per step
  (the loss kept on the device in the loss window) and every ``log_every`` steps (the losses
  read in one sync and checked, the all-reduced mean loss, a ``train_loss.jsonl`` record, the
  progress-bar rate).
* **ceiling**: a second trainer built from the same config, stepped by hand on batches built
  once in memory with ``make_batch``: ``zero_grad; loss = model(batch); backward; step``.
* **plain**: 26 ``nn.EmbeddingBag(sparse=True)`` tables, the same MLPs and DLRM dot
  interaction, ``torch.optim.Adagrad`` on the same prebuilt batches.

Why not call the real ``train()``: its ``samples_per_sec`` spans a whole eval window, so it
would include the pipeline's fill and the first steps, and every call builds a new trainer
(seconds to minutes with Criteo-sized tables) and runs an evaluation and a checkpoint we do
not time. Round-robin interleaving (all three methods in every round, so machine noise hits
them alike) needs three long-lived steppers instead. The trainer stepper therefore reuses the
real pieces (``build_trainer``, ``make_pipeline``, ``TrainStream``) and calls the very
``TrainLoop.step`` that ``train()`` runs, bookkeeping included.

The steppers are in :mod:`training.bench.steppers`; this module measures and reports.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from recsys_stack import config as shared
from recsys_stack import logs
from recsys_stack.progress import progress as progress_bar
from training.bench.options import build_parser
from training.bench.steppers import CeilingStepper, PlainStepper, TrainerStepper
from training.config import Config, load_config
from training.data.loader import make_batch
from training.data.prep import prepare_data
from training.errors import ConfigError, DataError, RecsysError
from training.train import setup_distributed

logger = logging.getLogger("training.bench")

METHODS = ("trainer", "ceiling", "plain")
NOISY_SPREAD = 0.15  # warn when a method's rounds differ by more than this fraction
# 26 tables of the criteo-kaggle preset capped at 500k rows: 3.1M rows x 16 x fp32 ~ 0.2 GB per
# model copy (three copies plus optimizer state ~ 1.2 GB); init takes seconds on 2 cores.


def measure(stepper: Any, steps: int, warmup: int, desc: str, progress: bool) -> list[float]:
    """Seconds of each of ``steps`` timed steps, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        stepper.step()
    times = []
    bar = progress_bar(range(steps), desc=desc, unit="step", leave=False, disable=not progress)
    for _ in bar:
        t0 = time.perf_counter()
        stepper.step()
        times.append(time.perf_counter() - t0)
        if getattr(stepper, "bar_postfix", None):
            bar.set_postfix(stepper.bar_postfix, refresh=False)
    return times


def bench_config(args: argparse.Namespace, extra: Sequence[str] = ()) -> Config:
    """The preset with rows capped at ``--max-rows``, the bench batch and synthetic data; then
    the config flags and ``section.key=value`` overrides of the command line, then ``extra``."""
    preset = load_config(args.config)
    rows = [min(r, args.max_rows) for r in preset.model.rows()]
    overrides = [
        f"model.num_embeddings={json.dumps(rows)}",
        f"train.batch_size={args.batch_size}",
        f'train.pipeline="{args.pipeline}"',
        f"data.synthetic_rows={args.synthetic_rows}",
        f"data.synthetic_vocab={args.synthetic_vocab}",
        f"data.cache_dir={json.dumps(str(args.cache_dir))}",
        f"data.synthetic_dir={json.dumps(str(args.synthetic_dir))}",
        'data.path=""',
        *shared.overrides_from(args),
        *extra,
    ]
    return load_config(args.config, overrides)


def _summary(times_per_round: list[list[float]], batch: int) -> dict[str, Any]:
    rates = [batch * len(t) / sum(t) for t in times_per_round]
    all_times = [x for t in times_per_round for x in t]
    return {
        "samples_per_sec": statistics.median(rates),
        "samples_per_sec_rounds": rates,
        "p50_step_ms": 1000 * statistics.median(all_times),
        "steps": len(all_times),
        "step_ms_rounds": [[round(1000 * x, 2) for x in t] for t in times_per_round],
    }


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Build the steppers, measure them round-robin, return figures and ratios."""
    cfg = bench_config(args)  # config errors before any work
    ccfg = bench_config(args, ["train.compile_dense=true"]) if args.compile_dense else None
    torch.set_num_threads(args.threads)
    _, world, device = setup_distributed()
    if world != 1:
        raise ConfigError(
            f"training.bench runs in one process, not {world}: run it without torchrun"
        )
    splits = prepare_data(cfg.data, rank=0, progress=args.progress, rows_per_table=cfg.model.rows())
    train_arrays, data_info = splits.train, splits.info
    batch = cfg.train.batch_size
    if len(train_arrays) < batch:
        raise DataError(f"{len(train_arrays)} training rows cannot fill one batch of {batch}")
    rng = np.random.default_rng(cfg.train.seed)
    rows_per_table = np.asarray(cfg.model.rows(), dtype=np.int64)
    prebuilt = [
        make_batch(
            train_arrays,
            np.sort(rng.choice(len(train_arrays), batch, replace=False)),
            rows_per_table,
        ).batch
        for _ in range(args.prebuilt)
    ]
    per_method = args.repeats * (args.warmup + args.steps) + 4
    t0 = time.perf_counter()
    steppers: dict[str, Any] = {
        "trainer": TrainerStepper(cfg, train_arrays, device, per_method),
        "ceiling": CeilingStepper(cfg, prebuilt, device),
        "plain": PlainStepper(cfg, prebuilt),
    }
    if ccfg is not None:
        steppers["trainer_compiled"] = TrainerStepper(ccfg, train_arrays, device, per_method)
    logger.info("built %d models in %.1f s", len(steppers), time.perf_counter() - t0)

    times: dict[str, list[list[float]]] = {name: [] for name in steppers}
    for r in range(args.repeats):
        for name, stepper in steppers.items():
            desc = f"round {r + 1}/{args.repeats} {name}"
            times[name].append(measure(stepper, args.steps, args.warmup, desc, args.progress))
    methods = {name: _summary(t, batch) for name, t in times.items()}
    rate = {name: m["samples_per_sec"] for name, m in methods.items()}
    ratios = {
        "trainer/ceiling": rate["trainer"] / rate["ceiling"],
        "trainer/plain": rate["trainer"] / rate["plain"],
        "ceiling/plain": rate["ceiling"] / rate["plain"],
    }
    if "trainer_compiled" in rate:
        ratios["trainer_compiled/ceiling"] = rate["trainer_compiled"] / rate["ceiling"]
        ratios["trainer_compiled/trainer"] = rate["trainer_compiled"] / rate["trainer"]
    return {
        "methods": methods,
        "ratios": ratios,
        "setup": {
            "config": str(args.config),
            "batch_size": batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "threads": torch.get_num_threads(),
            "pipeline": cfg.train.pipeline,
            "num_embeddings": cfg.model.rows(),
            "embedding_dim": cfg.model.embedding_dim,
            "dense_arch": cfg.model.dense_arch,
            "over_arch": cfg.model.over_arch,
            "train_rows": len(train_arrays),
            "data": data_info["binary"],
            "sharding": sorted(
                {
                    (p["sharding_type"], p["compute_kernel"])
                    for p in steppers["ceiling"].trainer.plan
                }
            ),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
        },
    }


def format_report(result: dict[str, Any]) -> str:
    """The figures as a text table plus the two target lines."""
    methods, ratios = result["methods"], result["ratios"]
    ceiling = methods["ceiling"]["samples_per_sec"]
    head = f"{'method':<17} {'samples/s':>11} {'p50 step ms':>12} {'vs ceiling':>11}"
    lines = [head, "-" * len(head)]
    for name, m in methods.items():
        lines.append(
            f"{name:<17} {m['samples_per_sec']:>11,.0f} {m['p50_step_ms']:>12.2f} "
            f"{m['samples_per_sec'] / ceiling:>11.2f}"
        )
    lines.append("")
    lines.append(f"trainer / ceiling = {ratios['trainer/ceiling']:.2f} (target >= 0.90)")
    lines.append(f"trainer / plain PyTorch = {ratios['trainer/plain']:.2f} (target > 1)")
    if "trainer_compiled/trainer" in ratios:
        lines.append(f"trainer_compiled / trainer = {ratios['trainer_compiled/trainer']:.2f}")
    spread = {
        name: (max(r) - min(r)) / statistics.median(r)
        for name, m in methods.items()
        if len(r := m["samples_per_sec_rounds"]) > 1
    }
    noisy = {name: v for name, v in spread.items() if v > NOISY_SPREAD}
    if noisy:
        worst = ", ".join(f"{name} {v:.0%}" for name, v in noisy.items())
        lines.append(
            f"warning: rounds disagree (max-min over median: {worst}); other processes were "
            "probably competing for the cores: rerun on a quiet machine or with more --repeats"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    logs.configure()
    args = build_parser().parse_intermixed_args(argv)
    try:
        result = run_bench(args)
    except RecsysError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(format_report(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
