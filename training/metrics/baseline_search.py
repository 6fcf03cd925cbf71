"""The report's baselines, tuned on validation rows and scored on test rows no choice saw.

A baseline is only a bar to clear if it is a fair one: the hashed logistic regression fitted
by one pass of AdaGrad at a fixed learning rate lost 0.03 AUC to a tuned L2 logistic
regression on 8,000 real Criteo rows, so a DLRM reported ahead of it was behind a linear model
a user could have had. :func:`fit_linear` solves the L2 logistic regression on the model's
training rows (:mod:`.l2_logistic`) for each penalty of ``baseline.l2``, strongest first, each
solve starting from the last one's weights, and keeps the one with the best validation AUC
(the path stops at the first penalty that does worse than the one before). The validation
rows only choose; :func:`fit_and_score` reports the winner on the test rows, with DeLong's
interval and the paired test against the model, and with ``baseline.trees`` gradient-boosted
trees beside it (:mod:`.trees`). Its seconds are in the record (``baseline_seconds``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recsys_stack.metrics import roc_auc
from training.data.loader import Arrays
from training.metrics import baseline, l2_logistic, trees
from training.metrics.baseline import (
    SCORE_CHUNK,
    HashedLogisticRegression,
    describe,
    feature_index,
    figures,
)
from training.metrics.baseline_config import BaselineConfig

logger = logging.getLogger("training")


@dataclass
class Choice:
    """The penalty chosen and every solve of the path: ``[{l2, valid_auc, iterations}]``."""

    l2: float
    valid_auc: float
    tried: list[dict[str, float]] = field(default_factory=list)


def valid_score(y: np.ndarray, p: np.ndarray) -> float:
    """What the search maximizes: the validation AUC; minus the log loss on rows of one
    class (no AUC there, still an order); 0 on no rows (the first penalty wins)."""
    if not len(y):
        return 0.0
    try:
        return roc_auc(y, p)
    except ValueError:
        p = np.clip(p, 1e-12, 1 - 1e-12)
        return float(np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def hashed(arrays: Arrays, idx: np.ndarray, bits: int) -> np.ndarray:
    """:func:`feature_index` of rows ``idx``, ``int32[N, 39]``, computed in bounded chunks."""
    out = np.empty((len(idx), 39), dtype=np.int32)
    for lo in range(0, len(idx), SCORE_CHUNK):
        out[lo : lo + SCORE_CHUNK] = feature_index(arrays, idx[lo : lo + SCORE_CHUNK], bits)
    return out


def fit_linear(
    train: Arrays, order: np.ndarray, valid: Arrays, cfg: BaselineConfig
) -> tuple[HashedLogisticRegression, Choice]:
    """The tuned linear baseline on the first ``cfg.max_rows`` rows of ``order`` of
    ``train``: the path of ``cfg.l2`` (strongest first) scored on ``valid``; the winner."""
    rows = np.sort(order[: cfg.max_rows])  # one full-batch problem: the order is not used
    cols = l2_logistic.Columns.of(hashed(train, rows, cfg.hash_bits))
    y = np.asarray(train.labels[rows], dtype=np.float64)
    v_cols = cols.map(hashed(valid, np.arange(len(valid)), cfg.hash_bits))
    v_y = np.asarray(valid.labels, dtype=np.float64)
    ctr = float(np.clip(y.mean(), 1e-6, 1 - 1e-6)) if len(y) else 0.5
    start = np.zeros(len(cols.used) + 1)
    start[-1] = math.log(ctr / (1 - ctr))  # from the base rate
    best, kept = Choice(math.nan, -math.inf), [start]

    def fit(l2: float, start: np.ndarray) -> tuple[np.ndarray, float]:
        theta, iterations = l2_logistic.solve(cols.cols, y, l2, start)
        got = valid_score(v_y, l2_logistic.predict(theta, v_cols))
        best.tried.append({"l2": l2, "valid_auc": round(got, 6), "iterations": iterations})
        if got > best.valid_auc:
            best.l2, best.valid_auc, kept[0] = l2, got, theta
        return theta, got

    last = -math.inf
    for l2 in sorted(cfg.l2, reverse=True):  # each solve starts where the last one ended
        start, got = fit(l2, start)
        if got < last:  # past the top of the path
            break
        last = got
    if len(best.tried) > 1:  # halfway (geometrically) to the better neighbour of the best
        at = [t["l2"] for t in best.tried].index(best.l2)
        near = best.tried[max(at - 1, 0) : at] + best.tried[at + 1 : at + 2]
        fit(math.sqrt(best.l2 * max(near, key=lambda t: t["valid_auc"])["l2"]), kept[0])
    theta = kept[0]
    model = HashedLogisticRegression(bits=cfg.hash_bits)
    model.w[cols.used], model.b = theta[:-1], float(theta[-1])
    model.rows_seen = len(rows)
    return model, best


def fit_and_score(
    train: Arrays,
    order: np.ndarray,
    valid: Arrays,
    test: Arrays,
    cfg: BaselineConfig,
    scored: Any = None,
) -> dict[str, Any]:
    """The baselines of a run's final record: the linear one tuned on ``valid``
    (:func:`fit_linear`) and, with ``cfg.trees``, the trees (:mod:`.trees`), fitted on rows
    ``order`` of ``train`` and reported on ``test``: AUC, its interval, NE and, with the
    model's ``scored`` ``(labels, probs)`` on ``test``, the paired test against the model.
    Also what was chosen (``baseline_l2``, ``baseline_valid_auc``, ``baseline_search``:
    every solve) and the cost (``baseline_seconds``), logged."""
    t0 = time.perf_counter()
    model, choice = fit_linear(train, order, valid, cfg)
    out: dict[str, Any] = figures("baseline", np.asarray(test.labels), model.predict(test), scored)
    out.update(
        baseline_l2=choice.l2, baseline_valid_auc=round(choice.valid_auc, 6),
        baseline_search=choice.tried, baseline_train_rows=model.rows_seen,
        baseline_valid_rows=len(valid), baseline_test_rows=len(test),
        baseline_seconds=round(time.perf_counter() - t0, 2),
    )  # fmt: skip
    logger.info(
        "baseline (L2 logistic regression on 2^%d hashed weights, %s training rows; L2 %g "
        "chosen of %d on %s validation rows): %s on %s test rows, %.1f s",
        cfg.hash_bits, f"{model.rows_seen:,}", choice.l2, len(choice.tried), f"{len(valid):,}",
        describe(out, "baseline"), f"{len(test):,}", out["baseline_seconds"],
    )  # fmt: skip
    logger.debug("baseline search (L2, validation AUC, iterations): %s", choice.tried)
    if cfg.trees:
        out.update(trees.fit_and_score(train, order, valid, test, cfg, scored))
    return out


def judge(record: dict[str, Any], remedy: str = "") -> list[str]:
    """The warnings of a record whose model does not beat its baselines: the linear one's
    (:func:`training.metrics.baseline.judge`, with the run's ``remedy``), and the trees' when
    they were fitted."""
    return baseline.judge(record, remedy) + trees.judge(record)
