"""Request validation against the model's ``schema.json``, before anything reaches TorchServe.

Pure functions over a ``recsys.v1.ScoreRequest`` (or anything shaped like one): they return the
model's input tensors as numpy arrays or raise :class:`InvalidRequest` naming the field and,
where it applies, the example index. Shapes: ``B`` examples, ``D`` dense, ``F`` sparse features.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class InvalidRequest(ValueError):
    """A request the gateway refuses (gRPC INVALID_ARGUMENT); the message names the field."""


@dataclass(frozen=True)
class Limits:
    """What one request may carry; more is INVALID_ARGUMENT, naming the limit."""

    max_examples: int = 1000
    """Most examples in one request."""
    max_ids_per_feature: int = 64
    """Most ids of one sparse feature in one example."""
    max_request_bytes: int = 4 << 20
    """Largest serialized request, in bytes (the gRPC message limit is twice this)."""


@dataclass(frozen=True)
class Schema:
    """What the gateway needs from ``schema.json``."""

    model_name: str
    model_version: str
    dense: tuple[str, ...]
    sparse: tuple[str, ...]

    @classmethod
    def load(cls, path: Path) -> Schema:
        raw: dict[str, Any] = json.loads(Path(path).read_text())
        return cls(
            model_name=raw["model"]["name"],
            model_version=str(raw["model"]["version"]),
            dense=tuple(raw["features"]["dense"]),
            sparse=tuple(raw["features"]["sparse"]),
        )


def validate(
    request: Any, schema: Schema, limits: Limits, request_bytes: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ScoreRequest -> ``(dense f32[B,D], values i64[N], lengths i32[F,B])`` in schema order."""
    if request_bytes is not None and request_bytes > limits.max_request_bytes:
        raise InvalidRequest(
            f"request is {request_bytes} bytes; the limit is {limits.max_request_bytes}"
        )
    b = int(request.num_examples)
    if b < 1:
        raise InvalidRequest("num_examples: a request needs at least one example")
    if b > limits.max_examples:
        raise InvalidRequest(
            f"num_examples: {b} is over the limit of {limits.max_examples} per request"
        )
    d = len(schema.dense)
    dense = np.asarray(request.dense, dtype=np.float32)
    if dense.size != b * d:
        raise InvalidRequest(
            f"dense: {dense.size} values, but {b} examples x {d} features need {b * d}"
        )
    dense = dense.reshape(b, d)
    bad = ~np.isfinite(dense)
    if bad.any():
        i, j = (int(x[0]) for x in np.nonzero(bad))
        raise InvalidRequest(
            f"dense[{schema.dense[j]}] of example {i} is {dense[i, j]}: values must be finite"
        )

    index = {name: k for k, name in enumerate(schema.sparse)}
    order: list[int] = []  # schema position of each feature, in request order
    for feature in request.sparse:  # names and counts: cheap, per feature
        k = index.get(feature.name)
        if k is None:
            raise InvalidRequest(
                f"sparse: unknown feature '{feature.name}' (the model takes {', '.join(schema.sparse)})"
            )
        if k in order:
            raise InvalidRequest(f"sparse: feature '{feature.name}' appears twice")
        if len(feature.lengths) != b:
            raise InvalidRequest(
                f"sparse[{feature.name}].lengths: {len(feature.lengths)} entries for {b} examples"
            )
        order.append(k)
    # values: one vectorized pass over all features; the slow path only names what is wrong
    lengths = np.zeros((len(schema.sparse), b), dtype=np.int32)
    if not order:
        return dense, np.empty(0, dtype=np.int64), lengths
    given = np.stack([np.asarray(f.lengths, dtype=np.int64) for f in request.sparse])
    counts = np.fromiter((len(f.ids) for f in request.sparse), dtype=np.int64, count=len(order))
    ids_all = np.concatenate([np.asarray(f.ids, dtype=np.int64) for f in request.sparse])
    if (given < 0).any() or (given > limits.max_ids_per_feature).any():
        r, i = (int(x[0]) for x in np.nonzero((given < 0) | (given > limits.max_ids_per_feature)))
        name, n = request.sparse[r].name, int(given[r, i])
        if n < 0:
            raise InvalidRequest(f"sparse[{name}].lengths of example {i} is negative")
        raise InvalidRequest(
            f"sparse[{name}] of example {i} has {n} ids; the limit is {limits.max_ids_per_feature}"
        )
    sums = given.sum(axis=1)
    if (sums != counts).any():
        r = int(np.argmax(sums != counts))
        raise InvalidRequest(
            f"sparse[{request.sparse[r].name}]: lengths add up to {int(sums[r])} but there are "
            f"{int(counts[r])} ids"
        )
    if (ids_all < 0).any():
        pos = int(np.argmax(ids_all < 0))
        r = int(np.searchsorted(np.cumsum(counts), pos, side="right"))
        within = pos - int(counts[:r].sum())
        i = int(np.searchsorted(np.cumsum(given[r]), within, side="right"))
        raise InvalidRequest(
            f"sparse[{request.sparse[r].name}] of example {i} has a negative id ({int(ids_all[pos])})"
        )
    lengths[order] = given
    if order == sorted(order):  # the usual case: features in schema order
        return dense, ids_all, lengths
    per_feature = np.split(ids_all, np.cumsum(counts)[:-1])
    ids_of = [np.empty(0, dtype=np.int64)] * len(schema.sparse)
    for k, ids in zip(order, per_feature, strict=True):
        ids_of[k] = ids
    return dense, np.concatenate(ids_of), lengths
