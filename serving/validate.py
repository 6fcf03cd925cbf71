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
    lengths = np.zeros((len(schema.sparse), b), dtype=np.int32)
    ids_of: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(schema.sparse)
    seen: set[int] = set()
    for feature in request.sparse:
        name = feature.name
        k = index.get(name)
        if k is None:
            raise InvalidRequest(
                f"sparse: unknown feature '{name}' (the model takes {', '.join(schema.sparse)})"
            )
        if k in seen:
            raise InvalidRequest(f"sparse: feature '{name}' appears twice")
        seen.add(k)
        ln = np.asarray(feature.lengths, dtype=np.int64)
        if ln.size != b:
            raise InvalidRequest(f"sparse[{name}].lengths: {ln.size} entries for {b} examples")
        ids = np.asarray(feature.ids, dtype=np.int64)
        if (ln < 0).any():
            i = int(np.argmax(ln < 0))
            raise InvalidRequest(f"sparse[{name}].lengths of example {i} is negative")
        if (ln > limits.max_ids_per_feature).any():
            i = int(np.argmax(ln > limits.max_ids_per_feature))
            raise InvalidRequest(
                f"sparse[{name}] of example {i} has {int(ln[i])} ids; the limit is {limits.max_ids_per_feature}"
            )
        if int(ln.sum()) != ids.size:
            raise InvalidRequest(
                f"sparse[{name}]: lengths add up to {int(ln.sum())} but there are {ids.size} ids"
            )
        if (ids < 0).any():
            pos = int(np.argmax(ids < 0))
            i = int(np.searchsorted(np.cumsum(ln), pos, side="right"))
            raise InvalidRequest(
                f"sparse[{name}] of example {i} has a negative id ({int(ids[pos])})"
            )
        lengths[k] = ln
        ids_of[k] = ids
    values = np.concatenate(ids_of) if any(x.size for x in ids_of) else np.empty(0, dtype=np.int64)
    return dense, values, lengths
