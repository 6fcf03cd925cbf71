"""Per-table precision by memory budget: the ``mixed`` mapped variant (``export.memory_budget``).

Each table's loss in each of :data:`recsys_model.mapped.MIX_FORMATS` is measured on the parity
rows (held out): the squared error of its rows as that format scores them, summed over the rows'
lookups of that table (with one id a feature, exactly the squared error the table adds to the
pooled embedding). Starting from every table in fp16, the step with the least added loss per
byte saved (one table to a lower format: fp16 -> int8 -> int4, or straight to int4 where int8
saves nothing) is taken until the file fits the budget; then tables are raised back while it
still fits (the last step may free far more than was missing): greedy, close to optimal when
each table's loss is convex in bytes (int4's error is ~100x int8's here). The written file is
rebuilt from the streamed fp32 tables (the trained weights), one table at a time; its parity
(|ΔAUC| vs the reference) is judged like the other reduced formats.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recsys_model.features import hash_values
from recsys_model.mapped import MIX_FORMATS, MIXED, layout, pack, save_dense, unpack
from recsys_model.table_writer import write_tables
from training.data.loader import Arrays
from training.errors import ConfigError
from training.export.scorer import raw_inputs
from training.features import SPARSE_NAMES

logger = logging.getLogger("training.export")


def table_losses(fp32: Any, arrays: Arrays) -> list[dict[str, float]]:
    """Per table, ``{format: mean squared error its looked-up rows add, per parity row}``, from
    the fp32 mapped scorer ``fp32`` (its ``weight``: the tables as trained, ``[R, E]``)."""
    _, values, lengths = raw_inputs(arrays.dense, arrays.sparse)
    ids = hash_values(values, lengths, fp32.rows)
    per_feature = lengths.to(torch.int64).sum(dim=1).tolist()
    out = []
    for t, table_ids in enumerate(ids.split(per_feature)):
        uniq, counts = torch.unique(table_ids, return_counts=True)
        start = int(fp32.row_offsets[t])
        rows = fp32.weight[start + uniq].float()
        out.append({
            fmt: float((counts * (unpack(pack(rows, fmt), fmt) - rows).pow(2).sum(1)).sum())
            / len(arrays)
            for fmt in MIX_FORMATS
        })  # fmt: skip
    return out


def choose(rows: list[int], dim: int, losses: list[dict[str, float]], budget: int) -> list[str]:
    """Each table's format so that the mixed file is at most ``budget`` bytes, lowering the
    table with the least loss per byte saved first. Raises ConfigError below all-int4."""
    formats = [MIX_FORMATS[0]] * len(rows)
    floor = layout(rows, dim, [MIX_FORMATS[-1]] * len(rows))[2]
    if budget < floor:
        raise ConfigError(
            f"memory_budget = {budget} bytes is below the all-int4 tables' {floor} bytes: "
            f"give at least {floor} (or export int4 / int8 without a budget)"
        )
    size = layout(rows, dim, formats)[2]
    while size > budget:
        steps = []
        for t, fmt in enumerate(formats):
            for low in MIX_FORMATS[MIX_FORMATS.index(fmt) + 1 :]:
                lower = [*formats[:t], low, *formats[t + 1 :]]
                saved = size - layout(rows, dim, lower)[2]
                added = losses[t][low] - losses[t][fmt]
                # a step that saves nothing (at E = 8 an int8 row is an fp16 row's size; a new
                # section's alignment) is taken last: every step lowers, so this ends at int4
                steps.append((added / saved if saved > 0 else float("inf"), added, t, lower))
        formats = min(steps, key=lambda s: s[:3])[3]
        size = layout(rows, dim, formats)[2]
    return refill(rows, dim, losses, budget, formats)


def refill(rows: list[int], dim: int, losses: list[dict[str, float]], budget: int,
           formats: list[str]) -> list[str]:  # fmt: skip
    """Raise tables back while the file still fits: the descent's last step may free far more
    than was missing (a large table lowered by a format), leaving budget unused (16% of 600 MB
    at the Kaggle shape). The step removing the most loss per byte added goes first."""
    while True:
        size = layout(rows, dim, formats)[2]
        ups = []
        for t, fmt in enumerate(formats):
            for high in MIX_FORMATS[: MIX_FORMATS.index(fmt)]:
                higher = [*formats[:t], high, *formats[t + 1 :]]
                grown = layout(rows, dim, higher)[2]
                removed = losses[t][fmt] - losses[t][high]
                if grown <= budget and removed > 0:
                    ups.append((removed / max(grown - size, 1), -t, higher))
        if not ups:
            return formats
        formats = max(ups, key=lambda u: u[:2])[2]


def write_mixed(fp32: Any, arrays: Arrays, out: Path, budget: int) -> tuple[Path, dict[str, Any]]:
    """``mapped_mixed.pt`` + ``tables_mixed.bin`` in ``out`` within ``budget`` bytes, from the
    fp32 mapped scorer; returns its path and schema.json's ``memory_budget`` record."""
    rows, dim = [int(r) for r in fp32.spec["rows"]], int(fp32.spec["dim"])
    losses = table_losses(fp32, arrays)
    formats = choose(rows, dim, losses, budget)
    starts = np.cumsum([0, *rows]).tolist()
    chunks = ((starts[t], fp32.weight[starts[t] : starts[t + 1]]) for t in range(len(rows)))
    record = write_tables(
        out / f"tables_{MIXED}.bin", sum(rows), dim, MIXED, chunks,
        list(zip(rows, formats, strict=True)),
    )  # fmt: skip
    save_dense(out / f"mapped_{MIXED}.pt", fp32, record)
    counts = {f: formats.count(f) for f in MIX_FORMATS}
    logger.info("memory budget %d B: %d B of tables, %s", budget, record["bytes"], counts)
    return out / f"mapped_{MIXED}.pt", {
        "budget": budget,
        "bytes": record["bytes"],
        "sizes": {f: layout(rows, dim, [f] * len(rows))[2] for f in MIX_FORMATS},
        "loss": "squared error of the table's looked-up rows per parity row",
        "tables": [
            {"feature": name, "format": f, "loss": {k: round(v, 9) for k, v in loss.items()}}
            for name, f, loss in zip(SPARSE_NAMES, formats, losses, strict=True)
        ],
    }
