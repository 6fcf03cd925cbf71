"""The linear baseline (training.metrics.baseline) and the numpy NE it is reported in: in-process,
on rows with a planted linear click model (what a logistic regression can learn)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recsys_stack.metrics import normalized_entropy
from training.data.loader import Arrays
from training.features import NUM_DENSE, NUM_SPARSE
from training.metrics import baseline, baseline_search
from training.metrics.baseline_config import BaselineConfig
from training.metrics.log import EvalMetrics


def planted(n: int, seed: int) -> Arrays:
    """``n`` rows whose click logit is a sum of per-id effects of 4 fields and of one dense
    field's log; ids of 50 values (-1 = missing, 5%), raw dense counts."""
    rng = np.random.default_rng(seed)
    sparse = rng.integers(0, 50, size=(n, NUM_SPARSE))
    sparse[rng.random((n, NUM_SPARSE)) < 0.05] = -1
    dense = rng.poisson(3.0, size=(n, NUM_DENSE)).astype(np.float32)
    effects = np.random.default_rng(99).normal(0, 1.0, size=(4, 51))  # [field, id + 1]
    logit = -1.0 + sum(effects[f, sparse[:, f] + 1] for f in range(4)) + np.log1p(dense[:, 0])
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    return Arrays(labels, dense, sparse.astype(np.int32), None)


def test_it_learns_a_linear_signal_deterministically() -> None:
    train, valid, test = planted(20_000, seed=1), planted(3_000, seed=3), planted(5_000, seed=2)
    order = np.random.default_rng(0).permutation(len(train))
    cfg = BaselineConfig(hash_bits=16)
    first = baseline_search.fit_and_score(train, order, valid, test, cfg)
    again = baseline_search.fit_and_score(train, order, valid, test, cfg)
    assert first["baseline_auc"] > 0.75 and first["baseline_ne"] < 0.85, first
    for key in ("baseline_auc", "baseline_ne", "baseline_l2"):  # the same rows: the same bits
        assert first[key] == again[key]
    assert first["baseline_train_rows"] == 20_000 and first["baseline_seconds"] < 120
    assert (first["baseline_valid_rows"], first["baseline_test_rows"]) == (3_000, 5_000)
    assert first["baseline_l2"] in [t["l2"] for t in first["baseline_search"]]
    # a tenth of the rows learns less: it sees what it is given
    few = baseline_search.fit_and_score(train, order[:2_000], valid, test, cfg)
    assert few["baseline_auc"] < first["baseline_auc"] and few["baseline_train_rows"] == 2_000


def test_features_hash_each_field_and_value_apart() -> None:
    rows = Arrays(
        np.zeros(3, np.int8),
        np.array([[0.0] * NUM_DENSE, [1e9] * NUM_DENSE, [-5.0] * NUM_DENSE], np.float32),
        np.array([[7] * NUM_SPARSE, [-1] * NUM_SPARSE, [0] * NUM_SPARSE], np.int64),
        None,
    )
    idx = baseline.feature_index(rows, np.arange(3), bits=20)
    assert idx.shape == (3, NUM_SPARSE + NUM_DENSE) and idx.min() >= 0 and idx.max() < 2**20
    assert len(set(idx[0, :NUM_SPARSE])) == NUM_SPARSE  # one value, 26 fields: 26 weights
    assert idx[1, 0] != idx[2, 0]  # a missing id is a value of its own, not id 0
    assert (idx[2, NUM_SPARSE:] == idx[0, NUM_SPARSE:]).all()  # negative counts are 0's bucket
    assert (idx[1, NUM_SPARSE:] != idx[0, NUM_SPARSE:]).all()


def test_a_saved_baseline_scores_as_it_did(tmp_path: Path) -> None:
    train, held_out = planted(3_000, seed=1), planted(1_000, seed=2)
    model = baseline.from_config(BaselineConfig(hash_bits=12))
    model.fit(train, np.arange(len(train)))
    model.save(tmp_path)
    loaded = baseline.from_config(BaselineConfig(hash_bits=12))
    assert loaded.load(tmp_path) and loaded.rows_seen == 3_000
    assert np.array_equal(loaded.predict(held_out), model.predict(held_out))
    assert not baseline.from_config(BaselineConfig(hash_bits=14)).load(tmp_path)  # other bits
    assert not loaded.load(tmp_path / "nowhere")


