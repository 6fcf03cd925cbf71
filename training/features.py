"""The Criteo feature layout, and the raw-feature transforms the model artifact owns.

The transforms are defined once, in :mod:`recsys_model.features` (torch only, so the served
side has them without importing training): training applies them in the data loader, and
export scripts the very same functions into every artifact, so training and serving cannot
disagree. Shapes: ``B`` batch, ``D`` dense features (13), ``F`` sparse features (26).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recsys_model.features import dense_transform, hash_ids, hash_values, pack_ids

_TRANSFORMS = ("dense_transform", "hash_ids", "hash_values", "pack_ids")


def __getattr__(name: str) -> Any:
    """The transforms, imported with torch on first use: the layout below is torch-free, so
    what only needs names (the config, a ``--help``) does not load torch (4-5 s of CPU)."""
    if name in _TRANSFORMS:
        import recsys_model.features

        return getattr(recsys_model.features, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
