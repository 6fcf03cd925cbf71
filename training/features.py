"""The Criteo feature layout and the two raw-feature transforms the model artifact owns.

Training applies these in the data loader; export bakes the same functions into the
TorchScript artifact, so training and serving cannot disagree. Shapes: ``B`` batch,
``D`` dense features (13), ``F`` sparse features (26).
"""

import torch

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES: list[str] = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
SPARSE_NAMES: list[str] = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]
MISSING_ID = -1  # stored in binary shards for an empty categorical field (becomes length 0)


def table_name(feature: str) -> str:
    """Embedding table that serves ``feature`` (one table per feature)."""
    return f"t_{feature}"


def dense_transform(dense: torch.Tensor) -> torch.Tensor:
    """Raw Criteo integer counts ``float32[B, D]`` -> model input ``log1p(max(x, 0))``.

    Criteo's ints are heavy-tailed counts with a few negative values (I2); missing is 0.
    """
    return torch.log1p(torch.clamp(dense, min=0.0))


def hash_ids(ids: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """Raw non-negative ``int64`` ids -> table rows ``id mod num_embeddings`` (``int64``)."""
    return torch.remainder(ids, num_embeddings)
