"""Request validation against the model's ``schema.json``, before anything reaches TorchServe.

Pure functions over a ``recsys.v1.ScoreRequest`` (or anything shaped like one), and over the
model's input arrays for the KServe v2 API (:func:`validate_arrays`): they return the
model's input tensors as numpy arrays or raise :class:`InvalidRequest` naming the field and,
where it applies, the example index. Shapes: ``B`` examples, ``D`` dense, ``F`` sparse features.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ECHO_CHARS = 64


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` quoted for an error message, cut to ``limit`` characters (requests are echoed
    back in errors: a megabyte of feature name must not come back as a megabyte)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


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
    max_inflight_examples: int = 16384
    """Most examples being scored at once (all tenants): the budget that weighted fair queuing
    shares across tenants (serving/gateway/fair.py). A request beyond it waits in its tenant's
    queue for its share; with nothing in flight any request within the per-request limits is
    admitted."""
    max_inflight_ids: int = 4 << 20
    """Most sparse ids being scored at once: the work of a request grows with its ids, not only
    its examples (1,000 examples x 26 features x 64 ids = 1.66M ids; x 1 id = 26k). A request's
    cost is the larger of its fractions of this budget and of ``max_inflight_examples``."""
    tenant_queue_share: float = 1.0
    """How much work one tenant may have waiting for its share, as a fraction of the budgets
    (1.0: one budget's worth); a request beyond it is refused with RESOURCE_EXHAUSTED naming
    the tenant (only that tenant's calls are refused)."""
    tenant_queue_calls: int = 256
    """Most requests one tenant may have waiting for its share."""
    door_hold_s: float = 1.0
    """How long a call whose request is still arriving holds a place in its tenant's queue (as
    the tenant's largest recent request); then its place lapses, so idle streams cannot hold
    the queue."""
    read_timeout_s: float = 10.0
    """A call that has not sent its request this many seconds after it started ends with
    DEADLINE_EXCEEDED (it frees its stream)."""

    def __post_init__(self) -> None:
        if not (self.door_hold_s > 0 and self.read_timeout_s > 0):
            raise ValueError("limits.door_hold_s and limits.read_timeout_s must be > 0")
        if not (self.tenant_queue_share > 0 and self.tenant_queue_calls >= 1):
            raise ValueError("limits.tenant_queue_share must be > 0, tenant_queue_calls >= 1")


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


def check_size(b: int, request_bytes: int | None, limits: Limits, field: str) -> None:
    """The request's bytes and example count against ``limits``; ``field`` names the count."""
    if request_bytes is not None and request_bytes > limits.max_request_bytes:
        raise InvalidRequest(
            f"request is {request_bytes} bytes; the limit is {limits.max_request_bytes}"
        )
    if b < 1:
        raise InvalidRequest(f"{field}: a request needs at least one example")
    if b > limits.max_examples:
        raise InvalidRequest(f"{field}: {b} is over the limit of {limits.max_examples} per request")


def _check_lengths(lengths: np.ndarray, schema: Schema, limits: Limits) -> None:
    """``lengths[F,B]`` (schema order): no negative count, none over the per-feature limit."""
    if not lengths.size or (lengths.min() >= 0 and lengths.max() <= limits.max_ids_per_feature):
        return  # two reductions; the first bad count is looked for only when there is one
    bad = (lengths < 0) | (lengths > limits.max_ids_per_feature)
    if bad.any():
        k, i = (int(x[0]) for x in np.nonzero(bad))
        name, n = schema.sparse[k], int(lengths[k, i])
        if n < 0:
            raise InvalidRequest(f"sparse[{name}].lengths of example {i} is negative")
        raise InvalidRequest(
            f"sparse[{name}] of example {i} has {n} ids; the limit is {limits.max_ids_per_feature}"
        )


def validate_arrays(
    dense: np.ndarray,
    values: np.ndarray,
    lengths: np.ndarray,
    schema: Schema,
    limits: Limits,
    request_bytes: int | None = None,
    field: str = "dense",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The model's inputs as arrays -> the same, checked like every API's requests.

    ``dense f32[B,D]``, ``values i64[N]``, ``lengths i32[F,B]`` in schema order (the artifact's
    own contract): finite dense values, lengths within ``limits`` adding up to ``N``, no
    negative id, at most ``limits.max_examples`` examples and ``max_request_bytes`` bytes.
    ``field`` names the example count in errors. Returns contiguous arrays of exactly those
    dtypes; raises :class:`InvalidRequest` naming the feature and example.
    """
    d, f = len(schema.dense), len(schema.sparse)
    b = int(dense.shape[0]) if dense.ndim == 2 else -1
    if dense.ndim != 2 or dense.shape[1] != d:
        raise InvalidRequest(f"dense: shape {list(dense.shape)}, the model takes [B, {d}]")
    check_size(b, request_bytes, limits, field)
    if lengths.shape != (f, b):
        raise InvalidRequest(f"lengths: shape {list(lengths.shape)}, the model takes [{f}, {b}]")
    if values.ndim != 1:
        raise InvalidRequest(f"values: shape {list(values.shape)}, the model takes [N]")
    dense = _finite(dense, schema)
    _check_lengths(lengths, schema, limits)
    per_feature = lengths.sum(axis=1, dtype=np.int64)
    if int(per_feature.sum()) != values.size:
        raise InvalidRequest(
            f"lengths add up to {int(per_feature.sum())} ids but values has {values.size}"
        )
    return _model_arrays(dense, values, lengths, schema)


def _finite(dense: np.ndarray, schema: Schema) -> np.ndarray:
    """``dense`` as contiguous f32, every value finite (else the first one is named)."""
    dense = np.ascontiguousarray(dense, dtype=np.float32)
    if not np.isfinite(dense).all():
        i, j = (int(x[0]) for x in np.nonzero(~np.isfinite(dense)))
        raise InvalidRequest(
            f"dense[{schema.dense[j]}] of example {i} is {dense[i, j]}: values must be finite"
        )
    return dense


def _model_arrays(
    dense: np.ndarray, values: np.ndarray, lengths: np.ndarray, schema: Schema
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Checked ``dense`` and ``lengths`` (adding up to ``values.size``) -> the model's arrays,
    once no id is negative (else the first one is named)."""
    values = np.ascontiguousarray(values, dtype=np.int64)
    if values.size and values.min() < 0:
        per_feature = lengths.sum(axis=1, dtype=np.int64)
        pos = int(np.argmax(values < 0))
        k = int(np.searchsorted(np.cumsum(per_feature), pos, side="right"))
        within = pos - int(per_feature[:k].sum())
        i = int(np.searchsorted(np.cumsum(lengths[k]), within, side="right"))
        raise InvalidRequest(
            f"sparse[{schema.sparse[k]}] of example {i} has a negative id ({int(values[pos])})"
        )
    return dense, values, np.ascontiguousarray(lengths, dtype=np.int32)


@dataclass
class Columns:
    """A ScoreRequest as arrays, features in request order: what both decoders produce
    (protobuf's message, :func:`columns`; the raw-bytes fast path, ``serving.gateway.wire``)."""

    examples: int
    """num_examples as sent."""
    dense: np.ndarray
    """f32[?] as sent (B x D when valid)."""
    names: list[str]
    """Sparse feature names, request order."""
    ids: np.ndarray
    """i64[N]: every feature's ids, request order."""
    ids_per_feature: np.ndarray
    """i64[F']: how many of ``ids`` each feature has."""
    lengths: np.ndarray
    """i64[?]: every feature's lengths entries, request order (F' x B when valid)."""
    entries: np.ndarray
    """i64[F']: how many lengths entries each feature has."""


def columns(request: Any) -> Columns:
    """A protobuf ``ScoreRequest`` (or anything shaped like one) as :class:`Columns`."""
    feats = request.sparse
    empty = np.zeros(0, np.int64)

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else empty

    return Columns(
        examples=int(request.num_examples),
        dense=np.asarray(request.dense, dtype=np.float32),
        names=[f.name for f in feats],
        ids=cat([np.asarray(f.ids, dtype=np.int64) for f in feats]),
        ids_per_feature=np.fromiter((len(f.ids) for f in feats), np.int64, len(feats)),
        lengths=cat([np.asarray(f.lengths, dtype=np.int64) for f in feats]),
        entries=np.fromiter((len(f.lengths) for f in feats), np.int64, len(feats)),
    )


def validate(
    request: Any, schema: Schema, limits: Limits, request_bytes: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ScoreRequest -> ``(dense f32[B,D], values i64[N], lengths i32[F,B])`` in schema order."""
    return validate_columns(columns(request), schema, limits, request_bytes)


def check_feature_count(count: int, features: int | None) -> None:
    """INVALID_ARGUMENT once a request's ``sparse`` entries are two more than the model's
    features (checked while counting, before anything walks them: their count, not the bytes,
    would set the cost). One more is left to :func:`validate_columns`, which then always finds
    an unknown or repeated name among them and names it."""
    if features is not None and count > features + 1:
        raise InvalidRequest(
            f"sparse: more than {features + 1} entries; the model has {features} features"
        )


def validate_columns(
    c: Columns, schema: Schema, limits: Limits, request_bytes: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A request's :class:`Columns` -> the model's arrays in schema order.

    Checks the request's own structure (counts, feature names) here, then the values as
    :func:`validate_arrays` does for every other API (the same checks and messages, each once)."""
    b = c.examples
    check_size(b, request_bytes, limits, "num_examples")
    d = len(schema.dense)
    if c.dense.size != b * d:
        raise InvalidRequest(
            f"dense: {c.dense.size} values, but {b} examples x {d} features need {b * d}"
        )
    dense = c.dense.reshape(b, d)
    f = len(schema.sparse)
    if c.names == list(schema.sparse) and (c.entries == b).all():  # as clients send them
        order = list(range(f))
        lengths = c.lengths.reshape(f, b)
        given = lengths
    else:
        order = _feature_order(c, schema, b)
        lengths = np.zeros((f, b), dtype=np.int64)  # int32 once checked
        if not order:
            return validate_arrays(dense, np.empty(0, dtype=np.int64), lengths, schema, limits)
        given = c.lengths.reshape(len(order), b)
        lengths[order] = given
    # values: one vectorized pass over all features; the slow path only names what is wrong
    _check_lengths(lengths, schema, limits)  # before the sums: a bad count is named as such
    sums = given.sum(axis=1)
    counts = c.ids_per_feature
    if (sums != counts).any():
        r = int(np.argmax(sums != counts))
        raise InvalidRequest(
            f"sparse[{c.names[r]}]: lengths add up to {int(sums[r])} but there are "
            f"{int(counts[r])} ids"
        )
    ids_all = c.ids
    if order != sorted(order):  # features out of schema order: regroup the ids
        per_feature = np.split(ids_all, np.cumsum(counts)[:-1])
        ids_of = [np.empty(0, dtype=np.int64)] * f
        for k, ids in zip(order, per_feature, strict=True):
            ids_of[k] = ids
        ids_all = np.concatenate(ids_of)
    # what validate_arrays checks beyond the above (they add up: ids_all.size = sum of counts)
    return _model_arrays(_finite(dense, schema), ids_all, lengths, schema)


def _feature_order(c: Columns, schema: Schema, b: int) -> list[int]:
    """The schema position of each of the request's features, in request order; raises
    :class:`InvalidRequest` at the first unknown or repeated name, or count of lengths that
    is not one per example."""
    index = {name: k for k, name in enumerate(schema.sparse)}
    order: list[int] = []
    seen: set[int] = set()
    for name, entries in zip(c.names, c.entries.tolist(), strict=True):
        k = index.get(name)
        if k is None:
            raise InvalidRequest(
                f"sparse: unknown feature {clip(name)} (the model takes {', '.join(schema.sparse)})"
            )
        if k in seen:
            raise InvalidRequest(f"sparse: feature '{name}' appears twice")
        if entries != b:
            raise InvalidRequest(f"sparse[{name}].lengths: {entries} entries for {b} examples")
        order.append(k)
        seen.add(k)
    return order
