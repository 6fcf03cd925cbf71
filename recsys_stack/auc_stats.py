"""How sure an AUC is: DeLong's interval, and DeLong's paired test of two models on one set of rows.

An AUC on 2,000 rows has a standard error of about 0.014 (DeLong): two models 0.01 apart on the
same rows may be the same model. :func:`auc_interval` gives the interval of one AUC;
:func:`compare_aucs` the difference of two AUCs scored on the same rows, whose errors are
correlated (the same hard rows hurt both): its interval and p-value from DeLong's covariance,
and a verdict, ``ahead``, ``behind`` or ``within noise``.

DeLong, DeLong & Clarke-Pearson (1988), with the midrank computation of Sun & Xu (2014): the
structural components come from three rankings per model (positives, negatives, all), O(N log
N), ties counted one half as :func:`recsys_stack.metrics.roc_auc` counts them (the AUC here is
that function's, to the last digit). Normal approximation; numpy only (serving imports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile
VERDICTS = ("ahead", "behind", "within noise")


@dataclass(frozen=True)
class AucInterval:
    """An AUC, its DeLong standard error and the ``level`` interval around it (clipped to
    [0, 1])."""

    auc: float
    se: float
    lo: float
    hi: float
    level: float = 0.95

    def __str__(self) -> str:
        return f"{self.auc:.4f} [{self.lo:.4f}, {self.hi:.4f}]"


@dataclass(frozen=True)
class AucComparison:
    """AUC ``a`` minus AUC ``b`` on the same rows: the difference, its interval, the two-sided
    p-value of "no difference", and the verdict at ``level``."""

    a: float
    b: float
    delta: float
    lo: float
    hi: float
    p_value: float
    verdict: str
    level: float = 0.95

    def __str__(self) -> str:
        return (f"{self.verdict} ({self.delta:+.4f} AUC [{self.lo:+.4f}, {self.hi:+.4f}], "
                f"p {self.p_value:.3g})")  # fmt: skip


def _z(level: float) -> float:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level = {level}: a probability strictly between 0 and 1")
    if level == 0.95:
        return Z95
    lo, hi = 0.0, 10.0  # bisection on the normal's CDF (no scipy in serving images)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _phi(mid) < (1 + level) / 2 else (lo, mid)
    return (lo + hi) / 2


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _midranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of ``x`` (float64), tied values sharing their average rank."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    avg = np.cumsum(counts) - (counts - 1) / 2.0
    return np.asarray(avg[inverse.reshape(-1)], dtype=np.float64)


def delong(labels: Any, *scores: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(aucs [k], covariance [k, k])`` of ``k`` models' scores on the same rows (numpy ``[N]``
    each). Raises ValueError unless both classes occur, at least two of each (a variance)."""
    y = np.asarray(labels).reshape(-1).astype(bool)
    s = np.stack([np.asarray(x, dtype=np.float64).reshape(-1) for x in scores])
    if s.shape[1] != y.size:
        raise ValueError(f"labels and scores differ in length: {y.size} vs {s.shape[1]}")
    m, n = int(y.sum()), int((~y).sum())
    if m < 2 or n < 2:
        raise ValueError(
            f"an AUC's interval needs at least 2 positives and 2 negatives; {m} and {n} here"
        )
    pos, neg = s[:, y], s[:, ~y]
    k = s.shape[0]
    aucs, v01, v10 = np.empty(k), np.empty((k, m)), np.empty((k, n))
    for r in range(k):
        tx, ty = _midranks(pos[r]), _midranks(neg[r])
        tz = _midranks(np.concatenate([pos[r], neg[r]]))
        aucs[r] = (tz[:m].sum() - m * (m + 1) / 2.0) / (m * n)
        v01[r] = (tz[:m] - tx) / n  # each positive: the share of negatives it outranks
        v10[r] = 1.0 - (tz[m:] - ty) / m  # each negative: the share of positives above it
    cov = np.atleast_2d(np.cov(v01)) / m + np.atleast_2d(np.cov(v10)) / n
    return aucs, cov


def auc_interval(labels: Any, scores: Any, level: float = 0.95) -> AucInterval:
    """The AUC of ``scores`` with DeLong's ``level`` interval."""
    aucs, cov = delong(labels, scores)
    auc, se = float(aucs[0]), math.sqrt(max(float(cov[0, 0]), 0.0))
    half = _z(level) * se
    return AucInterval(auc, se, max(0.0, auc - half), min(1.0, auc + half), level)


def compare_aucs(labels: Any, scores_a: Any, scores_b: Any, level: float = 0.95) -> AucComparison:
    """Model ``a`` against model ``b`` on the same rows (DeLong's paired test): ``ahead`` when
    the ``level`` interval of AUC a - AUC b lies above 0, ``behind`` below, else ``within
    noise``."""
    aucs, cov = delong(labels, scores_a, scores_b)
    delta = float(aucs[0] - aucs[1])
    var = float(cov[0, 0] + cov[1, 1] - 2 * cov[0, 1])
    se = math.sqrt(max(var, 0.0))
    half = _z(level) * se
    # se 0: identical rankings, or differences without spread: certain either way
    p = 2.0 * (1.0 - _phi(abs(delta) / se)) if se else float(delta == 0.0)
    lo, hi = delta - half, delta + half
    verdict = "ahead" if lo > 0 else "behind" if hi < 0 else "within noise"
    return AucComparison(float(aucs[0]), float(aucs[1]), delta, lo, hi, p, verdict, level)


class RowsDiffer(ValueError):
    """Two models' scored rows are not the same rows (other labels, or in another order)."""


def compare_scored(a: tuple[Any, Any], b: tuple[Any, Any], level: float = 0.95) -> AucComparison:
    """:func:`compare_aucs` of model ``a`` against model ``b``, each given as the ``(labels,
    probs)`` it was scored on; :class:`RowsDiffer` unless those are the same rows (equal
    labels in the same order), ValueError with too few of a class."""
    ya, pa = (np.asarray(x).reshape(-1) for x in a)
    yb, pb = (np.asarray(x).reshape(-1) for x in b)
    if ya.shape != yb.shape or not np.array_equal(ya.astype(bool), yb.astype(bool)):
        raise RowsDiffer(f"{ya.size} and {yb.size} rows, not the same ones: no paired test")
    return compare_aucs(ya, pa, pb, level)
