"""Where each embedding table lives: TorchRec's planner, fed by the config's constraints.

The plan is computed collectively (rank 0 plans, every rank receives the same plan), logged as
a table, and saved with each checkpoint as ``plan.json``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import (
    KernelConfig,
    PlannerError,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from training.config import ShardingConfig
from training.errors import ConfigError

logger = logging.getLogger(__name__)

CPU_SHARDING_TYPES = ["data_parallel", "table_wise", "column_wise", "table_column_wise"]
CUDA_SHARDING_TYPES = [*CPU_SHARDING_TYPES, "row_wise", "table_row_wise"]


def supported_sharding_types(device: torch.device) -> list[str]:
    """Sharding types TorchRec's training sharders offer on ``device`` (row-wise is CUDA-only)."""
    return CUDA_SHARDING_TYPES if device.type == "cuda" else CPU_SHARDING_TYPES


def build_constraints(
    cfg: ShardingConfig, table_names: list[str], device: torch.device
) -> dict[str, ParameterConstraints]:
    """Per-table ParameterConstraints: table entries replace the global lists for that table."""
    supported = supported_sharding_types(device)
    out: dict[str, ParameterConstraints] = {}
    for name in table_names:
        table = cfg.tables.get(name)
        types = (table.sharding_types if table and table.sharding_types else None) or (
            cfg.sharding_types or supported
        )
        where = f"sharding.tables.{name}" if table and table.sharding_types else "sharding"
        for t in types:
            if t not in supported:
                raise ConfigError(
                    f"{where}.sharding_types: '{t}' is not available on {device.type} "
                    f"(choose from {', '.join(supported)})"
                )
        kernels = (table.compute_kernels if table and table.compute_kernels else None) or (
            cfg.compute_kernels or None
        )
        kwargs: dict[str, Any] = {"sharding_types": list(types)}
        if kernels:
            kwargs["compute_kernels"] = list(kernels)
        if table and table.min_partition:
            kwargs["min_partition"] = table.min_partition
        out[name] = ParameterConstraints(**kwargs)
    return out


def memory_cap_bytes(cfg: ShardingConfig, device: torch.device, local_world_size: int) -> int:
    """Per-rank memory the planner may fill: the configured cap, else this machine's share."""
    if cfg.memory_cap_gb > 0:
        return int(cfg.memory_cap_gb * 1024**3)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total // max(local_world_size, 1))


def sharders() -> list[ModuleSharder[nn.Module]]:
    """EBC sharder; fused params come from the optimizer applied in backward."""
    return [EmbeddingBagCollectionSharder()]


def make_plan(
    model: nn.Module,
    cfg: ShardingConfig,
    table_names: list[str],
    device: torch.device,
    module_sharders: list[ModuleSharder[nn.Module]],
) -> ShardingPlan:
    """Plan collectively over the default process group; every rank gets rank 0's plan."""
    world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cap = memory_cap_bytes(cfg, device, local_world)
    trainer = TrainerConfig(
        world_size=world,
        local_world_size=local_world,
        **({"hbm_cap_bytes": cap} if device.type == "cuda" else {"ddr_cap_bytes": cap}),
    )
    topology = TopologyFactory.create_topology(
        trainer_config=trainer, kernel_config=KernelConfig(compute_device=device.type)
    )
    planner = EmbeddingShardingPlanner(
        topology=topology,
        constraints=build_constraints(cfg, table_names, device),
        storage_reservation=FixedPercentageStorageReservation(percentage=cfg.storage_reservation),
    )
    try:
        return planner.collective_plan(model, module_sharders, dist.GroupMember.WORLD)
    except PlannerError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"sharding: the planner found no plan: {first}") from None


def plan_summary(plan: ShardingPlan) -> list[dict[str, Any]]:
    """One row per table: sharding type, kernel, ranks, shard shapes and bytes (fp32)."""
    rows = []
    for module_path, module_plan in plan.plan.items():
        for table, ps in module_plan.items():  # type: ignore[attr-defined]
            shards = []
            if ps.sharding_spec is not None:
                for s in ps.sharding_spec.shards:
                    shards.append(
                        {
                            "offsets": list(s.shard_offsets),
                            "sizes": list(s.shard_sizes),
                            "placement": str(s.placement),
                        }
                    )
            nbytes = sum(4 * s["sizes"][0] * s["sizes"][1] for s in shards)
            rows.append(
                {
                    "module": module_path,
                    "table": table,
                    "sharding_type": ps.sharding_type,
                    "compute_kernel": ps.compute_kernel,
                    "ranks": list(ps.ranks) if ps.ranks is not None else [],
                    "shards": shards,
                    "bytes": nbytes,
                }
            )
    return rows


def format_plan(rows: list[dict[str, Any]]) -> str:
    """The plan as a text table (table, sharding type, kernel, ranks, size)."""
    head = (
        f"{'table':<8} {'sharding type':<18} {'kernel':<7} {'ranks':<10} {'shards':>6} {'size':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        size = f"{r['bytes'] / 2**20:.2f} MiB" if r["bytes"] else "replicated"
        ranks = ",".join(str(x) for x in r["ranks"])
        lines.append(
            f"{r['table']:<8} {r['sharding_type']:<18} {r['compute_kernel']:<7} {ranks:<10} "
            f"{len(r['shards']):>6} {size:>10}"
        )
    return "\n".join(lines)
