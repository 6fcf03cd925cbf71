"""Data for a training run: synthetic or Criteo TSV -> cached binary shards -> three splits.

The rows, in file order, are cut into **train**, **validation** and **test**: the last
``data.eval_fraction`` of them are held out (time-ordered, like Criteo's last day), the first
``data.valid_fraction`` of those are validation and the rest test. Every decision of a run
(periodic evaluations, ``checkpoints/best``, early stopping, a sweep's choice) is made on
validation; the final report, its baseline and ``make evaluate``'s default rows are the test
rows, which no decision saw, so their figures are not flattered by the choices made on them.

Rank 0 generates and preprocesses while the others wait; its outcome (or its error) is
broadcast, so a bad file fails every rank at once with the same one-line message instead of
leaving the others blocked at a barrier. Across processes that are not one group (each node's
``--prepare-only`` before its torchrun), a lock file beside the synthetic TSV and one beside the
cache make the first one prepare while the others wait, then reuse what it wrote.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from training.config import DataConfig
from training.data.loader import Arrays
from training.errors import DataError, RecsysError
from training.features import NUM_SPARSE

logger = logging.getLogger(__name__)


def input_paths(cfg: DataConfig, progress: bool) -> list[Path]:
    """The TSV files of ``cfg``: ``data.path``'s, or the synthetic file (generated once, under
    its lock, when missing)."""
    from training.data.build import locked
    from training.data.criteo import resolve_data_paths
    from training.data.first_run import synthetic_file
    from training.data.synthetic import SyntheticSpec, generate, prob_sidecar

    if cfg.path:
        paths = resolve_data_paths(Path(cfg.path))
    else:
        tsv = synthetic_file(cfg)
        # Locked like the cache: two nodes' `--prepare-only` on one shared folder generate it
        # once (a second copy renamed over the first would change its mtime, hence the cache
        # key, and the cache would be built twice).
        with locked(tsv):
            if not (tsv.is_file() and prob_sidecar(tsv).is_file()):
                logger.info("generating %d synthetic rows into %s", cfg.synthetic_rows, tsv)
                spec = SyntheticSpec(
                    rows=cfg.synthetic_rows,
                    seed=cfg.synthetic_seed,
                    vocab_sizes=[cfg.synthetic_vocab] * NUM_SPARSE,
                )
                generate(spec, tsv, progress=progress)
        paths = [tsv]
    return paths


def _prepare_on_rank0(cfg: DataConfig, progress: bool, rows_per_table: list[int] | None) -> str:
    from training.data.binary import ensure_binary

    out_dir, _meta = ensure_binary(
        input_paths(cfg, progress),
        Path(cfg.cache_dir),
        on_bad=cfg.on_bad_row,
        max_bad_rows=cfg.max_bad_rows,
        progress=progress,
        rows_per_table=rows_per_table,
        processes=cfg.preprocess_processes,
    )
    return str(out_dir)


@dataclass
class Splits:
    """A run's rows: ``train``, ``valid`` (decisions) and ``test`` (the final report), in
    file order and disjoint; ``info``: the data description for the checkpoint (row counts,
    ``splits``: each split's 0-based ``[first, first + rows)`` among the rows)."""

    train: Arrays
    valid: Arrays
    test: Arrays
    info: dict[str, Any]


def split_rows(n: int, eval_fraction: float, valid_fraction: float) -> tuple[int, int, int]:
    """``(train, valid, test)`` row counts of ``n`` rows (train first, test last); DataError,
    in one line with the settings to change, when a split would be empty."""
    held = round(n * eval_fraction)
    valid = round(held * valid_fraction)
    counts = (n - held, valid, held - valid)
    if min(counts) < 1:
        raise DataError(
            f"{n} usable rows cannot be split into train, validation and test with "
            f"data.eval_fraction={eval_fraction} and data.valid_fraction={valid_fraction} "
            f"({counts[0]}, {counts[1]} and {counts[2]} rows; each split needs at least one): "
            "use more rows or other fractions"
        )
    return counts


def prepare_data(
    cfg: DataConfig, rank: int, progress: bool, rows_per_table: list[int] | None = None
) -> Splits:
    """Collective. The train, validation and test splits (module doc) and their description.

    ``rows_per_table`` (the model's ``model.rows()``): ids are hashed into these tables once, at
    preprocessing, and the cache is keyed by them; None keeps raw ids (a cache of its own).
    """
    from training.data.binary import load_binary

    outcome: list[Any] = [None]
    if rank == 0:
        try:
            outcome[0] = ("ok", _prepare_on_rank0(cfg, progress, rows_per_table))
        except RecsysError as e:
            outcome[0] = ("error", type(e).__name__, str(e))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0][0] == "error":
        raise DataError(outcome[0][2])
    data = load_binary(Path(outcome[0][1]))
    tables = data.meta.rows_per_table
    arrays = Arrays(
        labels=data.labels,
        dense=data.dense,
        sparse=data.sparse,
        prob=data.prob,
        hashed_for=None if tables is None else tuple(tables),
    )
    n = len(arrays)
    n_train, n_valid, n_test = split_rows(n, cfg.eval_fraction, cfg.valid_fraction)
    bounds = {"train": (0, n_train), "valid": (n_train, n_train + n_valid),
              "test": (n_train + n_valid, n)}  # fmt: skip
    info = {
        "source": cfg.path or "synthetic",
        "binary": outcome[0][1],
        "rows": n,
        "train_rows": n_train,
        "eval_rows": n_valid + n_test,  # the held-out rows, both splits
        "valid_rows": n_valid,
        "test_rows": n_test,
        "valid_fraction": cfg.valid_fraction,
        "splits": {k: {"first_row": lo, "rows": hi - lo} for k, (lo, hi) in bounds.items()},
        "parse_report": data.meta.parse_report,
    }
    if rank == 0:
        logger.info("data: %d train, %d validation, %d test rows from %s", n_train, n_valid,
                    n_test, info["source"])  # fmt: skip
    train, valid, test = (arrays.rows(*bounds[k]) for k in ("train", "valid", "test"))
    for name, split in (("validation", valid), ("test", test)):  # an AUC needs both labels
        labels = np.asarray(split.labels)
        if labels.min() == labels.max():
            lo, hi = bounds["valid" if name == "validation" else "test"]
            raise DataError(
                f"the {name} split (rows {lo + 1}..{hi} of {n}) holds only label "
                f"{int(labels[0])}: its AUC is undefined; use more rows or other "
                f"data.eval_fraction ({cfg.eval_fraction}) / data.valid_fraction "
                f"({cfg.valid_fraction})"
            )
    return Splits(train, valid, test, info)
