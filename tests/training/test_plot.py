"""The learning-curve figure (``training.metrics.plot``) of a run too short to draw a line."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt

from training.metrics.plot import figure, plot_run


def _write(path: Path, records: list[dict[str, float]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_short_run_draws_its_points_and_the_baseline(tmp_path: Path) -> None:
    """One logged step and one evaluation: each is a marker (a line through one point has no
    length: the PNG was empty), and the final record's baseline AUC is drawn beside the model's."""
    _write(tmp_path / "train_loss.jsonl", [{"step": 12, "loss": 0.52}])
    valid = {"auc": 0.73, "ne": 0.91, "oracle_auc": 0.81}
    final = {"step": 12, "auc": 0.71, "ne": 0.93, "oracle_auc": 0.80, "baseline_auc": 0.69,
             "split": "test", "valid": valid}  # fmt: skip
    _write(tmp_path / "metrics.jsonl", [final])
    fig = figure(tmp_path)
    try:
        ax_loss, ax_auc = fig.axes[:2]
        (loss,) = ax_loss.get_lines()
        assert loss.get_marker() not in ("None", "", None)
        lines = {line.get_label(): line for line in ax_auc.get_lines()}
        assert lines["validation AUC"].get_marker() not in ("None", "", None)
        assert list(lines["validation AUC"].get_ydata()) == [0.73]  # the curve: validation
        assert list(lines["test AUC (the report)"].get_ydata()) == [0.71]
        baseline = lines["linear baseline AUC (test)"]
        assert set(baseline.get_ydata()) == {0.69}
    finally:
        plt.close(fig)
    assert plot_run(tmp_path).stat().st_size > 10_000
