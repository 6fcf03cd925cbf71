"""The planted click model of the synthetic data: its spec, how it is drawn, how rows are sampled.

Each row's click logit is ``bias + sum_f e_f[id_f] + sum_j b_j * z_j + <u[id_C1], v[id_C2]>``:
per-id effects on ``informative_sparse`` categorical features (chosen by the seed), linear
effects of the standardized ``log1p(max(I_j, 0))`` (what ``features.dense_transform`` feeds the
model; a missing int counts as 0, like the reader), and a low-rank interaction between two
categorical features. The bias is calibrated on a sample so the mean probability is near
``target_ctr``. Ids follow a Zipf law over ``vocab_sizes[f]`` values; the ``k``-th most frequent
id of feature ``f`` is a fixed pseudo-random 32-bit value written as 8 hex digits.
:mod:`training.data.synthetic` writes the rows, :mod:`training.data.drift` moves the model
from day to day.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from training.features import NUM_DENSE, NUM_SPARSE, dense_transform

# Mixed cardinalities like Criteo's (a few tiny, most 10^2..10^4), small enough for CPU tests.
DEFAULT_VOCAB: list[int] = [
    1000, 500, 2000, 200, 100, 20, 5000, 300, 10, 3000, 1500, 800, 4000,
    50, 2500, 10000, 600, 30, 7000, 5, 6000, 40, 1200, 8000, 400, 3500,
]  # fmt: skip
CALIBRATION_ROWS = 50_000


@dataclass
class SyntheticSpec:
    """What to generate; every random choice derives from ``seed``."""

    rows: int = 100_000
    """Number of rows (lines) to write."""
    seed: int = 0
    """Seed of the planted model and of the sampled rows."""
    vocab_sizes: list[int] = field(default_factory=lambda: list(DEFAULT_VOCAB))
    """Distinct ids per categorical feature (26 entries)."""
    zipf: float = 1.15
    """Id frequency exponent: the ``k``-th most frequent id has weight ``(k + 1) ** -zipf``."""
    informative_sparse: int = 8
    """How many categorical features carry a per-id effect."""
    sparse_scale: float = 0.45
    """Standard deviation of each informative id's logit effect."""
    dense_scale: float = 0.2
    """Standard deviation of each dense feature's coefficient (on the standardized log1p)."""
    interaction_features: tuple[int, int] = (0, 1)
    """Feature indices of the low-rank pairwise term (default C1 x C2)."""
    interaction_rank: int = 4
    """Length of the per-id vectors whose dot product forms the pairwise term."""
    interaction_scale: float = 0.5
    """Target standard deviation of the pairwise term."""
    sparse_missing: float = 0.03
    """Probability that a categorical field is empty."""
    dense_missing: float = 0.05
    """Probability that an integer field is empty."""
    target_ctr: float = 0.25
    """Mean click probability the bias is calibrated to."""

    def __post_init__(self) -> None:
        if len(self.vocab_sizes) != NUM_SPARSE or min(self.vocab_sizes) < 1:
            raise ValueError(f"vocab_sizes needs {NUM_SPARSE} positive entries")
        if not 0 <= self.informative_sparse <= NUM_SPARSE:
            raise ValueError(f"informative_sparse must be in 0..{NUM_SPARSE}")
        if not 0.0 < self.target_ctr < 1.0:
            raise ValueError("target_ctr must be in (0, 1)")


