"""What the training tests share: the tiny preset's arguments, the two sharding plans that the
resume tests move between, and the guarantee a resume onto another plan keeps."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from training.checkpoint.store import read_tensors
from training.metrics.log import read_metrics

TINY = ["--config", "training/configs/tiny.toml", "--no-progress"]
# Plan A (2 ranks): C1 and C2 split by columns over both ranks, every other table whole on one.
PLAN_A = [
    'sharding.sharding_types=["table_wise"]',
    'sharding.tables.t_C1.sharding_types=["column_wise"]',
    "sharding.tables.t_C1.min_partition=4",
    'sharding.tables.t_C2.sharding_types=["column_wise"]',
    "sharding.tables.t_C2.min_partition=4",
    "train.log_every=10",
]
# Plan B (the resumed runs' plan): one process, every table whole ("table_wise").
PLAN_B = ['sharding.sharding_types=["table_wise"]', "train.log_every=10"]
MOM = "optim.state.model.sparse_arch.embedding_bag_collection.embedding_bags."
TINY_ROWS = 128  # rows of each tiny table


def losses(run: Path) -> dict[int, float]:
    """``train_loss.jsonl`` of a run: step -> mean loss over the ranks."""
    return {r["step"]: r["loss"] for r in read_metrics(run / "train_loss.jsonl")}


def plan(ckpt: Path) -> dict[str, dict]:
    """A checkpoint's ``plan.json`` by table."""
    return {r["table"]: r for r in json.loads((ckpt / "plan.json").read_text())}


def assert_plan_a_resumed_as_plan_b(src: Path, dst: Path) -> None:
    """``dst`` is ``src`` (plan A, C1/C2 in 2 column shards) resumed under plan B with no
    further step: weights and dense optimizer state bit-exact through the resharding, table-wise
    accumulators exact, the column-sharded row-wise accumulators their per-row mean."""
    assert plan(dst)["t_C1"]["sharding_type"] == "table_wise"
    saved, loaded = read_tensors(src), read_tensors(dst)
    for key, value in saved.items():
        if key.startswith("model."):
            assert torch.equal(loaded[key], value), key  # weights bit-exact through resharding
    for table in ("t_C3", "t_C10"):  # table-wise -> table-wise: accumulators exact
        key = f"{MOM}{table}.weight.{table}.momentum1"
        assert torch.equal(loaded[key], saved[key]), key
    for table in ("t_C1", "t_C2"):  # 2 column shards -> 1 whole table: the per-row mean
        key = f"{MOM}{table}.weight.{table}.momentum1"
        assert saved[key].numel() == 2 * TINY_ROWS and loaded[key].numel() == TINY_ROWS
        assert torch.allclose(loaded[key], saved[key].view(2, TINY_ROWS).mean(0))
        assert loaded[key].abs().sum() > 0
    # Dense optimizer state (Adagrad sums of the MLPs) comes back too.
    dense = [k for k in saved if k.startswith("optim.state.model.over_arch")]
    assert dense and all(torch.equal(loaded[k], saved[k]) for k in dense)
