"""Keeping the best checkpoint and stopping early: the monitor's rules, the ``best`` pointer
(kept by pruning, taken by ``--resume`` and export's ``--checkpoint``), and the schedule driving
real DCP saves in this process, with scripted evaluation figures in place of a model's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.training.test_units import _fake_complete as _complete  # a step dir, as DCP leaves it
from training.checkpoint import store
from training.checkpoint.checkpointer import Checkpointer
from training.config import load_config
from training.data.loader import Arrays
from training.errors import CheckpointError, ConfigError
from training.export.scorer import resolve_checkpoint
from training.features import NUM_DENSE, NUM_SPARSE
from training.metrics import evaluator as evaluator_module
from training.metrics.evaluator import Evaluator
from training.metrics.log import MetricsLog, read_metrics
from training.metrics.monitor import Monitor
from training.step_loop import TrainLoop, run_schedule
from training.train import end_lines

TINY = "training/configs/tiny.toml"


def test_the_monitor_keeps_the_best_and_counts_patience() -> None:
    m = Monitor("auc", patience=2, min_delta=0.01)
    steps = {10: 0.70, 20: 0.705, 30: 0.71, 40: 0.69}  # +0.005: a best, not progress enough
    assert [m.update({"step": s, "auc": v}) for s, v in steps.items()] == [True, True, True, False]
    assert (m.best_step, m.best_value) == (30, 0.71)
    assert m.should_stop and m.stop_reason.startswith("early stopping at step 30: 2 evaluations")
    assert "bettering 0.7000 by more than 0.01" in m.stop_reason
    ne = Monitor("ne")  # lower is better; the periodic rows' figure wins over all rows'
    assert ne.update({"step": 1, "ne": 0.9}) and not ne.update({"step": 2, "ne": 0.95})
    assert ne.update({"step": 3, "ne": 0.95, "subset_ne": 0.85}) and ne.best_step == 3
    assert not ne.update({"step": 4, "ne": float("nan")}) and not ne.should_stop  # no patience
    final = Monitor("auc", patience=1)
    final.update({"step": 1, "auc": 0.7})
    final.update({"step": 2, "auc": 0.6}, final=True)  # the end of the run: nothing to stop
    assert not final.should_stop
    again = Monitor("auc", patience=2)
    again.load_state_dict(m.state_dict())
    assert (again.best_step, again.best_value, again.waited) == (30, 0.71, 3)
    other = Monitor("ne")
    other.load_state_dict(m.state_dict())  # of another metric: starts afresh
    assert other.best_step is None


def test_pruning_keeps_what_best_names_and_resume_and_export_take_it(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for s in (1, 2, 3, 4):
        _complete(root, s)
    (root / store.LATEST).write_text("step_00000004\n")
    with pytest.raises(CheckpointError, match="has no 'best' checkpoint"):
        store.resolve("best", root)
    store.set_best(root, 2)
    store._prune(root, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["best", "latest", "step_00000002",
                                                      "step_00000004"]  # fmt: skip
    assert store.resolve("best", root) == root / "step_00000002"
    assert store.resolve("latest", root) == root / "step_00000004"
    assert resolve_checkpoint(tmp_path, Path("best")) == root / "step_00000002"
    with pytest.raises(ConfigError, match="give --run-dir too"):
        resolve_checkpoint(None, Path("best"))
    store.set_best(root, None)
    store._prune(root, keep_last=1)  # no longer named: pruned like any other
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.early_stop_patience=3", "needs evaluations to compare: set train.eval_every"),
        ("train.early_stop_min_delta=-0.1", "train.early_stop_min_delta = -0.1: must be >= 0"),
        ("baseline.hash_bits=40", "baseline.hash_bits = 40: must be in [10, 26]"),
        ('train.monitor="loss"', "must be one of"),
    ],
)
def test_bad_settings_name_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["train.eval_every=0", override])
    assert message in str(e.value)


class _Trainer:
    """What the checkpointer saves and restores: one plain tensor, on any process."""

    def __init__(self) -> None:
        self.model, self.plan, self.w = None, [], torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w = state["w"]


class _Steps:
    """The pipeline: every step a zero loss, ``w`` set to the step so a checkpoint says which."""

    def __init__(self, trainer: _Trainer, loop: list[TrainLoop]) -> None:
        self.trainer, self.loop = trainer, loop

    def progress(self, batches: Any) -> tuple[torch.Tensor, None]:
        self.trainer.w = torch.full((3,), float(self.loop[0].progress.step + 1))
        return torch.tensor(0.0), None


def _run(tmp_path: Path, aucs: dict[int, float], monkeypatch: pytest.MonkeyPatch, **train: Any):
    """The real schedule, evaluator and checkpointer of a run of ``max(aucs)`` steps whose
    evaluation at step s scores ``aucs[s]`` (on every row and on the periodic ones)."""
    overrides = [f"train.{k}={v}" for k, v in train.items()]
    cfg = load_config(TINY, ["train.keep_last=1", "train.checkpoint_every=30", *overrides])
    trainer, progress, holder = _Trainer(), store.Progress(), []
    loop = TrainLoop(_Steps(trainer, holder), iter(()), progress, batch_size=1,
                     train_rows=10**6, total=max(aucs), log_every=10**6,
                     loss_log=MetricsLog(tmp_path / "loss.jsonl", enabled=True))  # fmt: skip
    holder.append(loop)

    def scripted(model: Any, arrays: Arrays, *args: Any) -> dict[str, float]:
        return {"auc": aucs[progress.step], "ne": 1 - aucs[progress.step], "eval_rows": 10}

    monkeypatch.setattr(evaluator_module, "evaluate", scripted)
    rows = Arrays(np.zeros(10, np.int8), np.zeros((10, NUM_DENSE), np.float32),
                  np.zeros((10, NUM_SPARSE), np.int64), None)  # fmt: skip
    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True)
    evaluator = Evaluator(cfg, rows, log, rank=0, world=1)
    monitor = Monitor.from_config(cfg.train)
    ckpt = Checkpointer(tmp_path / "checkpoints", trainer, progress, cfg, {}, monitor=monitor)  # type: ignore[arg-type]
    ckpt.forget_best(rank=0)
    finished: list[dict[str, Any]] = []
    run_schedule(loop, trainer, evaluator, ckpt, monitor, finished.append)  # type: ignore[arg-type]
    return ckpt, evaluator, finished


def test_each_new_best_is_saved_and_early_stopping_ends_with_a_final_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    aucs = {10: 0.60, 20: 0.70, 30: 0.65, 40: 0.66, 50: 0.90, 60: 0.91}
    _, evaluator, finished = _run(tmp_path, aucs, monkeypatch, eval_every=10,
                                  early_stop_patience=2)  # fmt: skip
    root = tmp_path / "checkpoints"
    # saved: 10, 20 (bests), 30 (due), 40 (the end); kept: the best (20) and the last
    assert sorted(p.name for p in root.iterdir()) == ["best", "latest", "step_00000020",
                                                      "step_00000040"]  # fmt: skip
    best = store.resolve("best", root)
    assert best == root / "step_00000020"
    assert store.read_tensors(best)["w"].tolist() == [20.0] * 3  # the weights of step 20
    meta = json.loads((best / store.META).read_text())
    assert meta["monitor"]["best_step"] == 20 and meta["metrics"]["auc"] == 0.70
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [10, 20, 30, 40]  # the final replaced 40's periodic
    final = records[-1]
    assert final == evaluator.last and [final] == finished and final["final"]
    assert final["stopped_early"].startswith("early stopping at step 40: 2 evaluations")
    assert final["best"] == {"step": 20, "monitor": "auc", "value": 0.70,
                             "checkpoint": "step_00000020"}  # fmt: skip


def test_a_resume_brings_back_the_best_of_its_own_timeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    aucs = {10: 0.60, 20: 0.70, 30: 0.65, 40: 0.66, 50: 0.8, 60: 0.5}
    ckpt, _, _ = _run(tmp_path, aucs, monkeypatch, eval_every=10, keep_last=10)
    root = tmp_path / "checkpoints"
    assert store.resolve("best", root).name == "step_00000050"
    step_30 = root / "step_00000030"  # from before step 50: its best was step 20
    ckpt.restore(step_30, store.read_meta(step_30), rank=0)
    assert ckpt.monitor is not None and ckpt.monitor.best_step == 20
    assert store.resolve("best", root).name == "step_00000020"
    ckpt.monitor.reset()
    import shutil

    shutil.rmtree(root / "step_00000020")  # a best gone missing: starts afresh, said
    ckpt.restore(step_30, store.read_meta(step_30), rank=0)
    assert ckpt.monitor.best_step is None and not (root / store.BEST).exists()


def test_the_end_of_a_run_names_the_stop_and_the_best_to_export(tmp_path: Path) -> None:
    cfg = load_config(TINY)
    best = {"step": 20, "monitor": "auc", "value": 0.74, "checkpoint": "step_00000020"}
    valid = {"auc": 0.71, "subset_auc": 0.72}  # the test rows' 0.69 is not compared
    final = {"step": 40, "auc": 0.69, "valid": valid, "best": best, "stopped_early": "why"}
    stop, line = end_lines(final, tmp_path, cfg)
    assert stop == "why"
    assert line == (
        f"best checkpoint: {tmp_path}/checkpoints/step_00000020 (validation AUC 0.7400 at step 20; "
        "the last, step 40: 0.7200, on the same rows); export it: make export PRESET=tiny "
        f"RUN={tmp_path} CHECKPOINT=best"
    )
    assert end_lines({"step": 20, "auc": 0.74, "best": best}, tmp_path, cfg) == []  # the last