def test_numpy_ne_is_torchrecs() -> None:
    rng = np.random.default_rng(5)
    y = (rng.random(4_000) < 0.3).astype(np.float32)
    p = np.clip(rng.random(4_000) * 0.6 + 0.1 * y, 0, 1).astype(np.float32)
    metrics = EvalMetrics(4_000, with_oracle=False)
    metrics.update(torch.from_numpy(p), torch.from_numpy(y), torch.ones(4_000))
    assert normalized_entropy(y, p) == pytest.approx(metrics.compute()["ne"], rel=1e-6)
    assert normalized_entropy(y, np.full(4_000, y.mean())) == pytest.approx(1.0)


def test_the_judgement_names_what_the_model_lost() -> None:
    record = {"auc": 0.80, "ne": 0.85, "eval_rows": 2_000}
    assert baseline.judge(record) == []  # no baseline figures: nothing to say
    assert baseline.judge({**record, "baseline_auc": 0.79, "baseline_ne": 0.86}) == []
    (warning,) = baseline.judge({**record, "baseline_auc": 0.81, "baseline_ne": 0.84})
    assert "(AUC 0.8000 vs 0.8100, NE 0.8500 vs 0.8400, on the same 2,000 held-out rows)" in warning
    (warning,) = baseline.judge({**record, "baseline_auc": 0.70, "baseline_ne": 0.80})
    assert "(NE 0.8500 vs 0.8000," in warning and "AUC" not in warning.split("(")[1]


def test_a_lead_within_the_noise_is_no_lead() -> None:
    """With the paired test in the record, the AUC must be "ahead": 0.80 over 0.79 on 2,000
    rows within noise warns, and says the interval."""
    record = {"auc": 0.80, "ne": 0.85, "eval_rows": 2_000, "baseline_auc": 0.79,
              "baseline_ne": 0.86}  # fmt: skip
    assert baseline.judge({**record, "vs_baseline": "ahead"}) == []
    (warning,) = baseline.judge(
        {**record, "vs_baseline": "within noise", "vs_baseline_ci": [-0.004, 0.024]}
    )
    assert (
        "AUC 0.8000 vs 0.7900: within noise, +0.0100 with a 95% interval [-0.0040, +0.0240]"
        in warning
    )


def test_the_model_is_tested_against_the_baseline_on_the_same_rows() -> None:
    """score() with the model's (labels, probs): DeLong's paired verdict; rows that are not the
    baseline's (another order) get none rather than a wrong one."""
    train, held = planted(20_000, 1), planted(4_000, 2)
    model = baseline.from_config(BaselineConfig())
    model.fit(train, np.arange(len(train)), 1)
    y = np.asarray(held.labels)
    better = np.where(y == 1, 0.9, 0.1)  # a perfect model
    out = baseline.score(model, held, (y, better))
    assert out["vs_baseline"] == "ahead" and out["vs_baseline_ci"][0] > 0, out
    lo, hi = out["baseline_auc_ci"]
    assert lo < out["baseline_auc"] < hi
    worse = np.random.default_rng(3).random(len(y))  # chance
    assert baseline.score(model, held, (y, worse))["vs_baseline"] == "behind"
    assert "vs_baseline" not in baseline.score(model, held, (y[::-1], better[::-1]))


def test_inverted_labels_are_not_a_training_problem() -> None:
    """Both models below chance on the same rows (issue 47: a file with flipped labels was
    told to 'train on more rows or epochs')."""
    record = {"auc": 0.27, "ne": 1.6, "baseline_auc": 0.31, "baseline_ne": 1.2, "eval_rows": 2_000}
    (warning,) = baseline.judge(record)
    assert "labels look inverted" in warning and "train on more" not in warning, warning


def test_the_judgement_quotes_the_paired_tests_rows() -> None:
    """The AUCs in the warning are those of the rows both were scored on (the paired test's),
    not the model's figure on other rows."""
    record = {"auc": 0.8047, "ne": 0.80, "eval_rows": 2_000, "baseline_auc": 0.7876,
              "baseline_ne": 0.82, "vs_baseline": "within noise", "vs_baseline_auc": 0.0055,
              "vs_baseline_ci": [-0.0129, 0.0239]}  # fmt: skip
    (warning,) = baseline.judge(record)
    assert "AUC 0.7931 vs 0.7876: within noise, +0.0055 with a 95% interval" in warning, warning
