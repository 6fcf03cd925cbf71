"""The Criteo feature layout, and the raw-feature transforms the model artifact owns.

The transforms are defined once, in :mod:`recsys_model.features` (torch only, so the served
side has them without importing training): training applies them in the data loader, and
export scripts the very same functions into every artifact, so training and serving cannot
disagree. Shapes: ``B`` batch, ``D`` dense features (13), ``F`` sparse features (26).
"""

from recsys_model.features import dense_transform, hash_ids, hash_values, pack_ids

__all__ = [
    "DENSE_NAMES",
    "MISSING_ID",
    "NUM_DENSE",
    "NUM_SPARSE",
    "SPARSE_NAMES",
    "dense_transform",
    "hash_ids",
    "hash_values",
    "pack_ids",
    "table_name",
]

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES: list[str] = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
SPARSE_NAMES: list[str] = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]
MISSING_ID = -1  # stored in binary shards for an empty categorical field (becomes length 0)


def table_name(feature: str) -> str:
    """Embedding table that serves ``feature`` (one table per feature)."""
    return f"t_{feature}"
