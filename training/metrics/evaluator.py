"""Held-out evaluation during training: AUC, NE (and oracle AUC on synthetic data).

:class:`Evaluator` decides when (``should_evaluate``) and records what (``evaluate``): every
``train.eval_every`` steps on the first ``train.eval_rows`` **validation** rows, and at the end
on all of them and on the **test** rows (training/data/prep.py), each record appended to
``metrics.jsonl`` with the training window's loss and rate and the split its figures are of
(``"split": "valid"`` or ``"test"``). The final record's ``auc``, ``auc_ci``, ``ne``, ... are
the test rows' (the report: no decision saw them); its ``valid`` holds the validation rows'
figures (with ``subset_*`` on the periodic rows), which the monitor compares
(:mod:`training.metrics.monitor`): every choice of the run is made on validation.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from training.checkpoint.store import Progress
from training.config import Config
from training.data.loader import Arrays, eval_batches
from training.metrics.log import EvalMetrics, MetricsLog, read_metrics
from training.metrics.window import Window, mean_over_ranks

logger = logging.getLogger("training")


def evaluate(
    model: nn.Module, arrays: Arrays, cfg: Config, rank: int, world: int, prefix: int = 0,
    keep: list[Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """AUC, NE (and oracle AUC on synthetic data) over ``arrays``, gathered over all ranks
    (and over its first ``prefix`` rows: :meth:`EvalMetrics.compute`); ``keep`` gets the
    ``(labels, probs)`` scored, in ``arrays``' order (a paired comparison's other half)."""
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
    out = metrics.compute(prefix)
    if keep is not None:
        keep.append(metrics.scored)
    return out


def _figures(out: dict[str, Any]) -> dict[str, Any]:
    """``out`` with ``auc_vs_oracle`` (the AUC's share of the true probabilities') when known."""
    if "oracle_auc" in out:
        out["auc_vs_oracle"] = out["auc"] / out["oracle_auc"]
    return out


class Evaluator:
    """Periodic evaluations on a prefix of the validation split; the final one on all of it
    and on the test split (``test``; None: the final is the validation rows' alone)."""

    def __init__(
        self, cfg: Config, valid: Arrays, log: MetricsLog, rank: int, world: int,
        test: Arrays | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.log, self.rank, self.world = cfg, log, rank, world
        self.every = cfg.train.eval_every
        self.valid, self.test = valid, test
        rows = cfg.train.eval_rows
        self.subset = valid.rows(0, rows) if rows else valid
        self.last: dict[str, Any] = {}  # the latest record (empty before the first)
        self.scored: list[Any] = []  # [(labels, probs)] of the final evaluation's report rows
        # this run's records so far (a resumed run's, as metrics.jsonl kept them): the advice
        # at its end reads the validation history (training.metrics.advice)
        self.history = read_metrics(log.path) if log.enabled and log.path.is_file() else []

    @property
    def report(self) -> Arrays:
        """The rows the final record's figures are of: test (validation without a test split)."""
        return self.valid if self.test is None else self.test

    def should_evaluate(self, step: int, at_end: bool) -> bool:
        return bool(self.every and step % self.every == 0) or at_end

    def evaluated(self, step: int) -> bool:
        """Whether the latest record is of ``step``."""
        return bool(self.last) and self.last.get("step") == step

    def evaluate(
        self, model: nn.Module, progress: Progress, window: Window, final: bool
    ) -> dict[str, Any]:
        """:meth:`measure`, then :meth:`record` (collective: every rank calls it)."""
        return self.record(self.measure(model, progress, window, final))

    def measure(
        self, model: nn.Module, progress: Progress, window: Window, final: bool
    ) -> dict[str, Any]:
        """One record, not written yet: where training stands, its window's loss and rate,
        the eval metrics (a final one's also on the periodic rows: ``subset_*``; with a test
        split, the test rows' figures and the validation rows' under ``valid``)."""
        w = window
        record: dict[str, Any] = {
            "step": progress.step,
            "epoch": progress.epoch,
            "samples_seen": progress.samples_seen,
            "samples_per_sec": round(w.samples_per_sec() or 0.0, 1) or None,
            "train_loss": mean_over_ranks(w.loss_sum / w.steps) if w.steps else None,
        }
        if self.last.get("step") == progress.step:  # a final evaluation after an early stop
            for key in ("samples_per_sec", "train_loss"):  # the window is the periodic one's
                record[key] = self.last.get(key)
        self.scored = []  # the final evaluation's report rows, for the baseline's paired test
        args = (self.cfg, self.rank, self.world)
        if not final:
            record.update(_figures(evaluate(model, self.subset, *args)), split="valid")
            return record
        keep = self.scored if self.test is None else None
        valid = _figures(evaluate(model, self.valid, *args, len(self.subset), keep))
        if self.test is None:
            return {**record, **valid, "split": "valid"}
        test = _figures(evaluate(model, self.test, *args, 0, self.scored))
        return {**record, **test, "split": "test", "valid": valid}

    def record(self, record: dict[str, Any]) -> dict[str, Any]:
        """Write ``record`` (``metrics.jsonl``, TensorBoard), log it and keep it as ``last``;
        a record of a step already written (a final evaluation after an early stop's periodic
        one) replaces it in ``metrics.jsonl``."""
        if self.last.get("step") == record["step"]:
            self.log.truncate_after(record["step"] - 1)
        self.log.write(record)
        self.history = [r for r in self.history if r.get("step") != record["step"]] + [record]
        if self.rank == 0:
            rounded = {  # the warnings are said on lines of their own at the end
                k: round(v, 4) if isinstance(v, float) else v
                for k, v in record.items()
                if k not in ("warnings", "stopped_early")
            }
            logger.info("eval %s", rounded)
        self.last = record
        return record
