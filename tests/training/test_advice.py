"""The end of a run's advice (training/metrics/advice.py): an overfitting run (validation NE up
from its best, early stopping fired, NE >= 1 after more than one epoch) is told to train fewer
epochs, regularize and serve its best checkpoint, never "more epochs"; an undertrained one is
told to train more; the baseline's warning ends with the same advice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training.config import load_config
from training.metrics import advice
from training.metrics.baseline import judge

RUN = Path("runs/demo")
ROWS = 1000  # training rows: samples_seen / ROWS = epochs


def _cfg(*overrides: str) -> Any:
    return load_config("training/configs/demo.toml", list(overrides))


def _eval(step: int, ne: float, seen: int) -> dict[str, Any]:
    return {"step": step, "ne": ne, "auc": 1 - ne / 2, "samples_seen": seen, "split": "valid"}


def _final(step: int, ne: float, valid_ne: float, seen: int, **more: Any) -> dict[str, Any]:
    return {"step": step, "ne": ne, "samples_seen": seen, "split": "test", "eval_rows": 500,
            "calibration": 1.3, "valid": {"ne": valid_ne, "eval_rows": 500}, "final": True,
            **more}  # fmt: skip


def test_a_validation_ne_that_rose_is_overfitting_with_the_exact_remedy() -> None:
    cfg = _cfg("train.epochs=3")
    history = [_eval(10, 0.90, 400), _eval(20, 0.85, 800), _eval(30, 0.88, 1200)]
    best = {"step": 20, "monitor": "auc", "value": 0.6, "checkpoint": "step_00000020"}
    final = _final(40, 0.95, 0.97, 3000, best=best)
    d = advice.diagnose(history, final, ROWS)
    assert d.overfit and d.best_epochs == 1
    assert d.rose == "validation NE rose from 0.8500 at step 20 (epoch 1) to 0.9700 at step 40"
    (warning,) = advice.run_warnings(d, final, cfg, RUN)
    assert warning == (
        "validation NE rose from 0.8500 at step 20 (epoch 1) to 0.9700 at step 40: the model "
        "overfits; train fewer epochs (ARGS='--train.epochs 1'), regularize (ARGS='--optim."
        "embedding-lr 0.025' or '--optim.dense-weight-decay 1e-05', or a smaller model.embedding_dim) and serve the best validation "
        "checkpoint: make export PRESET=demo RUN=runs/demo CHECKPOINT=best"
    )
    assert "more epochs" not in warning and "--train.epochs 4" not in warning


def test_ne_over_one_after_epochs_is_overfitting_and_never_more_epochs() -> None:
    # the case: 3 epochs, NE 1.549 on the test rows, early stopping had fired
    cfg = _cfg("train.epochs=3", "train.eval_every=50", "train.early_stop_patience=2")
    history = [_eval(50, 1.2, 1500), _eval(100, 1.3, 3000)]
    final = _final(100, 1.549, 1.3, 3000, stopped_early="early stopping at step 100: ...")
    d = advice.diagnose(history, final, ROWS)
    assert d.overfit and "early stopping fired" in d.why and "NE 1.549 >= 1 after 3.0" in d.why
    (warning,) = advice.run_warnings(d, final, cfg, RUN)
    assert warning.startswith("final NE 1.549 >= 1 on 500 test rows (calibration 1.30)")
    assert "it overfits (" in warning and "train fewer epochs (ARGS='--train.epochs 2')" in warning
    assert "more rows" not in warning and "--train.epochs 4" not in warning
    lost = {"auc": 0.6, "ne": 1.549, "baseline_auc": 0.7, "baseline_ne": 0.9, "eval_rows": 500,
            "vs_baseline": "behind", "vs_baseline_ci": [-0.12, -0.08]}  # fmt: skip
    (baseline,) = judge(lost, advice.remedy(d, final, cfg, RUN))
    assert "train fewer epochs (ARGS='--train.epochs 2')" in baseline
    assert "--train.epochs N" not in baseline  # today's advice, which hurts here


def test_an_undertrained_run_is_told_to_train_more() -> None:
    cfg = _cfg()  # one epoch; the validation NE still falling at the end
    history = [_eval(10, 1.10, 400), _eval(20, 1.05, 800)]
    final = _final(25, 1.02, 1.01, 1000)
    d = advice.diagnose(history, final, ROWS)
    assert not d.overfit and d.why == ""
    (warning,) = advice.run_warnings(d, final, cfg, RUN)
    assert warning.endswith(
        "it looks undertrained: train on more rows or epochs (ARGS='--train.epochs 2') or take "
        "more steps with a smaller batch (ARGS='--train.batch-size 1024')"
    )


def test_a_rise_within_noise_or_a_good_run_says_nothing() -> None:
    cfg = _cfg("train.epochs=2")
    history = [_eval(10, 0.800, 500), _eval(20, 0.805, 1000)]  # +0.6%: noise on the rows
    final = _final(30, 0.81, 0.806, 2000)
    d = advice.diagnose(history, final, ROWS)
    assert not d.overfit and advice.run_warnings(d, final, cfg, RUN) == []


def test_an_overfit_with_no_best_to_serve_is_told_to_stop_early() -> None:
    cfg = _cfg("train.epochs=1", "train.eval_every=20")
    history = [_eval(20, 0.80, 400), _eval(40, 0.90, 800)]
    final = _final(50, 0.9, 0.95, 1000)  # no best kept (train.keep_best off)
    text = advice.remedy(advice.diagnose(history, final, ROWS), final, cfg, RUN)
    assert "--train.epochs" not in text  # one epoch: fewer is not possible
    assert text.endswith(
        "regularize (ARGS='--optim.embedding-lr 0.025' or '--optim.dense-weight-decay 1e-05', or a smaller model.embedding_dim) and "
        "stop early (ARGS='--train.eval-every 20 --train.early-stop-patience 2')"
    )
