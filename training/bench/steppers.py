"""The three steppers that ``python -m training.bench`` times side by side (see its docstring).

Each has ``step()``: one optimizer step of its method.

* :class:`TrainerStepper`: the real training loop's ``TrainLoop.step`` (pipeline + bookkeeping).
* :class:`CeilingStepper`: the raw DMP step on batches prebuilt in memory.
* :class:`PlainStepper`: a plain PyTorch DLRM (:class:`PlainDLRM`) on the same batches.

Shapes: ``B`` per-process batch, ``F`` = 26 sparse features, ``E`` embedding dim.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torchrec.datasets.utils import Batch

from training.checkpoint.store import Progress
from training.config import Config
from training.data.loader import Arrays, TrainStream
from training.features import NUM_DENSE
from training.metrics.log import MetricsLog
from training.step_loop import TrainLoop
from training.trainer import build_trainer, make_pipeline


class TrainerStepper:
    """One step of the real training loop: ``TrainLoop.step`` (pipeline + bookkeeping)."""

    def __init__(self, cfg: Config, train_arrays: Arrays, device: torch.device, total: int):
        self.trainer = build_trainer(cfg, device)
        self.pipeline = make_pipeline(cfg.train.pipeline, self.trainer, device)
        stream = TrainStream(
            train_arrays,
            global_batch=cfg.train.batch_size,
            rank=0,
            world_size=1,
            rows_per_table=cfg.model.rows(),
            seed=cfg.train.seed,
            epochs=1,
        )
        # Enough epochs that the stream never ends inside the benchmark (the pipeline reads ahead).
        stream.epochs = total // max(stream.steps_per_epoch, 1) + 2
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-")
        self.loop = TrainLoop(
            self.pipeline,
            iter(stream),
            Progress(),
            batch_size=cfg.train.batch_size,
            train_rows=len(train_arrays),
            total=total,
            log_every=cfg.train.log_every,
            loss_log=MetricsLog(Path(self.tmp.name) / "train_loss.jsonl", enabled=True),
            pad_last=stream.pad_last,
        )

    def step(self) -> None:
        if not self.loop.step():
            raise RuntimeError("the benchmark's training stream ran out")


class CeilingStepper:
    """The raw DMP step on prebuilt in-memory batches (no loader, no pipeline, no bookkeeping)."""

    def __init__(self, cfg: Config, batches: list[Batch], device: torch.device):
        self.trainer = build_trainer(cfg, device)
        self.batches = batches
        self.n = 0

    def step(self) -> None:
        batch = self.batches[self.n % len(self.batches)]
        self.n += 1
        model, optimizer = self.trainer.model, self.trainer.optimizer
        optimizer.zero_grad()
        loss, _ = model(batch)
        loss.backward()  # the fused embedding optimizer updates the tables here
        optimizer.step()


def _mlp(sizes: Sequence[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class PlainDLRM(nn.Module):
    """DLRM in plain PyTorch, shaped like torchrec's ``DLRM`` (DenseArch, InteractionArch, OverArch).

    ``forward(dense float32[B, 13], values[F] int64, offsets[F] int64[B]) -> logits float32[B]``.
    """

    triu: torch.Tensor  # int64[2, (F + 1) F / 2]: (row, column) of the upper triangle

    def __init__(
        self, rows: Sequence[int], dim: int, dense_arch: Sequence[int], over_arch: Sequence[int]
    ):
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(r, dim, mode="sum", sparse=True) for r in rows)
        self.bottom = _mlp([NUM_DENSE, *dense_arch], last_relu=True)
        f = len(rows) + 1
        self.register_buffer("triu", torch.triu_indices(f, f, offset=1), persistent=False)
        self.top = _mlp([dim + f * (f - 1) // 2, *over_arch], last_relu=False)

    def forward(
        self, dense: torch.Tensor, values: list[torch.Tensor], offsets: list[torch.Tensor]
    ) -> torch.Tensor:
        d = self.bottom(dense)  # [B, E]
        embs = [t(v, o) for t, v, o in zip(self.tables, values, offsets, strict=True)]
        combined = torch.stack([d, *embs], dim=1)  # [B, F + 1, E]
        inter = torch.bmm(combined, combined.transpose(1, 2))  # [B, F + 1, F + 1]
        flat = inter[:, self.triu[0], self.triu[1]]  # [B, (F + 1) F / 2]
        return self.top(torch.cat([d, flat], dim=1)).squeeze(-1)


def _plain_inputs(
    batch: Batch,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """A torchrec Batch -> (dense, per-feature values, per-feature bag offsets, labels)."""
    kjt = batch.sparse_features
    per_key = kjt.to_dict()
    values = [jt.values() for jt in per_key.values()]
    offsets = [jt.offsets()[:-1].contiguous() for jt in per_key.values()]
    return batch.dense_features, values, offsets, batch.labels


class PlainStepper:
    """Plain PyTorch DLRM; Adagrad on both the sparse tables and the MLPs (row-wise Adagrad,
    the trainer's embedding optimizer, is not in torch, so this uses element-wise Adagrad)."""

    def __init__(self, cfg: Config, batches: list[Batch]):
        torch.manual_seed(cfg.train.seed)
        m = cfg.model
        self.model = PlainDLRM(m.rows(), m.embedding_dim, m.dense_arch, m.over_arch)
        self.sparse_opt = torch.optim.Adagrad(
            self.model.tables.parameters(), lr=cfg.optim.embedding_lr
        )
        dense_params = [*self.model.bottom.parameters(), *self.model.top.parameters()]
        self.dense_opt = torch.optim.Adagrad(dense_params, lr=cfg.optim.dense_lr)
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.inputs = [_plain_inputs(b) for b in batches]
        self.n = 0

    def step(self) -> None:
        dense, values, offsets, labels = self.inputs[self.n % len(self.inputs)]
        self.n += 1
        self.sparse_opt.zero_grad()
        self.dense_opt.zero_grad()
        loss = self.loss_fn(self.model(dense, values, offsets), labels)
        loss.backward()
        self.sparse_opt.step()
        self.dense_opt.step()
