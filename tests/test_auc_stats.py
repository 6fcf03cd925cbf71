"""DeLong's AUC interval and paired test (recsys_stack/auc_stats.py) against the textbook
definition computed pair by pair (every positive against every negative), and what the verdicts
say on models that differ and models that do not."""

from __future__ import annotations

import math

import numpy as np
import pytest

from recsys_stack.auc_stats import auc_interval, compare_aucs, delong
from recsys_stack.metrics import roc_auc


def reference_delong(y: np.ndarray, *scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeLong et al. (1988) as written: psi over all (positive, negative) pairs, the structural
    components V10 (per positive) and V01 (per negative), S = S10 / m + S01 / n."""
    pos, neg = y == 1, y == 0
    v10, v01, aucs = [], [], []
    for s in scores:
        x, z = s[pos][:, None], s[neg][None, :]
        psi = (x > z) + 0.5 * (x == z)
        aucs.append(psi.mean())
        v10.append(psi.mean(axis=1))
        v01.append(psi.mean(axis=0))
    m, n = int(pos.sum()), int(neg.sum())
    cov = np.atleast_2d(np.cov(np.array(v10))) / m + np.atleast_2d(np.cov(np.array(v01))) / n
    return np.array(aucs), cov


def rows(
    seed: int, n: int = 600, ties: bool = False, noise: tuple[float, float] = (0.5, 0.9)
) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.3).astype(np.int64)
    signal = y + rng.normal(0, 1.2, n)
    a = signal + rng.normal(0, noise[0], n)  # two models sharing the signal: correlated errors
    b = signal + rng.normal(0, noise[1], n)
    if ties:
        a, b = np.round(a, 1), np.round(b, 1)  # many ties: the half-credit counts
    return y, a, b


@pytest.mark.parametrize("ties", [False, True])
def test_matches_the_pairwise_definition(ties: bool) -> None:
    y, a, b = rows(1, ties=ties)
    aucs, cov = delong(y, a, b)
    ref_aucs, ref_cov = reference_delong(y, a, b)
    np.testing.assert_allclose(aucs, ref_aucs, rtol=0, atol=1e-12)
    np.testing.assert_allclose(cov, ref_cov, rtol=1e-9, atol=1e-15)
    assert aucs[0] == pytest.approx(roc_auc(y, a), abs=1e-12)  # the project's one AUC


def test_interval_is_the_auc_plus_minus_1_96_standard_errors() -> None:
    y, a, _ = rows(2)
    got = auc_interval(y, a)
    _, ref_cov = reference_delong(y, a)
    se = math.sqrt(ref_cov[0, 0])
    assert got.se == pytest.approx(se, rel=1e-9)
    assert (got.lo, got.hi) == pytest.approx((got.auc - 1.959964 * se, got.auc + 1.959964 * se))
    wider = auc_interval(y, a, level=0.99)
    assert wider.lo < got.lo and wider.hi > got.hi
    assert (wider.hi - wider.auc) / se == pytest.approx(2.575829, rel=1e-5)


def test_the_interval_covers_the_true_auc_about_95_times_in_100() -> None:
    """Draws from one population whose AUC is known (binormal, separation 1: Phi(1/sqrt 2))."""
    true_auc = 0.5 * (1 + math.erf(1 / math.sqrt(2) / math.sqrt(2)))
    covered = 0
    for seed in range(200):
        rng = np.random.default_rng(100 + seed)
        y = (rng.random(400) < 0.5).astype(np.int64)
        s = y + rng.normal(0, 1, 400)
        iv = auc_interval(y, s)
        covered += iv.lo <= true_auc <= iv.hi
    assert 180 <= covered <= 199, covered  # 95% of 200 = 190; binomial sd ~3


def test_paired_verdicts() -> None:
    y, a, b = rows(3, n=3000, noise=(0.3, 1.5))  # AUC 0.714 vs 0.656
    better = compare_aucs(y, a, b)
    assert better.verdict == "ahead" and better.lo > 0 and better.p_value < 0.05, better
    assert compare_aucs(y, b, a).verdict == "behind"
    # the same model with a little noise: no evidence
    rng = np.random.default_rng(4)
    same = compare_aucs(y, a, a + rng.normal(0, 1e-3, a.size))
    assert same.verdict == "within noise" and same.p_value > 0.05, same
    assert compare_aucs(y, a, a).p_value == 1.0
    # pairing matters: the unpaired intervals of two close models overlap while the paired
    # test, whose errors cancel, still tells them apart
    y, a, b = rows(5, n=3000, noise=(0.3, 0.6))  # 0.713 [0.693, 0.733] vs 0.694 [0.673, 0.714]
    ia, ib, paired = auc_interval(y, a), auc_interval(y, b), compare_aucs(y, a, b)
    assert ia.lo < ib.hi and paired.verdict == "ahead", (ia, ib, paired)


def test_one_class_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="at least 2 positives and 2 negatives"):
        auc_interval(np.array([1, 0, 0, 0]), np.array([0.9, 0.1, 0.2, 0.3]))
