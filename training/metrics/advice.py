"""What the end of a run advises: overfitting and underfitting told apart, each with its remedy.

A CTR model overfits quickly, often within its second epoch: the advice "train on more rows or
epochs" that fits an undertrained model makes an overfitting one worse (on generated data it
took NE 1.015 to 1.372). So the run's validation history decides which remedy is given:

* **overfit**: the validation NE (the normalized log loss) rose from its best by more than
  :data:`RISE` (relative), early stopping fired, or the final NE is >= 1 after more than one
  epoch -> fewer epochs (the epoch of the best validation figure), regularization (a lower
  embedding learning rate or a smaller embedding), and the best validation checkpoint;
* **underfit** otherwise -> more rows or epochs, or a smaller batch (more steps).

Each remedy names the exact ``ARGS`` (or ``make export``) to run. :func:`run_warnings` is the
run's own warnings (NE >= 1, a validation NE that rose); the baseline's warning
(:func:`training.metrics.baseline.judge`) ends with the same :func:`remedy`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RISE = 0.01  # a validation NE more than 1% above its best is rising, not noise on the rows


@dataclass
class Diagnosis:
    """Why a run looks over- or underfitted, from its validation records."""

    overfit: bool
    why: str  # the evidence, said in the warning ("" when nothing points either way)
    best_epochs: int  # epochs up to the best validation NE (the remedy's train.epochs)
    rose: str = ""  # "validation NE rose from ... to ...", when it did


def _valid(record: dict[str, Any]) -> dict[str, Any]:
    """A record's validation figures (a final record's ``valid``; periodic ones are their own)."""
    found: dict[str, Any] = record.get("valid") or record
    return found


def _ne(record: dict[str, Any]) -> float | None:
    v = _valid(record)
    ne = v.get("subset_ne", v.get("ne"))
    return float(ne) if isinstance(ne, int | float) and math.isfinite(ne) else None


def diagnose(history: list[dict[str, Any]], final: dict[str, Any], train_rows: int) -> Diagnosis:
    """Over- or underfit, from the run's eval records ``history`` (oldest first, ``final``
    last or not yet in it) and its ``train_rows`` (epochs = samples seen / rows)."""
    records = [r for r in history if r.get("step") != final.get("step")] + [final]
    scored = [(r, ne) for r in records if (ne := _ne(r)) is not None]
    epochs = final.get("samples_seen", 0) / max(train_rows, 1)
    best_epochs = max(1, math.ceil(epochs))
    rose = ""
    if scored:
        best, best_ne = min(scored, key=lambda x: x[1])
        last_ne = scored[-1][1]
        best_epochs = max(1, math.ceil(best.get("samples_seen", 0) / max(train_rows, 1)))
        if last_ne > best_ne * (1 + RISE) and best is not scored[-1][0]:
            rose = (
                f"validation NE rose from {best_ne:.4f} at step {best['step']} (epoch "
                f"{best_epochs}) to {last_ne:.4f} at step {final.get('step')}"
            )
    ne = final.get("ne")
    why = [rose] if rose else []
    if final.get("stopped_early"):
        why.append("early stopping fired")
    if isinstance(ne, int | float) and ne >= 1 and epochs > 1:
        why.append(f"NE {ne:.3f} >= 1 after {epochs:.1f} epochs")
    return Diagnosis(bool(why), "; ".join(why), best_epochs, rose)


def remedy(d: Diagnosis, final: dict[str, Any], cfg: Any, run_dir: Path, why: bool = True) -> str:
    """What to do, with the exact ARGS: for an overfit, fewer epochs, regularization and the
    best checkpoint; else more rows or epochs. ``why``: lead with the evidence."""
    if not d.overfit:
        more = cfg.train.epochs + 1
        return (
            f"it looks undertrained: train on more rows or epochs (ARGS='--train.epochs "
            f"{more}') or take more steps with a smaller batch (ARGS='--train.batch-size "
            f"{max(1, cfg.train.batch_size // 2)}')"
        )
    todo = []
    if cfg.train.epochs > 1:
        fewer = min(d.best_epochs, cfg.train.epochs - 1)
        todo.append(f"train fewer epochs (ARGS='--train.epochs {fewer}')")
    lr, wd = cfg.optim.embedding_lr / 2, max(1e-5, 10 * cfg.optim.dense_weight_decay)
    todo.append(f"regularize (ARGS='--optim.embedding-lr {lr:g}' or '--optim.dense-weight-decay "
                f"{wd:g}', or a smaller model.embedding_dim)")  # fmt: skip
    if (final.get("best") or {}).get("step") not in (None, final.get("step")):
        todo.append(f"serve the best validation checkpoint: make export PRESET={cfg.name} "
                    f"RUN={run_dir} CHECKPOINT=best")  # fmt: skip
    elif not cfg.train.early_stop_patience:
        every = cfg.train.eval_every or 100
        todo.append(f"stop early (ARGS='--train.eval-every {every} --train.early-stop-patience 2')")
    said = todo[0] if len(todo) == 1 else ", ".join(todo[:-1]) + f" and {todo[-1]}"
    return f"it overfits ({d.why}): {said}" if why else said


def run_warnings(d: Diagnosis, final: dict[str, Any], cfg: Any, run_dir: Path) -> list[str]:
    """What makes a finished run not worth serving as it is, each said with its remedy: a
    final NE >= 1 on the test rows (worse than predicting their base rate), a validation NE
    that rose from its best (the model overfits)."""
    out = []
    ne = final.get("ne")
    if isinstance(ne, int | float) and math.isfinite(ne) and ne >= 1.0:
        split = "test" if final.get("split") == "test" else "held-out"
        out.append(
            f"final NE {ne:.3f} >= 1 on {final.get('eval_rows', 0):,} {split} rows "
            f"(calibration {final.get('calibration', math.nan):.2f}): the model predicts worse "
            f"than the base click rate, it is not worth serving; {remedy(d, final, cfg, run_dir)}"
        )
    elif d.rose:
        out.append(f"{d.rose}: the model overfits; {remedy(d, final, cfg, run_dir, why=False)}")
    return out
