"""The DLRM itself: TorchRec ``DLRM`` / ``DLRM_DCN`` with tables created on the ``meta`` device.

The pure model (no loss, no optimizer) is what export loads; ``DLRMTrain`` adds the loss for
training. Shapes: ``B`` batch, ``D`` = 13 dense features, ``F`` = 26 sparse features,
``E`` embedding dim.
"""

from __future__ import annotations

import torch
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


def build_train_model(cfg: ModelConfig, device: torch.device | str = "meta") -> DLRMTrain:
    """``DLRMTrain`` owns the BCE-with-logits loss, so the wrapped DLRM stays exportable."""
    return DLRMTrain(build_dlrm(cfg, device))


SPARSE_PREFIX = "model.sparse_arch.embedding_bag_collection"
"""Path of the EmbeddingBagCollection inside DLRMTrain (prefix of the sharded parameters)."""
