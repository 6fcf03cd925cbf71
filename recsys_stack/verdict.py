"""Whether a model lost to its linear baseline, as its training run recorded it: one sentence
shared by the export (``make export`` prints it and records it in ``schema.json``'s
``quality``) and the serving supervisor (``make serve`` logs it at start), so a model that a
hashed logistic regression beats is never exported or served without a word.

The evidence is the training record's paired comparison on the test rows (training/train.py,
:mod:`recsys_stack.auc_stats`): ``vs_baseline`` is ``"behind"`` when the model's AUC is below
the baseline's by more than the rows' noise (DeLong, paired, 95%). ``"within noise"`` is no
loss; an export of a checkpoint whose record holds no comparison (a periodic one, such as
``checkpoints/best`` before the last step) says nothing. Standard library only.
"""

from __future__ import annotations

from typing import Any


def baseline_loss(metrics: dict[str, Any], who: str = "the model") -> str | None:
    """The warning for a training record ``metrics`` (a final record, or ``schema.json``'s
    ``training_metrics``) whose model is behind its baseline; None otherwise."""
    if metrics.get("vs_baseline") != "behind":
        return None
    auc, base = metrics.get("auc", float("nan")), metrics.get("baseline_auc", float("nan"))
    lo, hi = metrics.get("vs_baseline_ci") or (float("nan"), float("nan"))
    split = "test" if metrics.get("split") == "test" else "held-out"
    return (
        f"{who} lost to its linear baseline: AUC {auc:.4f} vs the hashed logistic regression's "
        f"{base:.4f} on the same {metrics.get('eval_rows', 0):,} {split} rows, "
        f"{metrics.get('vs_baseline_auc', auc - base):+.4f} [{lo:+.4f}, {hi:+.4f}] (95%, "
        f"DeLong paired, p {metrics.get('vs_baseline_p', float('nan')):.3g}): serving it costs "
        "more than the linear model and ranks worse; retrain it (its run's warnings say how)"
    )


def quality(metrics: dict[str, Any], who: str) -> dict[str, Any]:
    """``schema.json``'s ``quality``: the comparison the record holds, and the warning (None
    when the model did not lose)."""
    keys = ("split", "auc", "auc_ci", "baseline_auc", "baseline_auc_ci", "vs_baseline",
            "vs_baseline_auc", "vs_baseline_ci", "vs_baseline_p")  # fmt: skip
    return {**{k: metrics.get(k) for k in keys}, "warning": baseline_loss(metrics, who)}


def schema_warning(schema: dict[str, Any]) -> str | None:
    """The warning of an exported model: its ``quality``'s, or for an export from before
    ``quality`` existed, what its ``training_metrics`` say."""
    if "quality" in schema:
        found: str | None = (schema["quality"] or {}).get("warning")
        return found
    model = schema.get("model") or {}
    who = f"{model.get('name', 'the model')} v{model.get('version', '?')}"
    return baseline_loss(schema.get("training_metrics") or {}, who)
