"""ROC AUC, the one definition every stage reports (and NE in numpy: :func:`normalized_entropy`).

Training's evaluation (``training/metrics/log.py``), the export's parity check, the synthetic
data's oracle, the served model's evaluation (``serving.tools.evaluate``: numpy, no torch) and
the GPU check (``serving.tools.gpu_check``: torch, no numpy) all call :func:`roc_auc`, so
their AUCs are comparable to the last digit. It takes numpy arrays or torch tensors and imports
only the library of what it is given. Both backends compute the same float64 rank sums (exact:
half-integers), so they agree bit for bit.
"""

from __future__ import annotations

from typing import Any


def roc_auc(labels: Any, scores: Any) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (both ``[N]``; numpy arrays,
    or torch tensors on any device).

    Rank-based (Mann-Whitney U): tied scores get their average rank, so a tie between a
    positive and a negative counts one half. Raises ``ValueError`` unless both classes occur.
    """
    torch_input = type(scores).__module__.partition(".")[0] == "torch"
    rank_sum, n_pos, n = (_torch_ranks if torch_input else _numpy_ranks)(labels, scores)
    n_neg = n - n_pos
    if n_pos == 0 or n_neg == 0:
        only = "positives" if n_pos else "negatives"
        raise ValueError(
            f"AUC needs both labels (at least one positive and one negative); "
            f"the {n} rows have only {only}"
        )
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def _numpy_ranks(labels: Any, scores: Any) -> tuple[float, int, int]:
    """(sum of the positives' average 1-based ranks, positives, rows) with numpy."""
    import numpy as np

    y = np.asarray(labels).reshape(-1).astype(bool)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    _check_lengths(y.size, s.size)
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0  # (first rank + last rank) / 2 per value
    return float(avg_rank[inverse.reshape(-1)][y].sum()), int(y.sum()), int(y.size)


def _torch_ranks(labels: Any, scores: Any) -> tuple[float, int, int]:
    """:func:`_numpy_ranks` with torch (on the scores' device)."""
    import torch

    s = scores.detach().reshape(-1).to(torch.float64)
    y = torch.as_tensor(labels, device=s.device).reshape(-1).bool()
    _check_lengths(y.numel(), s.numel())
    _, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)
    avg_rank = torch.cumsum(counts, 0).to(torch.float64) - (counts.to(torch.float64) - 1) / 2.0
    return float(avg_rank[inverse][y].sum()), int(y.sum()), int(y.numel())


def _check_lengths(labels: int, scores: int) -> None:
    if labels != scores:
        raise ValueError(f"labels and scores differ in length: {labels} vs {scores}")


# What TorchRec's NE clamps probabilities (and the base rate) to: NEMetric's default eta.
NE_ETA = 1e-12


def normalized_entropy(labels: Any, probs: Any) -> float:
    """Log loss of ``probs`` over ``labels`` (numpy ``[N]``) divided by that of predicting
    their base rate for every row: TorchRec's NE (its clamp, ``NE_ETA``) in numpy. 1.0 = no
    better than the base rate; lower is better. NaN for no rows."""
    import numpy as np

    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    p = np.clip(np.asarray(probs, dtype=np.float64).reshape(-1), NE_ETA, 1 - NE_ETA)
    _check_lengths(y.size, p.size)
    if y.size == 0:
        return float("nan")
    ce = -(y * np.log(p) + (1 - y) * np.log(1 - p)).sum()
    ctr = min(max(float(y.mean()), NE_ETA), 1 - NE_ETA)
    norm = -(y.sum() * np.log(ctr) + (y.size - y.sum()) * np.log(1 - ctr))
    return float(ce / norm)
