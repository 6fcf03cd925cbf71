"""The raw-feature transforms of the model: one definition, torch only, TorchScript-able.

Every path from raw Criteo values to model inputs calls these functions: training's data loader
(``training/data/loader.py``, through ``training.features``), the TorchRec artifact
(``training/export/scorer.py``) and the portable scorer (``recsys_model/portable_model.py``).
Scripting or exporting a scorer compiles them into the artifact (a scripted model loads with
torch alone); an eager scorer in a worker imports this file from beside the handler, so it
imports nothing but torch. Shapes: ``B`` examples, ``D`` dense features, ``F`` sparse features
(tables), ``N`` ids.

Raw values, as stored and as sent: dense ints with missing = 0 (a few are negative); ids are
non-negative ``int64`` (up to the full range). In row-major rows (the binary shards, a client's
parsed TSV) a negative id marks a missing field, which :func:`pack_ids` turns into an empty bag.
"""

import torch

# What the export's schema.json says the transforms are (``transforms``).
DESCRIPTION = {"dense": "log1p(max(x, 0))", "ids": "id mod rows (per table)"}


def dense_transform(dense: torch.Tensor) -> torch.Tensor:
    """Raw Criteo integer counts ``float[B, D]`` -> model input ``log1p(max(x, 0))``.

    Criteo's ints are heavy-tailed counts with a few negative values (I2); missing is 0.
    """
    return torch.log1p(torch.clamp(dense, min=0.0))


def hash_ids(ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Raw ids -> table rows ``id mod rows`` (``int64``); ``rows`` broadcasts against ``ids``
    (one table's size, or each id's table size)."""
    return torch.remainder(ids, rows)


def hash_values(values: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Feature-major raw ids ``int64[N]`` with ``lengths int[F, B]`` -> each id's row in its
    feature's table, ``id mod rows[f]`` (``rows``: ``int64[F]``)."""
    per_feature = lengths.to(torch.int64).sum(dim=1)
    return hash_ids(values, torch.repeat_interleave(rows, per_feature))


def pack_ids(sparse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major raw ids ``int64[B, F]`` (negative = missing) -> the scorers' feature-major
    ``(values int64[N], lengths int32[F, B])``: one id per present field, none for a missing
    one. What a client does with parsed rows; the loader builds its KJT from the same pair."""
    ids = sparse.t()
    present = ids >= 0
    return ids[present].contiguous(), present.to(torch.int32).contiguous()
