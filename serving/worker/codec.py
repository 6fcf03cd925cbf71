"""The wire formats between the gateway and the TorchServe handler: numpy and struct only.

Request (little-endian), ``RSB1``::

    magic b"RSB1" | uint32 B | uint32 D | uint32 F | uint32 N
    float32[B*D] dense (row-major) | int32[F*B] lengths (feature-major) | int64[N] ids

Response: ``float32[B]`` probabilities. Batches in this format are joined by :func:`merge` (the
one feature-major merge: the gateway's coalescer joins concurrent requests into one call with
it, the handler the requests of a TorchServe batch into one forward). Decoding is zero-copy
(``np.frombuffer``; the handler wraps the views with ``torch.from_numpy``, see
``serving/worker/scoring.py``) and checks every size
against the header, so a truncated or inconsistent body is named precisely instead of crashing
a worker. Also TorchServe's default REST style (JSON ``instances``), kept for users who call
TorchServe directly.

No torch here: the gateway, the client and the load generator import this module, and keeping
torch out of them keeps their processes and images small. Inputs may be numpy arrays or
anything ``np.asarray`` takes (CPU torch tensors included).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

MAGIC = b"RSB1"
HEADER = struct.Struct("<4sIIII")
# The handler's answer to a body it refuses. TorchServe 0.12's gRPC Predictions drops the
# per-request status a handler sets (REST answers 400) and returns OK with this text as the
# prediction, so readers must check for it before decoding scores.
REJECTION = b"invalid request: "
# a Predictions input of this name (and no body) asks the worker what it serves: its answer is
# JSON {"device", "variant", "file", "dtype", "threads"} (the gateway asks once per version)
DESCRIBE = "describe"

Arrays = tuple[
    np.ndarray, np.ndarray, np.ndarray
]  # dense f32[B,D], values i64[N], lengths i32[F,B]
# up to this many parts, merge() joins ids by slicing (parts x features copies); beyond, by one
# stable sort of all ids by feature (many small requests: few ids, many slices)
SLICE_PARTS = 8


class CodecError(ValueError):
    """A body that does not decode; the message says what is wrong."""


def body_bytes(examples: int, dense: int, sparse: int, ids: int) -> int:
    """Size of an RSB1 body: ``examples`` x ``dense`` floats, ``sparse`` x ``examples``
    lengths and ``ids`` ids (ids travel as int64: up to ~8x their size in a protobuf request)."""
    return HEADER.size + 4 * examples * dense + 4 * sparse * examples + 8 * ids


def encode_request(dense: Any, values: Any, lengths: Any, prefix: bytes = b"") -> bytes:
    """``dense f32[B,D]``, ``values i64[N]``, ``lengths i32[F,B]`` -> RSB1 bytes, after
    ``prefix`` (an envelope the body goes into, written in the same single copy)."""
    dense = np.ascontiguousarray(dense, dtype=np.float32)
    lengths = np.ascontiguousarray(lengths, dtype=np.int32)
    values = np.ascontiguousarray(values, dtype=np.int64)
    b, d = dense.shape
    if lengths.ndim != 2 or lengths.shape[1] != b:
        raise CodecError(f"lengths of shape {lengths.shape} do not match {b} examples ([F, B])")
    header = HEADER.pack(MAGIC, b, d, lengths.shape[0], values.size)
    return b"".join([prefix, header, dense, lengths, values])  # buffers: one copy each


def decode_request(body: bytes | bytearray, dense_count: int, sparse_count: int) -> Arrays:
    """RSB1 bytes -> ``(dense f32[B,D], values i64[N], lengths i32[F,B])``, zero-copy views,
    checked against the header and the schema's feature counts."""
    if len(body) < HEADER.size:
        raise CodecError(f"body of {len(body)} bytes is shorter than the {HEADER.size}-byte header")
    magic, b, d, f, n = HEADER.unpack_from(body)
    if magic != MAGIC:
        raise CodecError(f"bad magic {magic!r} (expected {MAGIC!r})")
    if d != dense_count or f != sparse_count:
        raise CodecError(
            f"body has {d} dense and {f} sparse features; the model takes {dense_count} and {sparse_count}"
        )
    if b == 0:
        raise CodecError("empty request: 0 examples")
    expected = HEADER.size + 4 * b * d + 4 * f * b + 8 * n
    if len(body) != expected:
        raise CodecError(f"body is {len(body)} bytes; its header (B={b}, N={n}) needs {expected}")
    off = HEADER.size
    dense = np.frombuffer(body, dtype=np.float32, count=b * d, offset=off).reshape(b, d)
    off += 4 * b * d
    lengths = np.frombuffer(body, dtype=np.int32, count=f * b, offset=off).reshape(f, b)
    values = np.frombuffer(body, dtype=np.int64, count=n, offset=off + 4 * f * b)
    if (lengths < 0).any():
        raise CodecError("negative length")
    if int(lengths.sum(dtype=np.int64)) != n:
        raise CodecError(
            f"lengths sum to {int(lengths.sum(dtype=np.int64))} but the body has {n} ids"
        )
    return dense, values, lengths


