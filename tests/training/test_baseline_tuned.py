"""The report's baselines as a fair bar: the linear one against an independent scikit-learn L2
logistic regression on the same hashed features, tuned on validation rows the same way; the
LightGBM trees on rows with a feature cross; the L-BFGS solve they rest on.

Rows come from the synthetic data's planted click model (Zipf ids, per-id effects, a low-rank
C1 x C2 cross): 8,000 training rows, as on the issue's real Criteo sample, where most ids are
rare and the penalty decides the AUC."""

from __future__ import annotations

import re
import warnings
from typing import Any

import numpy as np
import pytest

from recsys_stack.metrics import roc_auc
from training.data.loader import Arrays
from training.data.planted import SyntheticSpec, build_model, sample_block
from training.metrics import baseline, baseline_search, l2_logistic, trees
from training.metrics.baseline_config import BaselineConfig

BITS = 18
TARGET = 0.003  # the issue's: the built-in baseline within 0.003 AUC of scikit-learn's


@pytest.fixture(scope="module")
def splits() -> tuple[Arrays, Arrays, Arrays]:
    """8,000 training, 4,000 validation and 8,000 test rows of one planted model."""
    spec = SyntheticSpec(seed=0)
    model = build_model(spec)

    def draw(n: int, seed: int) -> Arrays:
        b = sample_block(model, spec, np.random.default_rng([7, seed]), n)
        return Arrays(b.labels, b.dense.astype(np.float32), b.ranks, b.prob.astype(np.float32))

    return draw(8_000, 1), draw(4_000, 2), draw(8_000, 3)


def one_hot(fitted: Arrays, *others: Arrays) -> list[Any]:
    """The baseline's hashed features as scikit-learn's sparse input: a column per weight the
    training rows use (an unseen one dropped: an L2 fit leaves it 0). A weight two fields of
    one row share counts once here, twice in the baseline (a row in a few hundred)."""
    from sklearn.preprocessing import MultiLabelBinarizer

    idx = [baseline.feature_index(a, np.arange(len(a)), BITS) for a in (fitted, *others)]
    onehot = MultiLabelBinarizer(sparse_output=True).fit(idx[0].tolist())
    with warnings.catch_warnings():  # "unknown class(es) ... will be ignored": as they should
        warnings.simplefilter("ignore", UserWarning)
        return [onehot.transform(i.tolist()).astype(np.float64).tocsr() for i in idx]


def test_the_linear_baseline_is_as_good_as_scikit_learns(splits) -> None:
    """scikit-learn's L2 LogisticRegression (lbfgs), C chosen on the validation rows from
    its own grid, scored on the test rows: the built-in baseline within 0.003 AUC of it (it
    was 0.017 under with one AdaGrad pass at learning rate 0.1, checked below too)."""
    from sklearn.linear_model import LogisticRegression

    train, valid, test = splits
    x_train, x_valid, x_test = one_hot(train, valid, test)
    best = (-1.0, 0.0, None)
    fits = {}
    for l2 in (100.0, 50.0, 20.0, 10.0, 5.0):
        sk = LogisticRegression(C=1 / l2, max_iter=2_000).fit(x_train, train.labels)
        fits[l2] = auc = roc_auc(valid.labels, sk.predict_proba(x_valid)[:, 1])
        best = max(best, (auc, l2, sk), key=lambda t: t[0])
    sk_auc = roc_auc(test.labels, best[2].predict_proba(x_test)[:, 1])

    order = np.random.default_rng(0).permutation(len(train))
    cfg = BaselineConfig(hash_bits=BITS)
    out = baseline_search.fit_and_score(train, order, valid, test, cfg)
    assert out["baseline_auc"] > sk_auc - TARGET, (out["baseline_auc"], sk_auc, best[:2])
    # the same penalty, the same optimum: their validation AUCs agree closely
    same = [t for t in out["baseline_search"] if t["l2"] in fits]
    assert same and all(abs(t["valid_auc"] - fits[t["l2"]]) < 5e-4 for t in same), (same, fits)

    # what the report had: one pass of AdaGrad, learning rate 0.1, no penalty, no search
    untuned = baseline.HashedLogisticRegression(bits=BITS, lr=0.1)
    untuned.fit(train, order)
    y, p = np.asarray(test.labels), untuned.predict(test)
    assert roc_auc(y, p) < sk_auc - TARGET  # the gap this test exists to close


def test_the_penalty_is_chosen_on_validation_rows_only(splits) -> None:
    """The choice moves with the validation rows and never sees the test rows: the same fit
    scored on two test sets chooses the same penalty; a validation set of other rows may not."""
    train, valid, test = splits
    order = np.arange(len(train))
    cfg = BaselineConfig(hash_bits=BITS, l2=[100.0, 10.0, 1.0])
    a = baseline_search.fit_and_score(train, order, valid, test, cfg)
    b = baseline_search.fit_and_score(train, order, valid, test.rows(0, 2_000), cfg)
    assert a["baseline_l2"] == b["baseline_l2"] and a["baseline_search"] == b["baseline_search"]
    assert a["baseline_valid_auc"] == max(t["valid_auc"] for t in a["baseline_search"])
    # the path stops past its top: 100 -> 10 -> 1 rises then falls, then one step between
    tried = [t["l2"] for t in a["baseline_search"]]
    assert tried[:2] == [100.0, 10.0] and len(tried) <= 4, tried


