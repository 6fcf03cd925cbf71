"""Served-model evaluation: score a labelled Criteo TSV through the gateway, report its quality.

``python -m serving.tools.evaluate [--data labelled.tsv]`` (``make evaluate [DATA=...]
[VERSION=...]``) reads the rows (by default those the served version never trained on, as its
schema.json records them: a batch run's held-out split, a continuous run's next file, checked
against their fingerprint and said on the ``scoring ...`` line: serving/tools/evaldata.py) by
the trainer's rules (recsys_stack/criteo_rows.py: a label other
than 0/1, an empty line between rows... is one error naming the file and line), scores them through the running gateway in
batches (``recsys.v1`` Score, ``--version`` selects a model version) with a progress bar, prints
AUC, normalized entropy, log loss and calibration (predicted CTR / actual CTR), and writes
``evaluation.json`` and ``calibration.png`` to ``--out`` (default ``reports/<timestamp>/``).

``--holdout 0.05`` scores only the last twentieth of a file given: the training run's test split
when DATA is the file it trained on (half of ``data.eval_fraction`` 0.1 with the default
``data.valid_fraction``, no malformed rows skipped), the rows the export's parity report is
computed on and no training decision saw (the default rows of a batch run's version are those
already).
Metrics use numpy only (no torch).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from recsys_stack.auc_stats import auc_interval
from recsys_stack.config import ConfigError, env_field, parse, to_dict
from recsys_stack.criteo_rows import NUM_FIELDS, RowError, field_count
from recsys_stack.metrics import roc_auc  # the one AUC (training's too)
from recsys_stack.progress import progress
from serving.gateway.auth import AuthError
from serving.gateway.config import GATEWAY_PORT, GATEWAY_PORT_ENV, ChannelConfig
from serving.tools.client import RankerClient, Rows, build_request, rpc_error
from serving.tools.evaldata import NoDefault, Window, default_window, file_window, window_rows
from serving.tools.evaldata import row_window as row_window  # (where it was: tests use it)
from serving.tools.state import WORKDIR, WORKDIR_ENV

logger = logging.getLogger("serving.tools.evaluate")
EPS = 1e-7  # probabilities are clipped to [EPS, 1 - EPS] in log loss


@dataclass
class EvaluateConfig(ChannelConfig):
    """Score a labelled Criteo TSV through the gateway and report AUC, NE, log loss,
    calibration (TLS and the token: ``--tls-ca``... or ``RECSYS_CLIENT_TLS_*``, as the client)."""

    data: Path | None = None
    """Labelled Criteo TSV (label first, 40 tab-separated fields); default: the rows the
    served version never trained on (its schema.json's ``data.unseen``)."""
    version: str = ""
    """Model version to evaluate; empty = the gateway's default version."""
    out: Path | None = None
    """Report folder for evaluation.json and calibration.png (default reports/<timestamp>/)."""
    holdout: float = 0.0
    """Score only the last fraction of ``data``'s rows (0.05 = a training run's test split
    with the default data.eval_fraction and data.valid_fraction); 0 = every row."""
    rows: int = 0
    """Score at most this many rows (the first ones after ``holdout``, or of the unseen
    rows); 0 = all."""
    workdir: Path = env_field(WORKDIR_ENV, WORKDIR)
    """The running stack's state folder (``make serve``'s): whose served model's data is the
    default."""
    batch: int = 1000
    """Examples per request (at most the gateway's limits.max_examples, 1000 by default)."""
    bins: int = 20
    """Calibration bins (equal numbers of rows, by predicted probability)."""
    host: str = "127.0.0.1"
    """The gateway's host."""
    port: int = env_field(GATEWAY_PORT_ENV, GATEWAY_PORT)
    """The gateway's port."""
    timeout_s: float = 30.0
    """Deadline of each request."""
    progress: bool = True
    """Show a progress bar (one line per interval when stderr is not a terminal)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.holdout < 1.0:
            raise ValueError(f"holdout = {self.holdout}: must be in [0, 1)")
        if self.rows < 0 or self.batch < 1 or self.bins < 1:
            raise ValueError("rows must be >= 0, batch and bins >= 1")


# --- metrics: pure functions of labels y[N] in {0, 1} and probabilities p[N] -----------------


def log_loss(y: np.ndarray, p: np.ndarray) -> float:
    """Mean binary cross-entropy (natural log), probabilities clipped to [EPS, 1 - EPS]."""
    q = np.clip(np.asarray(p, dtype=np.float64), EPS, 1 - EPS)
    y = np.asarray(y, dtype=np.float64)
    return float(-np.mean(y * np.log(q) + (1 - y) * np.log(1 - q)))


def normalized_entropy(y: np.ndarray, p: np.ndarray) -> float:
    """Log loss divided by the entropy of the base rate (1.0 = no better than predicting the
    average CTR for every row; lower is better)."""
    ctr = float(np.mean(y))
    return log_loss(y, p) / log_loss(y, np.full(len(y), ctr))


def calibration_bins(y: np.ndarray, p: np.ndarray, bins: int) -> list[dict[str, float]]:
    """Rows sorted by ``p`` in ``bins`` groups of equal size: mean predicted vs actual rate."""
    order = np.argsort(p, kind="mergesort")
    out = []
    for idx in np.array_split(order, min(bins, len(p))):
        out.append(
            {"rows": int(idx.size), "predicted": float(np.mean(p[idx])),
             "actual": float(np.mean(y[idx]))}
        )  # fmt: skip
    return out


def _interval(y: np.ndarray, p: np.ndarray) -> list[float] | None:
    """The AUC's 95% DeLong interval; None with fewer than 2 rows of a class."""
    try:
        iv = auc_interval(y, p)
    except ValueError:
        return None
    return [iv.lo, iv.hi]


class Figures(dict):  # type: ignore[type-arg]
    """:func:`metrics`' figures (a dict, serialized as one); ``scored`` keeps the labels and
    probabilities they came from, for a paired comparison on the same rows (not serialized)."""

    scored: tuple[np.ndarray, np.ndarray] | None = None


def metrics(y: np.ndarray, p: np.ndarray, bins: int) -> Figures:
    """Every figure of the report for labels ``y[N]`` and probabilities ``p[N]``."""
    predicted, actual = float(np.mean(p)), float(np.mean(y))
    out = Figures({
        "rows": len(y),
        "auc": roc_auc(y, p),
        "auc_ci": _interval(y, p),
        "normalized_entropy": normalized_entropy(y, p),
        "log_loss": log_loss(y, p),
        "predicted_ctr": predicted,
        "actual_ctr": actual,
        "calibration": predicted / actual if actual > 0 else float("inf"),
        "bins": calibration_bins(y, p, bins),
    })  # fmt: skip
    out.scored = (y, p)
    return out


# --- rows and scoring ---------------------------------------------------------------------------


def batches(window: Window, size: int) -> Iterator[tuple[np.ndarray, Rows]]:
    """``(labels, rows)`` of the rows of ``window``, at most ``size`` at a time, read by the
    trainer's rules; a ValueError ``file:line: ...`` (that file's line) at the first malformed
    row, and at the first row without a label."""
    try:
        for _, rows in window_rows(window, size, labelled=True):
            assert rows.labels is not None
            yield rows.labels, rows
    except RowError as e:
        if e.detail == field_count(NUM_FIELDS - 1):  # 39 fields: the row has no label
            raise ValueError(f"{e}: evaluation needs labelled rows (label first)") from None
        raise


def rows_to_score(cfg: EvaluateConfig) -> Window:
    """``cfg.data``'s rows, else the served version's unseen rows (:mod:`.evaldata`)."""
    if cfg.data is not None:
        return file_window(cfg.data, cfg.holdout, cfg.rows)
    return default_window(cfg.workdir, cfg.version, cfg.rows, "--data")


def score_file(cfg: EvaluateConfig, window: Window) -> tuple[np.ndarray, np.ndarray]:
    """Labels int8[N] and the gateway's probabilities float32[N] for the rows of ``window``."""
    logger.info("scoring %s through %s", window.describe(), f"{cfg.host}:{cfg.port}")
    client = RankerClient(f"{cfg.host}:{cfg.port}", cfg.timeout_s, channel=cfg, log=False)
    labels: list[np.ndarray] = []
    scores: list[np.ndarray] = []
    bar = None  # drawn from the first good batch: a refused file says its error alone
    try:
        for y, rows in batches(window, cfg.batch):
            if bar is None:
                bar = progress(total=window.count, desc="evaluate", unit="rows",
                               disable=not cfg.progress)  # fmt: skip
            scores.append(client.score(build_request(rows.dense, rows.sparse, cfg.version)))
            labels.append(y)
            bar.update(len(rows.dense))
    finally:
        if bar is not None:
            bar.close()
        client.close()
    return np.concatenate(labels), np.concatenate(scores)


def plot_calibration(report: dict[str, Any], path: Path) -> None:
    """Reliability diagram: actual vs predicted CTR per bin, the diagonal for reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pred = [b["predicted"] for b in report["bins"]]
    act = [b["actual"] for b in report["bins"]]
    top = max(max(pred), max(act), 1e-3) * 1.05
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, top], [0, top], linestyle="--", color="grey", label="perfect calibration")
    ax.plot(pred, act, marker="o", label=f"{len(pred)} bins of equal rows")
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="predicted CTR", ylabel="actual CTR")
    ax.set_title(
        f"AUC {report['auc']:.4f}  NE {report['normalized_entropy']:.4f}  "
        f"calibration {report['calibration']:.3f}",
        fontsize=9,
    )
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def evaluate(cfg: EvaluateConfig, out: Path) -> dict[str, Any]:
    """Score ``cfg.data`` through the gateway; write ``evaluation.json`` and
    ``calibration.png`` to ``out``; return the report."""
    window = rows_to_score(cfg)
    t0 = time.monotonic()
    y, p = score_file(cfg, window)
    report = {
        "data": ", ".join(map(str, window.paths)),
        "first_row": window.first + 1,
        "rows_chosen": window.describe(),  # which, and why (unseen by the served version)
        "version": cfg.version or "default",
        "gateway": f"{cfg.host}:{cfg.port}",
        **metrics(y, p, cfg.bins),
        "seconds": round(time.monotonic() - t0, 3),
        "config": to_dict(cfg),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "evaluation.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    plot_calibration(report, out / "calibration.png")
    return report


def _ci(ci: list[float] | None) -> str:
    return f" (95% interval {ci[0]:.4f}-{ci[1]:.4f}, DeLong)" if ci else ""


def summary(report: dict[str, Any]) -> str:
    """The printed lines of a report."""
    v = report["version"]
    version = "the default version" if v == "default" else f"version {v}"
    return (
        f"{report['rows']} rows of {report['data']} ({version})\n"
        f"AUC {report['auc']:.6f}{_ci(report.get('auc_ci'))}  "
        f"NE {report['normalized_entropy']:.6f}  log loss {report['log_loss']:.6f}\n"
        f"calibration {report['calibration']:.4f} (predicted CTR {report['predicted_ctr']:.6f} "
        f"/ actual CTR {report['actual_ctr']:.6f})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, evaluate, print the figures and where the report went."""
    try:
        cfg = parse(
            EvaluateConfig, argv, "python -m serving.tools.evaluate", __doc__.split("\n\n")[0]
        )
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = cfg.out or Path("reports") / time.strftime("%Y%m%d-%H%M%S")
    try:
        report = evaluate(cfg, out)
    except (OSError, ValueError, AuthError, NoDefault) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        print(f"error: {rpc_error(e, f'{cfg.host}:{cfg.port}')}", file=sys.stderr)
        return 1
    print(summary(report))
    print(f"report: {out / 'evaluation.json'}  {out / 'calibration.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