def merge(parts: Sequence[Arrays]) -> Arrays:
    """Concatenate encoded batches: dense and lengths along B, ids kept feature-major.

    Within each feature, the ids of part 0 come first, then part 1's, ...; no loop over
    examples. A few large parts are merged by copying each part's slice of each feature (a
    sort of millions of ids would hold the gateway's event loop for a few hundred ms); many
    small ones by a stable sort of all ids by feature (:data:`SLICE_PARTS`). One part is
    returned as is."""
    if len(parts) == 1:
        return parts[0]
    dense = np.concatenate([p[0] for p in parts], axis=0)
    lengths = np.concatenate([p[2] for p in parts], axis=1)
    n_features = lengths.shape[0]
    per_feature = [p[2].sum(axis=1, dtype=np.int64) for p in parts]
    if len(parts) <= SLICE_PARTS:
        ends = [np.cumsum(n) for n in per_feature]
        pieces = [
            p[1][e[f] - n[f] : e[f]]
            for f in range(n_features)
            for p, e, n in zip(parts, ends, per_feature, strict=True)
        ]
        return dense, np.concatenate(pieces), lengths
    values = np.concatenate([p[1] for p in parts])
    feature = np.concatenate([np.repeat(np.arange(n_features), n) for n in per_feature])
    order = np.argsort(feature, kind="stable")
    return dense, values[order], lengths


def encode_response(probs: Any) -> bytes:
    """Probabilities ``[B]`` -> ``float32[B]`` bytes."""
    return np.ascontiguousarray(probs, dtype=np.float32).tobytes()


def decode_response(body: bytes) -> np.ndarray:
    """``float32[B]`` bytes -> probabilities; the handler's rejection text raises CodecError."""
    if body.startswith(REJECTION):
        raise CodecError(body.decode(errors="replace"))
    if len(body) % 4:
        raise CodecError(f"response of {len(body)} bytes is not a float32 array")
    return np.frombuffer(body, dtype=np.float32).copy()


def decode_json(obj: object, dense_names: list[str], sparse_names: list[str]) -> Arrays:
    """TorchServe's default REST style, ``{"instances": [{"dense": [..13..], "sparse": {"C1":
    [ids], ...}}, ...]}`` -> the same arrays as :func:`decode_request`."""
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("instances"), list)
        or not obj["instances"]
    ):
        raise CodecError('expected {"instances": [{"dense": [...], "sparse": {...}}, ...]}')
    rows = obj["instances"]
    index = {name: k for k, name in enumerate(sparse_names)}
    dense = np.zeros((len(rows), len(dense_names)), dtype=np.float32)
    ids: list[list[int]] = [[] for _ in sparse_names]
    lengths = np.zeros((len(sparse_names), len(rows)), dtype=np.int32)
    for i, row in enumerate(rows):
        try:
            values = row["dense"]
            if len(values) != len(dense_names):
                raise CodecError(
                    f"instances[{i}].dense has {len(values)} values; the model takes {len(dense_names)}"
                )
            dense[i] = np.asarray(values, dtype=np.float32)
            for name, feature_ids in row.get("sparse", {}).items():
                if name not in index:
                    raise CodecError(f"instances[{i}].sparse: unknown feature '{name}'")
                k = index[name]
                ids[k].extend(int(x) for x in feature_ids)
                lengths[k, i] = len(feature_ids)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            if isinstance(e, CodecError):
                raise
            raise CodecError(f"instances[{i}]: {type(e).__name__}: {e}") from None
    return dense, np.asarray([x for per in ids for x in per], dtype=np.int64), lengths


def to_rows(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Feature-major ``values``/``lengths int[F,B]`` with at most one id per (feature, example)
    -> row-major raw ids ``int64[B, F]``, -1 = missing: what a client starts from."""
    if (lengths > 1).any():
        raise CodecError("to_rows needs at most one id per feature and example")
    sparse = np.full(lengths.shape[::-1], -1, dtype=np.int64)
    present = lengths.T > 0  # [B, F]
    sparse.T[present.T] = values  # feature-major order, like the encoding
    return sparse
