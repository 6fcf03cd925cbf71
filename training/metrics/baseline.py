"""The hashed logistic regression, in numpy: its features, the continuous loop's online fit, and
the warning when a model loses to a baseline.

A deep model that does not beat a linear one on the same rows is not worth serving, and
nothing else tells a user so (on 8,000 real Criteo rows the tiny DLRM reached AUC 0.734, a
hashed logistic regression 0.749). A training run's report fits the same features by an exact
L2 solve tuned on validation rows (:mod:`training.metrics.baseline_search`); the continuous
loop fits this online model on the rows it trains; :func:`judge` is the warning when the model
loses.

Features (39 per row, plus a bias): each categorical field's id as the model's loader sees it
(hashed into its table at preprocessing, or raw; a missing field is a value of its own) and
each dense field bucketized on the log scale, ``floor(4 * log1p(max(x, 0)))`` (the model's
transform, binned: a weight per bucket is a free-form function of the value). Each (field,
value) pair hashes (splitmix64) into one of ``2^baseline.hash_bits`` weights.

Fit: AdaGrad on the log loss, in mini-batches whose gradient is summed per weight (a weight
seen once in a batch moves as it would in per-row SGD), passes over the rows in the order given
(the loop's own). The batch grows with the rows so a pass is
about :data:`UPDATES` steps whatever the data's size: the cost is linear in the rows plus a
fixed number of ``2^hash_bits`` scans. Deterministic: fixed order, sums in numpy's fixed order.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recsys_stack.auc_stats import RowsDiffer, auc_interval, compare_scored
from recsys_stack.metrics import normalized_entropy, roc_auc
from training.data.loader import Arrays
from training.features import NUM_DENSE, NUM_SPARSE
from training.metrics.baseline_config import BaselineConfig

logger = logging.getLogger("training")

FIELDS = NUM_SPARSE + NUM_DENSE
BUCKETS_PER_NAT = 4.0  # dense buckets per unit of log1p: a factor e^0.25 = 1.28 apart
UPDATES = 2000  # optimizer steps per pass (the batch is rows / UPDATES, within the bounds below)
MIN_BATCH, MAX_BATCH = 8, 4096
SCORE_CHUNK = 1 << 16  # rows scored at a time (bounded memory on any split)
STATE_FILE = "baseline.npz"  # in a continuous run's checkpoints (HashedLogisticRegression.save)
# A distinct odd constant per field, so equal values of two fields hash apart.
_FIELD_SALT = (np.arange(1, FIELDS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).reshape(
    1, FIELDS
)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on ``uint64`` (wraps, as it should)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def feature_index(arrays: Arrays, idx: np.ndarray, bits: int) -> np.ndarray:
    """The weights of rows ``idx``: ``int64[B, 39]`` in ``[0, 2^bits)`` (26 ids, 13 buckets)."""
    values = np.empty((len(idx), FIELDS), dtype=np.uint64)
    values[:, :NUM_SPARSE] = np.asarray(arrays.sparse[idx], dtype=np.int64).view(np.uint64)
    dense = np.log1p(np.maximum(np.asarray(arrays.dense[idx], dtype=np.float64), 0.0))
    values[:, NUM_SPARSE:] = np.floor(dense * BUCKETS_PER_NAT).astype(np.uint64)
    with np.errstate(over="ignore"):
        mixed = _mix(values + _FIELD_SALT)  # a bijection: two pairs collide only in the bits kept
    return (mixed >> np.uint64(64 - bits)).astype(np.int64)


@dataclass
class HashedLogisticRegression:
    """``2^bits`` weights and a bias, fitted by AdaGrad (``lr``); float64 throughout."""

    bits: int = 20
    lr: float = 0.1

    def __post_init__(self) -> None:
        size = 1 << self.bits
        self.w = np.zeros(size)
        self.acc = np.zeros(size)  # AdaGrad's sum of squared gradients, per weight
        self._grad = np.zeros(size)  # one step's gradient; zero again after each step
        self.b, self.acc_b = 0.0, 0.0
        self.rows_seen = 0

    def logits(self, arrays: Arrays, idx: np.ndarray) -> np.ndarray:
        """``float64[B]`` logits of rows ``idx``."""
        return self._sum(feature_index(arrays, idx, self.bits))

    def _sum(self, cols: np.ndarray) -> np.ndarray:
        return self.w[cols].sum(axis=1) + self.b

    def fit(self, arrays: Arrays, order: np.ndarray, passes: int = 1) -> None:
        """``passes`` passes over rows ``order`` of ``arrays``, in that order."""
        if self.rows_seen == 0 and len(order):  # start from the base rate: fewer steps wasted
            ctr = float(np.clip(np.mean(arrays.labels[np.sort(order)]), 1e-6, 1 - 1e-6))
            self.b = math.log(ctr / (1 - ctr))
        batch = int(np.clip(-(-len(order) // UPDATES), MIN_BATCH, MAX_BATCH))
        for _ in range(passes):
            for lo in range(0, len(order), batch):
                self._step(arrays, np.sort(order[lo : lo + batch]))  # sorted: sequential reads

    def _step(self, arrays: Arrays, idx: np.ndarray) -> None:
        cols = feature_index(arrays, idx, self.bits)
        g = 1.0 / (1.0 + np.exp(-self._sum(cols))) - arrays.labels[idx]  # d loss / d logit
        flat = cols.ravel()
        np.add.at(self._grad, flat, np.repeat(g, FIELDS))  # summed per weight, in row order
        # A weight seen twice in the batch appears twice below, with the same values: the
        # writes agree, so no unique() is needed.
        gh = self._grad[flat]
        acc = self.acc[flat] + gh * gh
        self.acc[flat] = acc
        self.w[flat] -= self.lr * gh / np.maximum(np.sqrt(acc), 1e-12)  # a 0 gradient: no move
        self._grad[flat] = 0.0
        gb = float(g.sum())
        self.acc_b += gb * gb
        self.b -= self.lr * gb / math.sqrt(self.acc_b) if self.acc_b > 0 else 0.0
        self.rows_seen += len(idx)

    def save(self, folder: Path) -> None:
        """Its state as ``folder/baseline.npz`` (a checkpoint's, in the continuous loop): the
        weights that ever moved, exactly (a few thousand on small data, not 2^bits)."""
        hit = np.flatnonzero(self.acc)
        scalars = np.array([self.b, self.acc_b, self.rows_seen, self.bits], dtype=np.float64)
        with (folder / STATE_FILE).open("wb") as f:
            np.savez(f, hit=hit, w=self.w[hit], acc=self.acc[hit], scalars=scalars)

    def load(self, folder: Path) -> bool:
        """The state :meth:`save` left in ``folder``, if it is there and of these bits."""
        path = folder / STATE_FILE
        if not path.is_file():
            return False
        with np.load(path) as z:
            b, acc_b, rows, bits = (float(x) for x in z["scalars"])
            if int(bits) != self.bits:
                return False
            self.__post_init__()
            self.w[z["hit"]], self.acc[z["hit"]] = z["w"], z["acc"]
        self.b, self.acc_b, self.rows_seen = b, acc_b, int(rows)
        return True

    def predict(self, arrays: Arrays) -> np.ndarray:
        """Click probabilities ``float64[N]`` of every row of ``arrays``."""
        out = np.empty(len(arrays))
        for lo in range(0, len(arrays), SCORE_CHUNK):
            idx = np.arange(lo, min(lo + SCORE_CHUNK, len(arrays)))
            out[lo : lo + len(idx)] = self.predict_cols(feature_index(arrays, idx, self.bits))
        return out

    def predict_cols(self, cols: np.ndarray) -> np.ndarray:
        """Click probabilities ``float64[B]`` of rows whose weights are ``cols`` (``[B, 39]``)."""
        return 1.0 / (1.0 + np.exp(-self._sum(cols)))


def score(model: HashedLogisticRegression, arrays: Arrays, scored: Any = None) -> dict[str, Any]:
    """``baseline_auc`` and ``baseline_ne`` of ``model`` on every row of ``arrays``, its AUC's
    95% interval (``baseline_auc_ci``); with ``scored``, the model's ``(labels, probs)`` on
    the same rows, DeLong's paired test of the model against it (:func:`paired`)."""
    return figures("baseline", np.asarray(arrays.labels), model.predict(arrays), scored)


def figures(name: str, y: np.ndarray, p: np.ndarray, scored: Any = None) -> dict[str, Any]:
    """``{name}_auc``, its 95% interval ``{name}_auc_ci`` and ``{name}_ne`` of probabilities
    ``p`` for labels ``y``; with ``scored``, the model's ``(labels, probs)`` on the same rows,
    the paired test of the model against them (``vs_{name}``: :func:`paired`)."""
    out: dict[str, Any] = {f"{name}_auc": roc_auc(y, p), f"{name}_ne": normalized_entropy(y, p)}
    with contextlib.suppress(ValueError):  # fewer than 2 of a class: no interval
        iv = auc_interval(y, p)
        out[f"{name}_auc_ci"] = [round(iv.lo, 6), round(iv.hi, 6)]
    out.update(paired(y, p, scored, name))
    return out


def paired(
    y: np.ndarray, baseline: np.ndarray, scored: Any, name: str = "baseline"
) -> dict[str, Any]:
    """The model against a baseline on the same rows: ``vs_{name}`` ("ahead", "behind",
    "within noise"), the AUC difference, its 95% interval and p-value; nothing when the
    model's rows are not these (other labels in another order) or too few."""
    if scored is None:
        return {}
    try:
        c = compare_scored(scored, (y, baseline))
    except RowsDiffer:
        logger.warning("the model's evaluation rows are not the %s's: no paired test", name)
        return {}
    except ValueError:  # too few of a class
        return {}
    return {f"vs_{name}": c.verdict, f"vs_{name}_auc": round(c.delta, 6),
            f"vs_{name}_ci": [round(c.lo, 6), round(c.hi, 6)],
            f"vs_{name}_p": float(f"{c.p_value:.3g}")}  # fmt: skip


def describe(record: dict[str, Any], name: str) -> str:
    """``AUC a [lo, hi]  NE n`` of baseline ``name`` in ``record``, and the model against it."""
    ci, vs = record.get(f"{name}_auc_ci"), record.get(f"vs_{name}")
    text = f"AUC {record[f'{name}_auc']:.4f}" + (f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "")
    text += f"  NE {record[f'{name}_ne']:.4f}"
    if vs:
        lo, hi = record[f"vs_{name}_ci"]
        text += (f"; the model against it: {vs}, {record[f'vs_{name}_auc']:+.4f} AUC [{lo:+.4f}, "
                 f"{hi:+.4f}] (95%, DeLong paired, p {record[f'vs_{name}_p']:.3g})")  # fmt: skip
    return text


def from_config(cfg: BaselineConfig) -> HashedLogisticRegression:
    """The continuous loop's baseline: ``baseline.learning_rate``, no L2 (it fits online)."""
    return HashedLogisticRegression(bits=cfg.hash_bits, lr=cfg.learning_rate)


def judge(record: dict[str, Any], remedy: str = "") -> list[str]:
    """The warning of a record whose model does not beat its baseline on AUC or on NE (the
    same rows), with what to try (``remedy``: the run's own, which tells overfitting from
    undertraining: :func:`training.metrics.advice.remedy`); none without baseline figures.
    With the paired test
    (``vs_baseline``, :func:`paired`), the AUC must be ``ahead``: a lead within the noise of
    the rows is no lead."""
    keys = ("auc", "ne", "baseline_auc", "baseline_ne")
    if any(not isinstance(record.get(k), int | float) for k in keys):
        return []
    auc, ne, b_auc, b_ne = (float(record[k]) for k in keys)
    if auc < 0.5 and b_auc < 0.5:  # both rank the clicks below the non-clicks: not training
        return [
            f"the model and the linear baseline both score below chance (AUC {auc:.4f} and "
            f"{b_auc:.4f}, on the same {record.get('eval_rows', 0):,} rows): their labels look "
            "inverted, which no training fixes; check the data"
        ]
    verdict = record.get("vs_baseline")
    if verdict in ("behind", "within noise"):
        lo, hi = record.get("vs_baseline_ci") or (math.nan, math.nan)
        delta = float(record.get("vs_baseline_auc", auc - b_auc))  # the paired test's rows
        lost = [f"AUC {b_auc + delta:.4f} vs {b_auc:.4f}: {verdict}, {delta:+.4f} with a 95% "
                f"interval [{lo:+.4f}, {hi:+.4f}] (DeLong, paired)"]  # fmt: skip
    else:
        lost = [f"AUC {auc:.4f} vs {b_auc:.4f}"] if verdict != "ahead" and not auc > b_auc else []
    lost += [f"NE {ne:.4f} vs {b_ne:.4f}"] if not ne < b_ne else []
    if not lost:
        return []
    return [
        "the model does not beat a hashed logistic regression fitted on its training rows "
        f"({', '.join(lost)}, on the same {record.get('eval_rows', 0):,} held-out rows): it "
        "does not earn its cost; "
        + (remedy or "train on more rows or epochs (ARGS='--train.epochs N'), try other "
           "learning rates (optim.dense_lr, optim.embedding_lr) or model sizes (model.*)")
    ]  # fmt: skip
