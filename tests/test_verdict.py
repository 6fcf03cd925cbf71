"""A model that lost to its linear baseline is never exported or served without a word
(recsys_stack/verdict.py): ``make export`` ends its report with a WARNING line and records it
in ``schema.json`` (``quality``); ``make serve`` says it at start, from the archive's schema."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

from recsys_stack import verdict
from serving.tools.supervisor import lost_to_baseline
from training.export.__main__ import format_report

BEHIND = {"split": "test", "auc": 0.7364, "baseline_auc": 0.7461, "eval_rows": 2000,
          "vs_baseline": "behind", "vs_baseline_auc": -0.0097,
          "vs_baseline_ci": [-0.0170, -0.0024], "vs_baseline_p": 0.009}  # fmt: skip
SAID = (
    "dlrm-demo v60 lost to its linear baseline: AUC 0.7364 vs the hashed logistic regression's "
    "0.7461 on the same 2,000 test rows, -0.0097 [-0.0170, -0.0024] (95%, DeLong paired, p "
    "0.009): serving it costs more than the linear model and ranks worse; retrain it (its run's "
    "warnings say how)"
)


def test_only_a_model_behind_its_baseline_is_warned_about() -> None:
    assert verdict.baseline_loss(BEHIND, "dlrm-demo v60") == SAID
    for other in ("ahead", "within noise", None):
        assert verdict.baseline_loss({**BEHIND, "vs_baseline": other}) is None
    quality = verdict.quality(BEHIND, "dlrm-demo v60")
    assert quality["vs_baseline"] == "behind" and quality["warning"] == SAID
    # an export from before "quality": its training metrics say it
    old = {"model": {"name": "dlrm-demo", "version": "60"}, "training_metrics": BEHIND}
    assert verdict.schema_warning(old) == SAID
    assert verdict.schema_warning({"quality": verdict.quality({}, "x")}) is None


def _summary(schema: dict[str, Any]) -> dict[str, Any]:
    parity = {"reference": "eager", "rows": 10, "max_abs_diff": {"fp32": 0.0},
              "auc": {"fp32": 0.7, "eager": 0.7}, "checks": []}  # fmt: skip
    return {"export_dir": "e", "mar": None, "parity": parity,
            "schema": {"variants": {"fp32": {"bytes": 2**20}}, **schema}}  # fmt: skip


def test_the_export_report_ends_with_the_warning() -> None:
    lost = format_report(_summary({"quality": verdict.quality(BEHIND, "dlrm-demo v60")}))
    assert lost.splitlines()[-1] == f"WARNING: {SAID}"
    fine = verdict.quality({**BEHIND, "vs_baseline": "ahead"}, "dlrm-demo v60")
    assert "WARNING" not in format_report(_summary({"quality": fine}))


def test_the_supervisor_reads_the_warning_from_the_served_archive(tmp_path: Path) -> None:
    mar = tmp_path / "dlrm-demo-60.mar"
    with zipfile.ZipFile(mar, "w") as z:
        z.writestr("schema.json", json.dumps({"quality": verdict.quality(BEHIND, "dlrm-demo v60")}))
    assert lost_to_baseline(mar) == SAID
    with zipfile.ZipFile(mar, "w") as z:
        z.writestr("schema.json", json.dumps({"quality": verdict.quality({}, "dlrm-demo v60")}))
    assert lost_to_baseline(mar) is None
    assert lost_to_baseline(tmp_path / "missing.mar") is None  # unreadable: no claim either way
