"""How synthetic click logs drift from day to day (``python -m training.data.synthetic --days N
--drift D`` writes the days).

Day 0 is the planted model of the spec (:func:`training.data.planted.build_model`). Each next
day changes it by the documented amount ``D`` in ``[0, 1]``:

- **click model**: every per-id effect, interaction vector and dense coefficient becomes
  ``x_d = sqrt(1 - D) * x_{d-1} + sqrt(D) * noise`` with noise of the spec's scale: a fraction
  ``D`` of each term's variance is redrawn, its size stays, and its correlation with day 0 is
  ``(1 - D) ** (d / 2)``. The bias is recalibrated so the mean CTR stays ``target_ctr``.
- **id popularity**: ``round(D * V)`` of each feature's ``V`` Zipf ranks, chosen at random, are
  dealt out again among the ids that held them: ids leave the head and others rise from the
  tail, so a model that learned the old head meets ids it has rarely seen.

``D = 0`` is the same model every day (other rows). Each day's rows are drawn with a seed of
their own; ``day_<d>.prob.npy`` holds the day's true probabilities. :func:`drift_report`
measures what the drift costs a model frozen after day 0 without training one: the AUC of the
day-0 planted model (the best a frozen model can do) against each day's own.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from recsys_stack.metrics import roc_auc
from training.data.planted import (
    CALIBRATION_ROWS,
    PlantedModel,
    SyntheticSpec,
    build_model,
    calibrate_bias,
    row_logits,
    sample_block,
)
from training.features import NUM_DENSE


def next_day(model: PlantedModel, spec: SyntheticSpec, drift: float, day: int) -> PlantedModel:
    """The planted model of ``day`` from the one of ``day - 1`` (module doc); seeded by
    ``(spec.seed, day)``."""
    if not 0.0 <= drift <= 1.0:
        raise ValueError(f"drift = {drift}: must be in [0, 1]")
    rng = np.random.default_rng([spec.seed, 4, day])
    keep, fresh = np.sqrt(1.0 - drift), np.sqrt(drift)
    out = copy.deepcopy(model)
    for e in out.effects.values():
        e[:] = keep * e + fresh * rng.normal(0.0, spec.sparse_scale, e.shape)
        e[-1] = 0.0  # a missing id has no effect
    scale = (spec.interaction_scale**2 / spec.interaction_rank) ** 0.25
    for m in (out.u, out.v):
        m[:] = keep * m + fresh * rng.normal(0.0, scale, m.shape)
        m[-1] = 0.0
    out.dense_coef = keep * out.dense_coef + fresh * rng.normal(0.0, spec.dense_scale, NUM_DENSE)
    vocab = spec.vocab_sizes
    popularity = out.popularity or [np.arange(v, dtype=np.int64) for v in vocab]
    for order in popularity:
        moved = rng.choice(len(order), round(drift * len(order)), replace=False)
        order[moved] = order[rng.permutation(moved)]
    out.popularity = popularity
    sample = sample_block(out, spec, np.random.default_rng([spec.seed, 5, day]), CALIBRATION_ROWS)
    out.bias = calibrate_bias(row_logits(out, spec, sample.ranks, sample.dense), spec.target_ctr)
    return out


def day_models(spec: SyntheticSpec, days: int, drift: float) -> list[PlantedModel]:
    """The planted models of days ``0 .. days - 1``."""
    models = [build_model(spec)]
    for day in range(1, days):
        models.append(next_day(models[-1], spec, drift, day))
    return models


@dataclass
class DayReport:
    """What drift costs on one day: the day's own planted model (the oracle) and day 0's."""

    day: int
    oracle_auc: float
    day0_auc: float

    @property
    def loss(self) -> float:
        return self.oracle_auc - self.day0_auc


def drift_report(spec: SyntheticSpec, days: int, drift: float, rows: int) -> list[DayReport]:
    """AUC of each day's planted model and of day 0's on ``rows`` fresh rows of each day."""
    models = day_models(spec, days, drift)
    out = []
    for day, model in enumerate(models):
        block = sample_block(model, spec, np.random.default_rng([spec.seed, 6, day]), rows)
        logits0 = row_logits(models[0], spec, block.ranks, block.dense) + models[0].bias
        out.append(
            DayReport(day, roc_auc(block.labels, block.prob), roc_auc(block.labels, logits0))
        )
    return out
