"""The one ROC AUC (``recsys_stack.metrics.roc_auc``): right, the same on numpy and on torch,
and the function every stage's report calls."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from recsys_stack.metrics import roc_auc


def _auc_brute(labels: np.ndarray, scores: np.ndarray) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = sum((p > n) + 0.5 * (p == n) for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_roc_auc_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    for n in (2, 5, 17, 60):
        labels = rng.integers(0, 2, n)
        labels[:2] = [0, 1]
        scores = rng.integers(0, 4, n).astype(np.float32)  # many ties
        assert roc_auc(labels, scores) == pytest.approx(_auc_brute(labels, scores))
        t = roc_auc(torch.from_numpy(labels), torch.from_numpy(scores))
        assert t == pytest.approx(_auc_brute(labels, scores))
    assert roc_auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.2, 0.3, 0.4])) == 1.0
    assert roc_auc(np.array([1, 1, 0, 0]), np.array([0.1, 0.2, 0.3, 0.4])) == 0.0
    assert roc_auc(np.array([0, 1]), np.array([0.5, 0.5])) == 0.5


def test_numpy_and_torch_agree_bit_for_bit() -> None:
    rng = np.random.default_rng(1)
    n = 200_000
    labels = (rng.random(n) < 0.25).astype(np.float32)
    scores = np.round(rng.random(n), 3).astype(np.float32)  # ties everywhere
    want = roc_auc(labels, scores)
    assert roc_auc(torch.from_numpy(labels), torch.from_numpy(scores)) == want
    assert roc_auc(labels.astype(bool), scores.astype(np.float64)) == want  # dtypes do not matter
    assert roc_auc(torch.from_numpy(labels).int(), torch.from_numpy(scores).double()) == want


def test_errors_name_the_problem() -> None:
    for y, p in [(np.ones(3), np.zeros(3)), (torch.zeros(4), torch.arange(4.0))]:
        with pytest.raises(ValueError, match=r"both labels.*one positive and one negative"):
            roc_auc(y, p)
    with pytest.raises(ValueError, match="differ in length: 3 vs 2"):
        roc_auc(np.array([0, 1, 1]), np.array([0.1, 0.2]))


def test_every_report_calls_the_same_function() -> None:
    """Training's eval, the export's parity, the served evaluation and the GPU check."""
    from serving.tools import evaluate, gpu_check
    from training.data import synthetic
    from training.export import parity
    from training.metrics import log as metrics

    for module in (metrics, parity, synthetic, evaluate):
        assert module.roc_auc is roc_auc, module.__name__
    labels, scores = torch.tensor([0, 1, 1, 0]), torch.tensor([0.1, 0.7, 0.4, 0.4])
    assert gpu_check.auc(labels, scores) == roc_auc(labels, scores) == 0.875
    assert np.isnan(gpu_check.auc(torch.ones(3), torch.rand(3)))  # its report prints NaN