def test_lbfgs_reaches_the_penalized_optimum(monkeypatch: pytest.MonkeyPatch) -> None:
    """From any start, the solve ends where a far tighter one does (the objective within 1e-6
    of it, the gradient ~0 per row): the optimum, not where the iterations ran out."""
    rng = np.random.default_rng(0)
    hashed = rng.integers(0, 500, size=(3_000, 5))
    y = (rng.random(3_000) < 0.3).astype(np.float64)
    cols = l2_logistic.Columns.of(hashed)
    starts = (np.zeros(len(cols.used) + 1), rng.normal(0, 1, len(cols.used) + 1))
    solved = [l2_logistic.solve(cols.cols, y, 2.0, start) for start in starts]
    monkeypatch.setattr(l2_logistic, "FTOL", 1e-14)
    tight, _ = l2_logistic.solve(cols.cols, y, 2.0, starts[0], max_iter=5_000)
    f_tight, _ = l2_logistic.objective(tight, cols.cols, y, 2.0)
    for theta, iterations in solved:
        f, grad = l2_logistic.objective(theta, cols.cols, y, 2.0)
        assert iterations < l2_logistic.MAX_ITER and f - f_tight < 1e-6 * f_tight, (f, f_tight)
        assert np.abs(grad).max() < 1e-4 * len(y), np.abs(grad).max()
    # a weight the training rows never used is 0 for other rows
    mapped = cols.map(np.array([[hashed[0, 0], 10_000]]))
    assert mapped[0, 0] == np.searchsorted(cols.used, hashed[0, 0])
    assert mapped[0, 1] == len(cols.used)


def test_trees_report_on_test_rows_against_the_model(splits) -> None:
    """LightGBM on the planted rows: stopped early on validation, a sane AUC on the test rows
    with its interval, the paired test against a model's scores, deterministic."""
    train, valid, test = splits
    order = np.arange(len(train))
    cfg = BaselineConfig(hash_bits=BITS, trees=True, trees_rounds=300, l2=[30.0])
    y = np.asarray(test.labels)
    oracle = (y, np.asarray(test.prob, np.float64))  # the planted probabilities: the best model
    out = baseline_search.fit_and_score(train, order, valid, test, cfg, oracle)
    assert 0.65 < out["trees_auc"] < roc_auc(y, test.prob), out
    lo, hi = out["trees_auc_ci"]
    assert lo < out["trees_auc"] < hi and 0 < out["trees_ne"] < 1
    assert 1 <= out["trees_rounds"] < 300 and out["trees_train_rows"] == len(train)
    assert out["vs_trees"] == "ahead" and out["vs_baseline"] == "ahead", out
    again = trees.fit_and_score(train, order, valid, test, cfg)
    assert again["trees_auc"] == out["trees_auc"] and "vs_trees" not in again
    # behind the trees: the warning says so, with the interval
    behind = {**out, "vs_trees": "behind", "vs_trees_auc": -0.02, "vs_trees_ci": [-0.03, -0.01]}
    (warning,) = trees.judge(behind)
    assert "behind gradient-boosted trees" in warning and "[-0.0300, -0.0100]" in warning
    assert trees.judge(out) == []


def test_rare_ids_share_one_category() -> None:
    sparse_ids = np.zeros((100, 26), np.int64)
    sparse_ids[:60, 0], sparse_ids[60:, 0] = 5, np.arange(40)  # id 5 on 60 rows, 40 ids once
    cats = trees.Categories(sparse_ids, min_count=20)
    codes = cats.codes(np.array([[5] + [0] * 25, [7] + [0] * 25, [-1] + [0] * 25]))
    assert codes[0, 0] > 0 and codes[1, 0] == 0 and codes[2, 0] == 0  # rare, unseen: 0
    assert (codes[:, 1:] == codes[0, 1]).all() and codes[0, 1] > 0  # id 0: on all 100 rows


def test_the_baseline_keys_come_from_toml_and_the_command_line(tmp_path) -> None:
    from training.config import parse_args
    from training.errors import ConfigError

    toml = tmp_path / "run.toml"
    toml.write_text("[baseline]\ntrees = true\nl2 = [10.0, 1.0]\n")
    cfg = parse_args(["--config", str(toml), "baseline.max_rows=5000", "--baseline.trees-leaves",
                      "15"]).config.baseline  # fmt: skip
    assert (cfg.trees, cfg.l2, cfg.max_rows, cfg.trees_leaves) == (True, [10.0, 1.0], 5000, 15)
    for override, message in [("baseline.l2=[]", "baseline.l2 = []: must be one or more values > 0"),
                              ("baseline.l2=[0.0]", "must be one or more values > 0"),
                              ("baseline.trees_min_count=0", "baseline.trees_min_count = 0: must be >= 1")]:  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_args([override])
