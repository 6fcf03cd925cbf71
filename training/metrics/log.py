"""Evaluation metrics (AUC, TorchRec's NE, over all ranks) and the metrics.jsonl log.

The AUC is :func:`recsys_stack.metrics.roc_auc`, the one the export's parity check and the
served model's evaluation report, computed on the predictions of every rank gathered."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchrec.metrics.metrics_config import RecComputeMode, RecTaskInfo
from torchrec.metrics.ne import NEMetric

from recsys_model.atomic import write_atomic
from recsys_stack.auc_stats import auc_interval
from recsys_stack.metrics import normalized_entropy, roc_auc
from training.metrics.tb import Scalars

TASK = RecTaskInfo(
    name="ctr", label_name="label", prediction_name="prediction", weight_name="weight"
)


class EvalMetrics:
    """Lifetime AUC and NE of one evaluation pass, plus the oracle AUC when true probs are known.

    Every rank updates with its own slice; ``compute()`` gathers across the process group, so
    all ranks must call it. Padding rows carry weight 0 and do not count. The AUC needs every
    prediction (a rank sum), so each rank keeps its own (16 bytes a row at most) until then.
    """

    def __init__(self, batch_size: int, with_oracle: bool) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        kw: dict[str, Any] = dict(
            world_size=world,
            my_rank=rank,
            batch_size=batch_size,
            tasks=[TASK],
            compute_mode=RecComputeMode.UNFUSED_TASKS_COMPUTATION,
            window_size=1 << 30,
            compute_on_all_ranks=True,
        )
        self._ne = NEMetric(**kw)
        self.with_oracle = with_oracle
        self._rows: list[torch.Tensor] = []  # per batch: [probs, labels, weights(, oracle)]
        self.scored: tuple[Any, Any] | None = None  # (labels, probs) of the last compute's rows

    def update(
        self,
        probs: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor,
        oracle_probs: torch.Tensor | None = None,
    ) -> None:
        """``probs``, ``labels``, ``weights``, ``oracle_probs``: float32[B]."""
        p, y, w = {"ctr": probs}, {"ctr": labels}, {"ctr": weights}
        self._ne.update(predictions=p, labels=y, weights=w)
        columns = [probs, labels, weights]
        if self.with_oracle:
            if oracle_probs is None:
                raise ValueError("EvalMetrics(with_oracle=True) needs oracle_probs")
            columns.append(oracle_probs)
        self._rows.append(torch.stack([c.detach().float().cpu().reshape(-1) for c in columns]))

    def compute(self, prefix: int = 0) -> dict[str, Any]:
        """AUC, NE, calibration, rows (and oracle AUC) over every rank's rows; with ``prefix``
        fewer than them, also ``subset_auc``, ``subset_ne`` and ``subset_rows`` over the first
        ``prefix`` rows (in the split's order: each rank scores a contiguous share); ``auc_ci``:
        the AUC's 95% DeLong interval (:mod:`recsys_stack.auc_stats`)."""
        local = torch.cat(self._rows, dim=1) if self._rows else torch.zeros(3 + self.with_oracle, 0)
        parts: list[Any] = [local]
        if dist.is_initialized():
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, local)
        table = torch.cat(parts, dim=1)
        real = table[2] > 0
        labels = table[1][real]
        out: dict[str, Any] = {
            "auc": roc_auc(labels, table[0][real]), "ne": _lifetime(self._ne.compute(), "ne")
        }  # fmt: skip
        self.scored = (labels.numpy(), table[0][real].numpy())  # (y, p) of every real row
        with contextlib.suppress(ValueError):  # fewer than 2 of a class: no interval
            iv = auc_interval(*self.scored)
            out["auc_ci"] = [round(iv.lo, 6), round(iv.hi, 6)]  # DeLong, 95%
        if self.with_oracle:
            out["oracle_auc"] = roc_auc(labels, table[3][real])
        out["eval_rows"] = int(real.sum())
        ctr = float(labels.float().mean()) if len(labels) else 0.0
        # calibration: mean predicted / observed CTR (1 = calibrated; NaN without a click)
        out["calibration"] = float(table[0][real].mean()) / ctr if ctr > 0 else math.nan
        if 0 < prefix < len(labels):
            y, p = labels[:prefix].numpy(), table[0][real][:prefix].numpy()
            out["subset_auc"], out["subset_ne"] = roc_auc(y, p), normalized_entropy(y, p)
            out["subset_rows"] = prefix
        return out


def _lifetime(result: dict[str, torch.Tensor], name: str) -> float:
    # Some TorchRec metrics only report a window value; the window (2^30 rows) spans the pass.
    for kind in ("lifetime", "window"):
        key = f"{name}-ctr|{kind}_{name}"
        if key in result:
            return float(result[key].item())
    raise KeyError(f"{name} missing from {sorted(result)}")


class MetricsLog:
    """Appends one JSON object per line to ``<run>/metrics.jsonl`` (rank 0 only), and its
    numbers to TensorBoard as ``<tb_prefix>/<key>`` at the record's step when given ``tb``."""

    def __init__(
        self, path: Path, enabled: bool, tb: Scalars | None = None, tb_prefix: str = ""
    ) -> None:
        self.path = path
        self.enabled = enabled
        self.tb, self.tb_prefix = tb, tb_prefix

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
        if self.tb is not None and "step" in record:
            self.tb.add(self.tb_prefix, record, int(record["step"]))

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (work redone after a resume), like TensorBoard's purge_step."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        write_atomic(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
