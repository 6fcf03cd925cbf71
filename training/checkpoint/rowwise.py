"""Row-wise optimizer state across shardings: the one state DCP does not reshard by itself.

TorchRec's row-wise Adagrad keeps one accumulator per table row. A column-sharded table keeps
one per row *and column shard*: ``rows * shards`` values, each block ``i * rows`` the running
sum of ``mean(g^2)`` over that shard's columns. A resume with another plan converts the saved
state through its canonical per-row form (the width-weighted mean over column shards, exactly
the accumulator a full-row table would have) into whatever layout the new plan has: column
blocks again, or row ranges (table-, row- and table-row-wise shards) on the ranks that hold them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from training.errors import CheckpointError


def rowwise_table(key: str, table_rows: dict[str, int]) -> str:
    """Table name if ``key`` is a row-wise optimizer state (``...<table>.momentum1``)."""
    if not key.startswith("optim.") or not key.endswith(".momentum1"):
        return ""
    table = key.rsplit(".", 2)[-2]
    return table if table in table_rows else ""


def column_widths(plan_file: Path, table: str) -> list[int]:
    """Column-shard widths of ``table`` in a checkpoint's saved plan (``plan.json``), by column
    offset ([] if unknown)."""
    try:
        plan = json.loads(plan_file.read_text())
    except (OSError, json.JSONDecodeError):
        return []
    for row in plan:
        if row.get("table") == table:
            shards = sorted(row.get("shards", []), key=lambda s: s["offsets"][1])
            return [int(s["sizes"][1]) for s in shards]
    return []


def load_rowwise(
    path: Path, key: str, md: TensorStorageMetadata, target: Any, rows: int, widths: list[int]
) -> None:
    """Saved ``[rows * k]`` accumulator -> canonical ``[rows]`` -> target ``[rows * k']`` (a
    tensor or a ShardedTensor, in any layout :func:`fill_rowwise` takes).

    Each column shard's accumulator is the running sum of ``mean(g^2)`` over its own columns,
    so the full-row value is the mean over shards weighted by shard width.
    """
    if md.size[0] % rows or target.size()[0] % rows:
        raise CheckpointError(f"checkpoint {path}: '{key}' has {md.size[0]} values for {rows} rows")
    full = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load({key: full}, checkpoint_id=str(path))
    per_shard = full.view(-1, rows)
    k = per_shard.shape[0]
    w = torch.tensor(widths if len(widths) == k else [1] * k, dtype=per_shard.dtype)
    canonical = (per_shard * (w / w.sum())[:, None]).sum(dim=0)
    fill_rowwise(canonical, local_parts(target))


def local_parts(target: Any) -> list[tuple[int, torch.Tensor]]:
    """``(global offset, local tensor)`` of each shard of a 1-D state this rank holds: a
    ShardedTensor's local shards (anything with ``local_shards()``), else the whole tensor."""
    if hasattr(target, "local_shards"):
        return [(int(s.metadata.shard_offsets[0]), s.tensor) for s in target.local_shards()]
    return [(0, target)]


def fill_rowwise(canonical: torch.Tensor, parts: list[tuple[int, torch.Tensor]]) -> None:
    """Write the per-row accumulator ``canonical [rows]`` into the local shards of a row-wise
    optimizer state whose global layout is ``k'`` copies of it, ``[rows * k']``.

    TorchRec lays that state out per table sharding: ``[rows]`` split by row range for
    table-, row- and table-row-wise tables (a shard of ``n`` rows at row offset ``o``), and one
    whole ``[rows]`` block per column shard, at offset ``i * rows``, for column-wise ones. So
    global position ``g`` holds row ``g mod rows``, wherever the shard starts and however long
    it is.
    """
    rows = canonical.numel()
    for offset, t in parts:
        index = torch.arange(offset, offset + t.numel()) % rows
        t.copy_(canonical[index].view(t.shape))
