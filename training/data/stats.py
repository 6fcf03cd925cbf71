"""Small numpy metrics shared by the data tools and their tests."""

from __future__ import annotations

import numpy as np


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (both shape ``[N]``).

    Rank-based (Mann-Whitney U); tied scores get their average rank, so a tie between a
    positive and a negative counts one half. Raises ``ValueError`` unless both classes occur.
    """
    y = np.asarray(labels).reshape(-1).astype(bool)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"labels and scores differ in length: {y.size} vs {s.size}")
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("roc_auc needs at least one positive and one negative label")
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    # 1-based average rank of each distinct value: (first rank + last rank) / 2.
    ends = np.cumsum(counts)
    avg_rank = ends - (counts - 1) / 2.0
    rank_sum = float(avg_rank[inverse][y].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)
