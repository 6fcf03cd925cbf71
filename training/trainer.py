"""The sharded model and its optimizers: DLRMTrain -> planner -> DMP -> combined optimizer.

Shared by ``train()`` and the benchmark, so the benchmark times exactly the trainer's model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from training.config import Config
from training.features import SPARSE_NAMES, table_name
from training.model import build_train_model
from training.sharding import make_plan, plan_summary, sharders


def _embedding_optimizer(name: str) -> type[torch.optim.Optimizer]:
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    return {
        "rowwise_adagrad": RowWiseAdagrad,
        "adagrad": torch.optim.Adagrad,
        "sgd": torch.optim.SGD,
        "adam": torch.optim.Adam,
    }[name]


def _dense_optimizer(name: str) -> Callable[..., torch.optim.Optimizer]:
    return {"adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[name]


@dataclass
class Trainer:
    """The sharded model, its combined optimizer and the plan it was built with."""

    model: nn.Module  # DistributedModelParallel(DLRMTrain)
    optimizer: Any  # CombinedOptimizer(fused embedding optimizer, dense optimizer)
    plan: list[dict[str, Any]]

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds: the model's and the optimizers' (sharded) state."""
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (as loaded from a checkpoint)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])


def build_trainer(cfg: Config, device: torch.device) -> Trainer:
    """DLRMTrain on meta -> fused optimizer in backward -> planner -> DMP -> combined optimizer."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(cfg.train.seed)
    model = build_train_model(cfg.model, device="meta")
    if cfg.train.compile_dense:
        dlrm = model.model
        dlrm.dense_arch = torch.compile(dlrm.dense_arch)  # type: ignore[assignment]
        dlrm.over_arch = torch.compile(dlrm.over_arch)  # type: ignore[assignment]
    apply_optimizer_in_backward(
        _embedding_optimizer(cfg.optim.embedding),
        model.model.sparse_arch.parameters(),
        {"lr": cfg.optim.embedding_lr},
    )
    module_sharders = sharders()
    tables = [table_name(f) for f in SPARSE_NAMES]
    plan = make_plan(model, cfg.sharding, tables, device, module_sharders)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=module_sharders)
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense_cls = _dense_optimizer(cfg.optim.dense)
    lr, decay = cfg.optim.dense_lr, cfg.optim.dense_weight_decay
    dense_opt = KeyedOptimizerWrapper(
        dense_params, lambda ps: dense_cls(ps, lr=lr, weight_decay=decay)
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense_opt])
    return Trainer(model=dmp, optimizer=optimizer, plan=plan_summary(plan))


def make_pipeline(kind: str, trainer: Trainer, device: torch.device) -> Any:
    """``sparse_dist`` overlaps batch i+1's input all-to-all with batch i's compute."""
    from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

    cls = TrainPipelineSparseDist if kind == "sparse_dist" else TrainPipelineBase
    return cls(trainer.model, trainer.optimizer, device)


def unwrapped_model(pipeline: Any, trainer: Trainer) -> nn.Module:
    """The model to evaluate: the pipeline hands it back (detached from its hooks) if it can."""
    return pipeline.detach() if hasattr(pipeline, "detach") else trainer.model