def raw_ids(feature: int, ranks: np.ndarray) -> np.ndarray:
    """Frequency ranks ``int64[...]`` of ``feature`` -> raw 32-bit ids (a bijection per feature)."""
    mask = np.uint64(0xFFFFFFFF)
    x = (ranks.astype(np.uint64) * np.uint64(0x9E3779B1)) & mask
    x ^= np.uint64((feature * 0x85EBCA6B + 0x27D4EB2F) & 0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & mask
    x ^= x >> np.uint64(15)
    return x.astype(np.int64)


@dataclass
class PlantedModel:
    """The hidden click model of a spec (all arrays are fixed by ``spec.seed``)."""

    cdfs: list[np.ndarray]  # per feature, float64[V_f] cumulative Zipf weights
    hex_tables: list[np.ndarray]  # per feature, object[V_f + 1] hex strings, last one ''
    informative: list[int]  # feature indices with per-id effects
    effects: dict[int, np.ndarray]  # feature -> float64[V_f + 1] logit effect, last (missing) 0
    u: np.ndarray  # float64[V_a + 1, R], interaction vectors of the first feature
    v: np.ndarray  # float64[V_b + 1, R], of the second; missing rows are 0
    dense_params: np.ndarray  # float64[13, 3]: zero rate, lognormal mu, lognormal sigma
    dense_coef: np.ndarray  # float64[13]
    dense_mean: np.ndarray = field(default_factory=lambda: np.zeros(NUM_DENSE))
    dense_std: np.ndarray = field(default_factory=lambda: np.ones(NUM_DENSE))
    bias: float = 0.0
    popularity: list[np.ndarray] | None = None  # per feature, int64[V_f]: Zipf rank -> id
    # index (None: the identity); the drifting days (training.data.drift) reorder it


@dataclass
class Block:
    """``N`` sampled rows: ranks ``int64[N, 26]`` (-1 missing), ints, masks, probabilities."""

    ranks: np.ndarray
    dense: np.ndarray  # int64[N, 13]
    dense_missing: np.ndarray  # bool[N, 13]
    prob: np.ndarray  # float64[N]
    labels: np.ndarray  # int8[N]


def build_model(spec: SyntheticSpec) -> PlantedModel:
    """Draw the planted model of ``spec`` and calibrate its bias to ``spec.target_ctr``."""
    rng = np.random.default_rng([spec.seed, 0])
    cdfs, tables = [], []
    for f, vocab in enumerate(spec.vocab_sizes):
        w = np.arange(1, vocab + 1, dtype=np.float64) ** -spec.zipf
        cdfs.append(np.cumsum(w) / w.sum())
        hexes = [f"{x:08x}" for x in raw_ids(f, np.arange(vocab)).tolist()]
        tables.append(np.array([*hexes, ""], dtype=object))
    informative = sorted(rng.choice(NUM_SPARSE, spec.informative_sparse, replace=False).tolist())
    effects = {}
    for f in informative:
        e = rng.normal(0.0, spec.sparse_scale, spec.vocab_sizes[f] + 1)
        e[-1] = 0.0
        effects[f] = e
    a, b = spec.interaction_features
    rank = spec.interaction_rank
    scale = (spec.interaction_scale**2 / rank) ** 0.25
    u = rng.normal(0.0, scale, (spec.vocab_sizes[a] + 1, rank))
    v = rng.normal(0.0, scale, (spec.vocab_sizes[b] + 1, rank))
    u[-1] = v[-1] = 0.0
    dense_params = np.stack(
        [
            rng.uniform(0.1, 0.4, NUM_DENSE),
            rng.uniform(0.0, 3.0, NUM_DENSE),
            rng.uniform(0.5, 1.5, NUM_DENSE),
        ],
        axis=1,
    )
    model = PlantedModel(
        cdfs,
        tables,
        informative,
        effects,
        u,
        v,
        dense_params,
        rng.normal(0.0, spec.dense_scale, NUM_DENSE),
    )
    sample = sample_block(model, spec, np.random.default_rng([spec.seed, 1]), CALIBRATION_ROWS)
    z = model_input(sample.dense)
    model.dense_mean, model.dense_std = z.mean(axis=0), z.std(axis=0) + 1e-6
    logits = row_logits(model, spec, sample.ranks, sample.dense)
    model.bias = calibrate_bias(logits, spec.target_ctr)
    return model


def model_input(dense: np.ndarray) -> np.ndarray:
    """Raw ints ``[N, D]`` -> what the model sees (``features.dense_transform``), ``float64``."""
    return dense_transform(torch.from_numpy(np.asarray(dense, dtype=np.float64))).numpy()


def calibrate_bias(logits: np.ndarray, target: float) -> float:
    """Bias ``b`` with ``mean(sigmoid(logits + b)) == target`` (bisection; monotone in ``b``)."""
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.mean(1.0 / (1.0 + np.exp(-(logits + mid)))) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def row_logits(
    model: PlantedModel, spec: SyntheticSpec, ranks: np.ndarray, dense: np.ndarray
) -> np.ndarray:
    """Logits without the bias, ``float64[N]``; rank -1 (missing) picks the zero last entry."""
    out = np.zeros(len(ranks))
    for f in model.informative:
        out += model.effects[f][ranks[:, f]]
    a, b = spec.interaction_features
    out += np.einsum("nr,nr->n", model.u[ranks[:, a]], model.v[ranks[:, b]])
    z = (model_input(dense) - model.dense_mean) / model.dense_std
    return out + z @ model.dense_coef


def sample_block(
    model: PlantedModel, spec: SyntheticSpec, rng: np.random.Generator, n: int
) -> Block:
    """Draw ``n`` rows: Zipf ranks, heavy-tailed ints, missing masks, probabilities, labels."""
    ranks = np.empty((n, NUM_SPARSE), np.int64)
    for f, cdf in enumerate(model.cdfs):
        ranks[:, f] = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), len(cdf) - 1)
        if model.popularity is not None:
            ranks[:, f] = model.popularity[f][ranks[:, f]]
    ranks[rng.random((n, NUM_SPARSE)) < spec.sparse_missing] = -1
    zero_rate, mu, sigma = model.dense_params.T
    dense = np.floor(np.exp(rng.normal(mu, sigma, (n, NUM_DENSE)))).astype(np.int64)
    dense[rng.random((n, NUM_DENSE)) < zero_rate] = 0
    negative = rng.random(n) < 0.08  # like I2 in the real logs: a few small negatives
    dense[negative, 1] = -rng.integers(1, 4, int(negative.sum()))
    dense_missing = rng.random((n, NUM_DENSE)) < spec.dense_missing
    dense[dense_missing] = 0  # the reader turns an empty int into 0, so the model sees 0
    prob = 1.0 / (1.0 + np.exp(-(row_logits(model, spec, ranks, dense) + model.bias)))
    labels = (rng.random(n) < prob).astype(np.int8)
    return Block(ranks, dense, dense_missing, prob, labels)
