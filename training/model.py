"""The DLRM itself: TorchRec ``DLRM`` / ``DLRM_DCN`` with tables created on the ``meta`` device.

The pure model (no loss, no optimizer) is what export loads; :class:`WeightedDLRMTrain` adds
the loss for training. Shapes: ``B`` batch, ``D`` = 13 dense features, ``F`` = 26 sparse features,
``E`` embedding dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain

from training.config import ModelConfig
from training.features import NUM_DENSE, SPARSE_NAMES, table_name


def table_configs(cfg: ModelConfig) -> list[EmbeddingBagConfig]:
    """One table per sparse feature, in feature order (pooling: sum)."""
    return [
        EmbeddingBagConfig(
            name=table_name(feature),
            embedding_dim=cfg.embedding_dim,
            num_embeddings=rows,
            feature_names=[feature],
        )
        for feature, rows in zip(SPARSE_NAMES, cfg.rows(), strict=True)
    ]


def build_dlrm(cfg: ModelConfig, device: torch.device | str = "meta") -> DLRM:
    """The pure model: ``(dense float32[B, D], KJT of F features) -> logits float32[B, 1]``.

    On ``meta`` the embedding tables take no memory: DistributedModelParallel materializes
    only each rank's shards. The MLPs are created on ``dense_device`` (CPU) so that their
    initialization does not depend on the world size.
    """
    ebc = EmbeddingBagCollection(tables=table_configs(cfg), device=torch.device(device))
    dense_device = torch.device("cpu") if str(device) == "meta" else torch.device(device)
    common = dict(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=list(cfg.dense_arch),
        over_arch_layer_sizes=list(cfg.over_arch),
        dense_device=dense_device,
    )
    if cfg.arch == "dlrm_dcn":
        return DLRM_DCN(
            dcn_num_layers=cfg.dcn_num_layers, dcn_low_rank_dim=cfg.dcn_low_rank_dim, **common
        )
    return DLRM(**common)


class WeightedDLRMTrain(DLRMTrain):
    """TorchRec's ``DLRMTrain`` with each row's loss weighted by the batch's ``weights``
    (training/data/loader.py's ``WeightedBatch``): 0 for the rows that pad an epoch's last
    batch, ``G / rows`` for its real ones, 1 in a full batch, where the loss is exactly
    ``DLRMTrain``'s (the mean BCE-with-logits). Same parameters and state-dict keys."""

    def forward(self, batch: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``batch`` of B rows -> ``(loss, (loss, logits float32[B], labels float32[B]))``."""
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        per_row = functional.binary_cross_entropy_with_logits(
            logits, batch.labels.float(), reduction="none"
        )
        loss = (per_row * batch.weights).mean()
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


def build_train_model(cfg: ModelConfig, device: torch.device | str = "meta") -> DLRMTrain:
    """The DLRM in :class:`WeightedDLRMTrain`, which owns the loss, so it stays exportable."""
    return WeightedDLRMTrain(build_dlrm(cfg, device))


SPARSE_PREFIX = "model.sparse_arch.embedding_bag_collection"
"""Path of the EmbeddingBagCollection inside DLRMTrain (prefix of the sharded parameters)."""
