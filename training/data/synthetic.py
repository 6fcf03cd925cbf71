"""Synthetic Criteo-format data with a planted, learnable click model and its true probabilities.

Each row's click logit is ``bias + sum_f e_f[id_f] + sum_j b_j * z_j + <u[id_C1], v[id_C2]>``:
per-id effects on ``informative_sparse`` categorical features (chosen by the seed), linear
effects of the standardized ``log1p(max(I_j, 0))`` (what ``features.dense_transform`` feeds the
model; a missing int counts as 0, like the reader), and a low-rank interaction between two
categorical features. The bias is calibrated on a sample so the mean probability is near
``target_ctr``. Ids follow a Zipf law over ``vocab_sizes[f]`` values; the ``k``-th most frequent
id of feature ``f`` is a fixed pseudo-random 32-bit value written as 8 hex digits.

Output: the TSV and ``<name>.prob.npy`` (``float32[rows]``, the true click probability of row
``i`` = line ``i + 1``). Bytes depend only on ``(spec, chunk_rows)``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from recsys_stack.metrics import roc_auc
from recsys_stack.progress import progress as progress_bar
from training.features import NUM_DENSE, NUM_SPARSE, dense_transform

log = logging.getLogger(__name__)

# Mixed cardinalities like Criteo's (a few tiny, most 10^2..10^4), small enough for CPU tests.
DEFAULT_VOCAB: list[int] = [
    1000, 500, 2000, 200, 100, 20, 5000, 300, 10, 3000, 1500, 800, 4000,
    50, 2500, 10000, 600, 30, 7000, 5, 6000, 40, 1200, 8000, 400, 3500,
]  # fmt: skip
_CALIBRATION_ROWS = 50_000
_INT_STR_MIN = -3
_INT_STR = np.array([str(i) for i in range(_INT_STR_MIN, 1 << 16)], dtype=object)


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


def prob_sidecar(tsv: Path) -> Path:
    """``x.tsv`` -> ``x.prob.npy``: where a synthetic file keeps its true probabilities."""
    return tsv.with_suffix(".prob.npy")


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
    sample = sample_block(model, spec, np.random.default_rng([spec.seed, 1]), _CALIBRATION_ROWS)
    z = _model_input(sample.dense)
    model.dense_mean, model.dense_std = z.mean(axis=0), z.std(axis=0) + 1e-6
    logits = _logits(model, spec, sample.ranks, sample.dense)
    model.bias = _calibrate_bias(logits, spec.target_ctr)
    return model


def _model_input(dense: np.ndarray) -> np.ndarray:
    """Raw ints ``[N, D]`` -> what the model sees (``features.dense_transform``), ``float64``."""
    return dense_transform(torch.from_numpy(np.asarray(dense, dtype=np.float64))).numpy()


def _calibrate_bias(logits: np.ndarray, target: float) -> float:
    """Bias ``b`` with ``mean(sigmoid(logits + b)) == target`` (bisection; monotone in ``b``)."""
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.mean(1.0 / (1.0 + np.exp(-(logits + mid)))) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _logits(
    model: PlantedModel, spec: SyntheticSpec, ranks: np.ndarray, dense: np.ndarray
) -> np.ndarray:
    """Logits without the bias, ``float64[N]``; rank -1 (missing) picks the zero last entry."""
    out = np.zeros(len(ranks))
    for f in model.informative:
        out += model.effects[f][ranks[:, f]]
    a, b = spec.interaction_features
    out += np.einsum("nr,nr->n", model.u[ranks[:, a]], model.v[ranks[:, b]])
    z = (_model_input(dense) - model.dense_mean) / model.dense_std
    return out + z @ model.dense_coef


def sample_block(
    model: PlantedModel, spec: SyntheticSpec, rng: np.random.Generator, n: int
) -> Block:
    """Draw ``n`` rows: Zipf ranks, heavy-tailed ints, missing masks, probabilities, labels."""
    ranks = np.empty((n, NUM_SPARSE), np.int64)
    for f, cdf in enumerate(model.cdfs):
        ranks[:, f] = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), len(cdf) - 1)
    ranks[rng.random((n, NUM_SPARSE)) < spec.sparse_missing] = -1
    zero_rate, mu, sigma = model.dense_params.T
    dense = np.floor(np.exp(rng.normal(mu, sigma, (n, NUM_DENSE)))).astype(np.int64)
    dense[rng.random((n, NUM_DENSE)) < zero_rate] = 0
    negative = rng.random(n) < 0.08  # like I2 in the real logs: a few small negatives
    dense[negative, 1] = -rng.integers(1, 4, int(negative.sum()))
    dense_missing = rng.random((n, NUM_DENSE)) < spec.dense_missing
    dense[dense_missing] = 0  # the reader turns an empty int into 0, so the model sees 0
    prob = 1.0 / (1.0 + np.exp(-(_logits(model, spec, ranks, dense) + model.bias)))
    labels = (rng.random(n) < prob).astype(np.int8)
    return Block(ranks, dense, dense_missing, prob, labels)


def format_block(model: PlantedModel, block: Block) -> str:
    """TSV text of a block, one ``'\\n'``-terminated line per row, missing fields empty."""
    cols: list[list[str]] = [np.array(["0", "1"])[block.labels].tolist()]
    # Looking small ints up in a table of strings is ~20x faster than ``astype(str)``.
    small = (block.dense >= _INT_STR_MIN) & (block.dense < _INT_STR_MIN + len(_INT_STR))
    dense = _INT_STR[np.where(small, block.dense - _INT_STR_MIN, 0)]
    dense[~small] = [str(x) for x in block.dense[~small].tolist()]
    dense[block.dense_missing] = ""
    cols += [dense[:, j].tolist() for j in range(NUM_DENSE)]
    cols += [model.hex_tables[f][block.ranks[:, f]].tolist() for f in range(NUM_SPARSE)]
    return "\n".join(map("\t".join, zip(*cols, strict=True))) + "\n"


def generate(
    spec: SyntheticSpec, out_tsv: Path, chunk_rows: int = 100_000, progress: bool = True
) -> Path:
    """Write ``spec.rows`` rows to ``out_tsv`` and their true probabilities to its sidecar.

    Both files are written under temporary names and renamed into place at the end, so an
    interrupted run never leaves a partial file under the final name. Returns ``out_tsv``.
    """
    out_tsv = Path(out_tsv)
    out_tsv.parent.mkdir(parents=True, exist_ok=True)
    sidecar = prob_sidecar(out_tsv)
    tmp_tsv = out_tsv.with_name(f".{out_tsv.name}.tmp-{os.getpid()}")
    tmp_prob = sidecar.with_name(f".{sidecar.name}.tmp-{os.getpid()}")
    model = build_model(spec)
    probs = np.empty(spec.rows, np.float32)
    labels = np.empty(spec.rows, np.int8)
    try:
        with (
            tmp_tsv.open("w", encoding="ascii", newline="") as f,
            progress_bar(
                total=spec.rows,
                unit="row",
                unit_scale=True,
                desc="generate",
                disable=not progress,
            ) as bar,
        ):
            for i, start in enumerate(range(0, spec.rows, chunk_rows)):
                n = min(chunk_rows, spec.rows - start)
                block = sample_block(model, spec, np.random.default_rng([spec.seed, 2, i]), n)
                f.write(format_block(model, block))
                probs[start : start + n] = block.prob
                labels[start : start + n] = block.labels
                bar.update(n)
        with tmp_prob.open("wb") as fp:
            np.save(fp, probs)
        os.replace(tmp_prob, sidecar)
        os.replace(tmp_tsv, out_tsv)
    finally:
        tmp_tsv.unlink(missing_ok=True)
        tmp_prob.unlink(missing_ok=True)
    if 0 < labels.sum() < len(labels):
        log.info(
            "wrote %d rows to %s: ctr %.4f, mean prob %.4f, oracle auc %.4f",
            spec.rows,
            out_tsv,
            labels.mean(),
            probs.mean(),
            roc_auc(labels, probs),
        )
    return out_tsv


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options of ``python -m training.data.synthetic``."""
    d = SyntheticSpec()
    p = argparse.ArgumentParser(
        prog="python -m training.data.synthetic",
        description="Write synthetic Criteo-format TSV (label, I1..I13, C1..C26) with a planted "
        "click model, plus <out>.prob.npy holding each row's true click probability.",
    )
    p.add_argument("--rows", type=int, default=d.rows, help="rows to write (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed (default %(default)s)")
    p.add_argument("--out", type=Path, required=True, help="output TSV, e.g. data/synthetic/x.tsv")
    p.add_argument(
        "--vocab",
        type=int,
        nargs="+",
        metavar="N",
        help="distinct ids per categorical feature: one value for all 26, or 26 values "
        "(default: a Criteo-like mix from 5 to 10000)",
    )
    p.add_argument(
        "--zipf", type=float, default=d.zipf, help="id frequency exponent (default %(default)s)"
    )
    p.add_argument(
        "--informative",
        type=int,
        default=d.informative_sparse,
        help="categorical features with a planted effect (default %(default)s)",
    )
    p.add_argument(
        "--ctr", type=float, default=d.target_ctr, help="target mean CTR (default %(default)s)"
    )
    p.add_argument("--chunk-rows", type=int, default=100_000, help="rows per generated block")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse options, generate, print where the files went."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    vocab = list(DEFAULT_VOCAB) if args.vocab is None else args.vocab
    if len(vocab) == 1:
        vocab = vocab * NUM_SPARSE
    try:
        spec = SyntheticSpec(
            rows=args.rows,
            seed=args.seed,
            vocab_sizes=vocab,
            zipf=args.zipf,
            informative_sparse=args.informative,
            target_ctr=args.ctr,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    out = generate(spec, args.out, chunk_rows=args.chunk_rows, progress=not args.no_progress)
    seconds = time.perf_counter() - start
    print(
        f"{out} and {prob_sidecar(out)}: {spec.rows} rows in {seconds:.1f}s "
        f"({spec.rows / seconds:,.0f} rows/s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
