"""Gradient-boosted trees (LightGBM) beside the linear baseline: ``baseline.trees = true``.

A linear model cannot cross features; trees can, without embeddings. A DLRM that does not
beat them on the same rows has not earned its tables either. Features are the ones the linear
baseline sees, in the form trees use: the 13 dense values raw (a tree's split does not care
for their scale), and each categorical field's ids as LightGBM categories, the ids seen on at
least ``baseline.trees_min_count`` training rows each a category of its own, the rarer and
the unseen sharing one (``0``): a category per id seen once would only be memorized.

Fitted on the first ``baseline.max_rows`` of the model's training rows, stopped early on the
validation rows' AUC (at most ``baseline.trees_rounds`` rounds), reported on the test rows:
``trees_auc``, ``trees_auc_ci``, ``trees_ne`` and, against the model on the same rows,
``vs_trees`` (DeLong, paired). Deterministic (LightGBM's ``deterministic`` mode, one seed).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from training.data.loader import Arrays
from training.features import NUM_SPARSE
from training.metrics.baseline import describe, figures
from training.metrics.baseline_config import BaselineConfig

logger = logging.getLogger("training")
PATIENCE = 50  # rounds without a better validation AUC before the trees stop


class Categories:
    """Each categorical field's frequent ids (those of at least ``min_count`` rows) and
    their codes ``1..K``; :meth:`codes` gives ``0`` to every other id."""

    def __init__(self, sparse: np.ndarray, min_count: int) -> None:
        self.kept: list[np.ndarray] = []
        for f in range(NUM_SPARSE):
            ids, counts = np.unique(np.asarray(sparse[:, f], dtype=np.int64), return_counts=True)
            self.kept.append(ids[counts >= min_count])  # sorted, as np.unique returns them

    def codes(self, sparse: np.ndarray) -> np.ndarray:
        """``int32[N, 26]`` codes of the ids ``sparse`` (``[N, 26]``)."""
        out = np.zeros((len(sparse), NUM_SPARSE), dtype=np.int32)
        for f, kept in enumerate(self.kept):
            if not len(kept):
                continue
            ids = np.asarray(sparse[:, f], dtype=np.int64)
            pos = np.minimum(np.searchsorted(kept, ids), len(kept) - 1)
            out[:, f] = np.where(kept[pos] == ids, pos + 1, 0)
        return out


def features(arrays: Arrays, idx: np.ndarray, cats: Categories) -> np.ndarray:
    """``float32[N, 39]``: the 26 categorical codes, then the 13 raw dense values."""
    return np.hstack(
        [cats.codes(np.asarray(arrays.sparse[idx])), np.asarray(arrays.dense[idx], np.float32)]
    ).astype(np.float32)


def fit(
    train: Arrays, order: np.ndarray, valid: Arrays, cfg: BaselineConfig
) -> tuple[Any, Categories, int]:
    """The booster fitted on the first ``cfg.max_rows`` rows of ``order``, stopped early on
    ``valid``; its categories; the training rows it saw."""
    import lightgbm as lgb  # heavy, and only for runs that ask for trees

    rows = np.sort(order[: cfg.max_rows])
    cats = Categories(np.asarray(train.sparse[rows]), cfg.trees_min_count)
    categorical = list(range(NUM_SPARSE))
    dtrain = lgb.Dataset(
        features(train, rows, cats), np.asarray(train.labels[rows], np.float32),
        categorical_feature=categorical, free_raw_data=True,
    )  # fmt: skip
    dvalid = dtrain.create_valid(
        features(valid, np.arange(len(valid)), cats), np.asarray(valid.labels, np.float32)
    )
    params = {
        "objective": "binary", "metric": "auc", "learning_rate": cfg.trees_learning_rate,
        "num_leaves": cfg.trees_leaves, "seed": 0, "deterministic": True,
        "force_row_wise": True, "num_threads": len(os.sched_getaffinity(0)), "verbose": -1,
    }  # fmt: skip
    booster = lgb.train(
        params, dtrain, num_boost_round=cfg.trees_rounds, valid_sets=[dvalid],
        callbacks=[lgb.early_stopping(PATIENCE, verbose=False)],
    )  # fmt: skip
    return booster, cats, len(rows)


def fit_and_score(
    train: Arrays,
    order: np.ndarray,
    valid: Arrays,
    test: Arrays,
    cfg: BaselineConfig,
    scored: Any = None,
) -> dict[str, Any]:
    """The trees' figures on ``test`` (``trees_*``), against the model's ``scored`` ``(labels,
    probs)`` on those rows (``vs_trees``), and the rounds, rows and seconds they cost."""
    t0 = time.perf_counter()
    booster, cats, rows = fit(train, order, valid, cfg)
    rounds = int(booster.best_iteration) or int(booster.current_iteration())
    p = booster.predict(features(test, np.arange(len(test)), cats), num_iteration=rounds)
    out = figures("trees", np.asarray(test.labels), np.asarray(p, np.float64), scored)
    out.update(
        trees_rounds=rounds, trees_valid_auc=round(float(booster.best_score["valid_0"]["auc"]), 6),
        trees_train_rows=rows, trees_seconds=round(time.perf_counter() - t0, 2),
    )  # fmt: skip
    logger.info(
        "trees (LightGBM, %d rounds of %d leaves, stopped on %s validation rows, %s training "
        "rows): %s on %s test rows, %.1f s",
        rounds, cfg.trees_leaves, f"{len(valid):,}", f"{rows:,}", describe(out, "trees"),
        f"{len(test):,}", out["trees_seconds"],
    )  # fmt: skip
    return out


def judge(record: dict[str, Any]) -> list[str]:
    """The warning of a record whose model is behind the trees on the same rows (the paired
    test's verdict, ``vs_trees``); none otherwise."""
    if record.get("vs_trees") != "behind":
        return []
    delta, (lo, hi) = record["vs_trees_auc"], record["vs_trees_ci"]
    rows = record.get("baseline_test_rows") or record.get("eval_rows", 0)
    return [
        "the model is behind gradient-boosted trees fitted on its training rows (AUC "
        f"{record['trees_auc'] + delta:.4f} vs {record['trees_auc']:.4f}: {delta:+.4f} with a "
        f"95% interval [{lo:+.4f}, {hi:+.4f}] (DeLong, paired), on the same {rows:,} test "
        "rows): trees cross the features without embeddings; try larger tables or embeddings "
        "(model.*), other learning rates (optim.*) or more rows"
    ]
